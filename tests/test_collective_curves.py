"""theory/collective_curves.py: measured nccl-tests curves behind time.collective_time."""
import csv

import pytest
from hypothesis import given, settings, strategies as st

from labkit.theory import collective_curves as cc, hardware, plan_cluster, time as T

ROWS = list(csv.DictReader(cc.CURVES_CSV.open(newline="")))


def link_of(name):
    """The Link a curve names: a table link, or ring_link's 'X x k NICs' (k of X at once)."""
    return cc.measured_link(next(c for c in cc.curves().values() if c.link == name))


def test_every_row_has_a_source():
    assert ROWS
    for r in ROWS:
        assert r["source"].startswith(("https://github.com/NVIDIA/nccl-tests/issues/",
                                       "https://github.com/stas00/ml-engineering/")), r


def test_the_table_busbw_matches_its_time():
    """busbw column = nccl-tests' convention applied to bytes / time (doc/PERFORMANCE.md)."""
    for r in ROWS:
        n, size, t = int(r["ranks"]), float(r["bytes"]), float(r["time_us"]) * 1e-6
        assert cc.bus_factor(r["op"], n) * size / t / 1e9 == pytest.approx(
            float(r["busbw_gbs"]), rel=2e-3, abs=0.01)   # times print 4-5 digits


def test_the_curve_returns_its_own_points():
    for c in cc.curves().values():
        ln = link_of(c.link)
        for i, (size, t) in enumerate(zip(c.sizes, c.times)):
            assert cc.busbw(c, size) == c.busbws[i]
            if t >= max(c.times[:i + 1]):   # not a dip below a smaller message's time
                assert cc.curve_own_time(c, size, T.ring_steps) == pytest.approx(t, rel=1e-12)
                assert T.collective_time(c.op, size, c.ranks, ln) == pytest.approx(t, rel=1e-12)


def test_busbw_never_exceeds_the_line_rate():
    """On the wire: busbw for ring and tree algorithms; NVLink SHARP (NVLS) reduces in the
    switch, so its wire bandwidth is algbw x (n+1)/n (sjeaugey, nccl-tests issue 212)."""
    for r in ROWS:
        n, line = int(r["ranks"]), link_of(r["link"]).bandwidth / 1e9
        busbw = float(r["busbw_gbs"])
        wire = busbw / cc.bus_factor(r["op"], n) * (n + 1) / n if r["algo"] == "NVLS" else busbw
        assert wire <= line, r
    for c in cc.curves().values():
        ln = link_of(c.link)
        for size in (2.0 ** k for k in range(3, 40)):
            t = cc.curve_own_time(c, size, T.ring_steps)
            assert cc.bus_factor(c.op, c.ranks) * size / t <= max(c.busbws) * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(sorted(cc.curves())), a=st.floats(0, 40), b=st.floats(0, 40),
       n=st.integers(2, 4096), m=st.integers(2, 4096))
def test_time_is_monotone_in_bytes_and_group_size(key, a, b, n, m):
    c = cc.curves()[key]
    ln = link_of(c.link)
    small, large = sorted((2.0 ** a, 2.0 ** b))
    few, many = sorted((n, m))
    t = lambda size, k: T.collective_time(c.op, size, k, ln)   # noqa: E731
    assert t(small, few) <= t(large, few) * (1 + 1e-12)
    assert t(small, few) <= t(small, many) * (1 + 1e-12)
    assert t(small, few) > 0


def test_a_link_without_a_curve_keeps_alpha_beta():
    for op, link in (("all_gather", "NVLink 4"), ("all_reduce", "InfiniBand HDR"),
                     ("reduce_scatter", "InfiniBand NDR")):
        ln = hardware.link(link)
        assert cc.curve(ln, op) is None
        n, nbytes = 8, 64e6
        expected = (T.ring_steps(op, n) * ln.latency
                    + T.busiest_rank_bytes(op, nbytes, n) / (ln.bandwidth * ln.efficiency))
        assert T.collective_time(op, nbytes, n, link) == pytest.approx(expected)


def test_ring_link_over_every_nic_finds_the_curve():
    c = plan_cluster.make_cluster("H100", gpus=64)
    ln = c.ring_link(64, 64)
    assert cc.curve(ln, "all_reduce") is not None
    assert cc.curve(c.ring_link(8, 64), "all_reduce") is None   # one member a node: one NIC


def test_sourced_efficiencies():
    assert hardware.link("NVLink 4").effective_bandwidth / 1e9 == pytest.approx(370, rel=0.01)
    assert hardware.link("NVLink 3").effective_bandwidth / 1e9 == pytest.approx(230, rel=0.01)
    assert hardware.link("NDR").effective_bandwidth / 1e9 == pytest.approx(47, rel=0.01)


def test_no_torch_import():
    import subprocess
    import sys
    code = ("import sys, labkit.theory.collective_curves, labkit.theory.time; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 8, 64])
def test_bus_bytes_are_the_ring_wire_bytes(op, n):
    """nccl-tests' bus bytes (bus factor x size S; all_gather's S the gathered output,
    reduce_scatter's the input each rank holds) = time.py's ring bytes a rank sends."""
    nbytes = 3e6
    bus = cc.bus_factor(op, n) * cc.nccl_size(op, nbytes, n)
    assert bus == pytest.approx(T.wire_bytes_per_rank(op, nbytes, n))


def test_a100_nvlink3_all_reduce_reads_its_curve():
    c = cc.curve("NVLink 3", "all_reduce")
    assert c is not None and c.ranks == 8
    assert T.collective_time("all_reduce", 2 ** 34, 8, "NVLink 3") == pytest.approx(127997e-6)
    assert c.busbws[-1] / 1e9 == pytest.approx(234.89, rel=1e-3)

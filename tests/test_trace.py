"""The clock's comm lane records each collective's exposed and hidden time; a run's timeline
exports as Chrome trace JSON (Perfetto): fields, units, ordering, the CLI's --trace."""
import json

import pytest
import torch

import labkit
from labkit.cli import main
from labkit.runtime import trace
from labkit.theory import hardware, kernels
from labkit.theory.time import collective_time

# By hand from data/hardware.csv (not through theory/'s formulas): an H100 runs compute at its
# measured MAMF (bf16) x the fitted in-step GEMM fraction (data/kernels.csv).
H100_FLOP_S = hardware.gpu("H100").mamf_bf16_flops * kernels.IN_STEP_GEMM_FRACTION
# a 1 MB all-reduce on 2 ranks of NVLink 4: what the clock's time model says
# (theory/time.collective_time: NVLink 4's measured all_reduce curve)
ALL_REDUCE_1MB = collective_time("all_reduce", 1e6, 2, "NVLink 4")
SHORT_FLOPS = 1e9     # 1.6 us of compute: shorter than the all-reduce


def overlapped_and_not(ctx):
    hidden = ctx.comm.all_reduce(torch.ones(250_000), async_op=True, tag="hidden")
    ctx.clock.add_compute("long independent work", 2e11)        # ~330 us
    hidden.wait()
    partly = ctx.comm.all_reduce(torch.ones(250_000), async_op=True, tag="partly hidden")
    ctx.clock.add_compute("short independent work", SHORT_FLOPS)
    partly.wait()
    ctx.comm.all_reduce(torch.ones(250_000), tag="blocking")
    peer = 1 - ctx.rank
    send = ctx.comm.send(torch.ones(10), peer, async_op=True)
    ctx.comm.recv(torch.zeros(10), peer)
    send.wait()
    return ctx.clock.timeline()


@pytest.fixture(scope="module")
def timeline():
    return [e for rank in labkit.launch(overlapped_and_not, 2) for e in rank]


def test_each_collective_records_its_exposed_and_hidden_time(timeline):
    reduces = [e for e in timeline if e["name"] == "all_reduce" and e["rank"] == 0]
    hidden, partly, blocking = reduces
    for e in reduces:
        assert e["end"] - e["start"] == pytest.approx(ALL_REDUCE_1MB)
        assert e["meta"]["exposed_s"] + e["meta"]["hidden_s"] == pytest.approx(ALL_REDUCE_1MB)
    assert hidden["lane"] == "comm" and hidden["meta"]["exposed_s"] == 0.0
    short = SHORT_FLOPS / H100_FLOP_S
    assert partly["meta"]["hidden_s"] == pytest.approx(short)
    assert partly["meta"]["exposed_s"] == pytest.approx(ALL_REDUCE_1MB - short)
    assert blocking["lane"] == "compute" and blocking["meta"]["hidden_s"] == 0.0
    summary = trace.overlap_by_op(timeline, rank=0)["all_reduce"]
    assert summary["calls"] == 3
    assert summary["exposed_s"] == pytest.approx(2 * ALL_REDUCE_1MB - short)


def test_chrome_trace_fields_units_and_order(timeline, tmp_path):
    path = tmp_path / "run.json"
    trace.to_trace(timeline, path, cluster="8xH100-NVLink", technique="test")
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0 · modelled on 8xH100-NVLink"),
                     (1, "rank 1 · modelled on 8xH100-NVLink"),
                     (2, "rank 0 · measured wall, this machine"),
                     (3, "rank 1 · measured wall, this machine")}
    for e in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["dur"] >= 0 and e["tid"] in (0, 1, 2, 3)
    # modelled times in microseconds: the first (hidden) all-reduce on rank 0's comm thread
    first = next(e for e in spans if e["pid"] == 0 and e["tid"] == 1)
    assert first["name"] == "all_reduce" and first["ts"] == pytest.approx(0.0)
    assert first["dur"] == pytest.approx(ALL_REDUCE_1MB * 1e6)
    assert first["args"]["exposed_us"] == 0.0 and first["args"]["bytes"] == 1_000_000
    # sorted by process, thread, start; compute and the comm stream never run two things at once
    keys = [(e["pid"], e["tid"], e["ts"]) for e in spans]
    assert keys == sorted(keys)
    for pid in (0, 1):
        for tid in (0, 1):
            lane = [e for e in spans if e["pid"] == pid and e["tid"] == tid]
            for a, b in zip(lane, lane[1:]):
                assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a, b)
    # p2p on threads of their own, modelled and measured, on both ranks
    p2p = {(e["pid"], e["tid"], e["name"]) for e in spans if e["tid"] >= 2}
    assert p2p == {(pid, tid, f"{word} {1 - pid % 2}") for pid in range(4)
                   for tid, word in ((2, "send to"), (3, "recv from"))}


def test_run_writes_a_trace_and_refuses_a_missing_folder(tmp_path, capsys):
    path = tmp_path / "dp.json"
    assert main(["run", "dp", "--world-size", "2", "--steps", "1", "--trace", str(path)]) == 0
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert any(e["name"] == "all_reduce" for e in spans)
    assert main(["run", "single", "--trace", str(tmp_path / "no" / "t.json")]) == 2
    assert "folder does not exist" in capsys.readouterr().err

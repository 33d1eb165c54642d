"""Collective times read off published nccl-tests curves (labkit/tables/collective_curves.csv).

A collective's bus bandwidth grows with its message size: a few KB pay only latency, GBs run
near the link's effective rate. Where data/collective_curves.csv holds a measured nccl-tests
curve for an op on a link, `curve_time` returns the curve's time: the bus bandwidth
(busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and reduce_scatter, with
the size the whole buffer; nccl-tests doc/PERFORMANCE.md) is interpolated linearly in
log(bytes) between the measured sizes, and time = the busbw-convention bytes / that busbw, so
the table's own points come back exactly; a point whose time dips below a smaller message's
(run-to-run noise) takes the larger, so time never falls as bytes grow. Beyond the largest size
the largest busbw holds; below the smallest, time falls linearly to the latency floor (the
smaller of the smallest message's time and the alpha-beta ring steps x link latency). A group of
n ranks on a curve measured with n_c: the floor scales with ring steps (2(n-1) for all_reduce)
and the rest with the bus bytes factor, so n = n_c gives the curve itself (a simplification:
NVLS and tree algorithms do not grow their latency with ring steps). Sources, one a row: 8 H100
SXM on NVLink 4 (nccl-tests issue 290, NVLS all_reduce), 4 nodes of 8 H100 with 8 NDR NICs
each (nccl-tests issue 309) and 8 A100 SXM on NVLink 3 (all_reduce 32 KB-16 GB, Stas Bekman's
ml-engineering network/README.md). A link and op without a curve keeps time.py's alpha-beta
model; all_gather and reduce_scatter curves would follow nccl_size's and bus_factor's
conventions, but no published table with the numbers in text was found for them yet.
"""
from __future__ import annotations

import csv
import functools
import math
import re
from dataclasses import dataclass, replace

from .hardware import TABLES, Link, link as find_link

CURVES_CSV = TABLES / "collective_curves.csv"


@dataclass(frozen=True)
class Curve:
    link: str
    op: str
    ranks: int
    algo: str
    sizes: tuple        # nccl-tests size S in bytes, ascending
    times: tuple        # measured seconds at each size
    source: str

    @property
    def busbws(self) -> tuple:
        """Bytes/s: bus bytes / measured time (the table's busbw column, unrounded)."""
        f = bus_factor(self.op, self.ranks)
        return tuple(f * s / t for s, t in zip(self.sizes, self.times))


def bus_factor(op, n) -> float:
    """nccl-tests' busbw / algbw for op over n ranks (doc/PERFORMANCE.md)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0   # broadcast, reduce, send


def nccl_size(op, nbytes, n) -> float:
    """nccl-tests' size S of a call whose rank hands the op nbytes: all_gather's S is the
    gathered output (n x the shard); the others' S is the buffer each rank holds."""
    return n * nbytes if op == "all_gather" else float(nbytes)


def _below(sizes, size) -> int:
    """How many of the ascending sizes are <= size."""
    return sum(1 for s in sizes if s <= size)


@functools.lru_cache(maxsize=None)
def curves() -> dict:
    """(link name, op) -> Curve, from labkit/tables/collective_curves.csv."""
    rows = {}
    with CURVES_CSV.open(newline="") as f:
        for r in csv.DictReader(f):
            rows.setdefault((r["link"], r["op"]), []).append(r)
    out = {}
    for key, rs in rows.items():
        rs.sort(key=lambda r: float(r["bytes"]))
        out[key] = Curve(key[0], key[1], int(rs[0]["ranks"]), rs[0]["algo"],
                         tuple(float(r["bytes"]) for r in rs),
                         tuple(float(r["time_us"]) * 1e-6 for r in rs), rs[0]["source"])
    return out


def curve(link, op):
    """The measured curve for op on link (a Link or its name), or None."""
    name = link.name if isinstance(link, Link) else str(link)
    return curves().get((name, op))


def busbw(c: Curve, size) -> float:
    """The curve's bus bandwidth (bytes/s) at nccl-tests size `size`, interpolated linearly in
    log(bytes); the largest size's beyond it, the smallest's below it."""
    sizes, bws = c.sizes, c.busbws
    if size >= sizes[-1]:
        return bws[-1]
    if size <= sizes[0]:
        return bws[0]
    i = _below(sizes, size) - 1
    x = (math.log(size) - math.log(sizes[i])) / (math.log(sizes[i + 1]) - math.log(sizes[i]))
    return bws[i] + x * (bws[i + 1] - bws[i])


def measured_link(c: Curve) -> Link:
    """The link the curve was measured on: a table link, or ring_link's 'X x k NICs' (k of
    link X at once)."""
    wide = re.fullmatch(r"(.+) x (\d+) NICs", c.link)
    if not wide:
        return find_link(c.link)
    base = find_link(wide[1])
    return replace(base, name=c.link, bandwidth=int(wide[2]) * base.bandwidth)


def _floor(c: Curve, steps) -> float:
    """Seconds a message of (almost) no bytes takes on the curve's own rank count."""
    return min(c.times[0], steps(c.op, c.ranks) * measured_link(c).latency)


def curve_own_time(c: Curve, size, steps) -> float:
    """Seconds for nccl-tests size `size` at the curve's own rank count; steps(op, n) is the
    ring's message count (time.ring_steps, passed in: time.py imports this module)."""
    f = bus_factor(c.op, c.ranks)
    if size < c.sizes[0]:
        floor = _floor(c, steps)
        return floor + (c.times[0] - floor) * max(size, 0.0) / c.sizes[0]
    t = f * size / busbw(c, size)
    return max(t, max(c.times[:_below(c.sizes, size)]))   # never below a smaller message's


def curve_time(op, nbytes, group_size, link, steps):
    """Seconds for `op` of nbytes (what each rank hands the op, as time.collective_time) over
    group_size ranks on `link`, from its measured curve; None when the link has no curve for
    op; steps = time.ring_steps. group_size != the curve's ranks: the latency floor x ring
    steps(n) / steps(n_c), the rest x bus factor(n) / bus factor(n_c); a link named as the
    curve's but with other latency or bandwidth scales the two parts by their ratios."""
    c = curve(link, op)
    if c is None or group_size <= 1:
        return None
    own = curve_own_time(c, nccl_size(op, nbytes, group_size), steps)
    floor = min(_floor(c, steps), own)
    more = steps(op, group_size) / steps(op, c.ranks)
    wide = bus_factor(op, group_size) / bus_factor(op, c.ranks)
    # a link of the curve's name but other numbers (a what-if): its latency and effective
    # bandwidth against the measured link's scale the two parts
    ln, base = find_link(link), measured_link(c)
    slower = base.effective_bandwidth / ln.effective_bandwidth
    return floor * more * ln.latency / base.latency + (own - floor) * wide * slower

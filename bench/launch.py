"""How long launch takes to start and join N ranks, and what the comm log and clock cost.

Start-up: wall seconds for `launch(noop, N)`, the first call (forkserver imports torch once)
and later calls. Overhead: the same loop of small all_reduces through `torch.distributed`
directly, through `ctx.comm` with the clock off (log only), and with the clock on (its stamps
ride in the all_reduce as 4 slots per rank); ratios instrumented / raw, measured in the same
ranks in the same run. What the instruments cost a whole data-parallel step: bench/runtime.py.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import median, replace_rows  # noqa: E402

CALLS = 300


def noop(ctx):
    return ctx.rank


def collective_loop(ctx, numel):
    t = torch.ones(numel)
    timings = {}
    for label in ("raw", "log only", "log + clock", "raw again"):
        ctx.clock.enabled = label == "log + clock"
        dist.barrier()
        start = time.perf_counter()
        for _ in range(CALLS):
            if label.startswith("raw"):
                dist.all_reduce(t)
            else:
                ctx.comm.all_reduce(t)
        timings[label] = (time.perf_counter() - start) / CALLS
    return timings


def main():
    rows = []
    print("start and join (wall seconds, measured here)")
    for n in (2, 4, 8):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            labkit.launch(noop, n)
            times.append(time.perf_counter() - start)
        print(f"  {n} ranks: first {times[0]:.2f} s, then {median(times[1:]):.2f} s")
        rows.append(dict(benchmark="launch", labkit_impl="launch", world_size=n,
                         metric="start_join_s", labkit=f"{median(times[1:]):.3f}",
                         notes=f"first call {times[0]:.2f} s (forkserver imports torch once)"))
    print(f"\ncomm log and clock overhead, {CALLS} all_reduces per variant (per call, wall)")
    for numel in (1, 250_000):
        per_rank = labkit.launch(collective_loop, 4, numel)
        t = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        raw = min(t["raw"], t["raw again"])
        for label in ("log only", "log + clock"):
            ratio = t[label] / raw
            print(f"  {numel * 4:>9} B  {label:<12} {t[label] * 1e6:8.1f} us vs raw "
                  f"{raw * 1e6:8.1f} us  ratio {ratio:.2f}")
            rows.append(dict(benchmark="comm_overhead", labkit_impl=f"ctx.comm ({label})",
                             torch_impl="dist.all_reduce", world_size=4,
                             metric=f"s_per_call_{numel * 4}B", labkit=f"{t[label]:.2e}",
                             torch=f"{raw:.2e}", labkit_over_torch=f"{ratio:.2f}",
                             notes="gloo CPU; the clock's stamps ride in the all_reduce"))
    replace_rows(rows)


if __name__ == "__main__":
    main()

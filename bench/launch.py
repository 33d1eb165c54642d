"""How long launch takes to start and join N ranks, and what the comm log and clock cost.

Start-up: wall seconds for `launch(noop, N)`, the first call (forkserver imports torch once)
and later calls. Overhead: the same loop of all_reduces (256 bytes, 1 MB) through
`torch.distributed` directly, through `ctx.comm` with the clock off (log only), and with the
clock on (each rank posts its issue time on the launch's store), in interleaved rounds in the
same ranks; ratios instrumented / raw, median and spread over the rounds. What the instruments
cost a whole data-parallel step: bench/runtime.py.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import compared_row, interleaved_rounds, median, replace_rows  # noqa: E402

CALLS = 60    # all_reduces per variant and round
ROUNDS = 7
LAUNCHES = 100  # back-to-back launches for the tail (p99) of start and join
VARIANTS = ("raw", "log only", "log + clock")


def noop(ctx):
    return ctx.rank


def collective_loop(ctx, numel):
    """Seconds per call of each variant, one value per interleaved round (the slowest rank's)."""
    t = torch.ones(numel)

    def variant(label):
        def one_round():
            ctx.clock.enabled = label == "log + clock"
            dist.barrier()
            start = time.perf_counter()
            for _ in range(CALLS):
                if label == "raw":
                    dist.all_reduce(t)
                else:
                    ctx.comm.all_reduce(t)
            return (time.perf_counter() - start) / CALLS
        return one_round
    per_round = interleaved_rounds({label: variant(label) for label in VARIANTS}, ROUNDS)
    slowest = torch.tensor([per_round[label] for label in VARIANTS], dtype=torch.float64)
    dist.all_reduce(slowest, dist.ReduceOp.MAX)
    return dict(zip(VARIANTS, slowest.tolist()))


def _timed_launch(n):
    start = time.perf_counter()
    labkit.launch(noop, n)
    return time.perf_counter() - start


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
    times = sorted(_timed_launch(2) for _ in range(LAUNCHES))
    p50, p99 = times[len(times) // 2], times[int(0.99 * (len(times) - 1))]
    print(f"  {LAUNCHES} launches of 2 ranks: median {p50:.3f} s, p99 {p99:.3f} s, "
          f"max {times[-1]:.3f} s (a 5 s name-lookup stall would show in p99)")
    rows.append(dict(benchmark="launch", labkit_impl="launch", world_size=2,
                     metric=f"start_join_p99_of_{LAUNCHES}_s", labkit=f"{p99:.3f}",
                     notes=f"median {p50:.3f} s, max {times[-1]:.3f} s; FileStore rendezvous "
                           f"(no reverse name lookup)"))
    print(f"\ncomm log and clock overhead, {CALLS} all_reduces per variant in each of {ROUNDS} "
          f"interleaved rounds (per call, wall, slowest rank)")
    # 256 bytes, not 4: gloo reduces fewer elements than ranks by a shortcut (4 ranks: 0.6 ms
    # against 3-8 ms for 4+ elements here)
    for numel in (64, 250_000):
        t = labkit.launch(collective_loop, 4, numel)[0]
        for label in ("log only", "log + clock"):
            row = compared_row(dict(benchmark="comm_overhead", labkit_impl=f"ctx.comm ({label})",
                                    torch_impl="dist.all_reduce", world_size=4),
                               f"s_per_call_{numel * 4}B", t[label], t["raw"],
                               notes="gloo CPU, 2 shared cores; the clock posts issue times "
                                     "on the launch's store", value_format="{:.2e}")
            print(f"  {numel * 4:>9} B  {label:<12} {row['labkit']} s vs raw {row['torch']} s  "
                  f"ratio {row['labkit_over_torch']} ({row['spread_min']}..{row['spread_max']})")
            rows.append(row)
    replace_rows(rows)


if __name__ == "__main__":
    main()

"""What labkit's instruments (comm log + memory tracker + virtual clock) cost a data-parallel step.

One launch per model and world size. In it every rank runs the same data-parallel step (a TinyGPT
wrapped in labkit's `DistributedDataParallel`: bucket all-reduces started from backward hooks,
as in torch's, then the optimizer step) with its instruments switched on in four combinations,
interleaved round by round with the order rotating, so that none profits from a warmer or
quieter machine:
  bare          every instrument off: the comm log not recording, the clock off, no memory
                tracking (the same step inside `ctx.off_the_record()` without the tracker);
  log + memory  the comm log and `ctx.memory.track_activations()` with a sample per step;
  log + clock   the comm log and the clock: `ctx.clock.compute` regions count FLOPs, each
                collective is placed on the modelled timeline;
  instrumented  all three: what a lesson runs.
Per round and variant: the slowest rank's wall seconds per step (measured, after a warm-up),
and the CPU seconds of all ranks together (less sensitive to other work on a shared machine).
Reported: each variant / bare per round, median and spread (min..max) over the rounds (the
clock sends nothing through the collectives: its issue times go to the launch's store).
Run: python bench/runtime.py [--rounds R] [--steps S] [--world-sizes 2 4] [--models tiny small]
     [--no-csv]   (rows are appended to data/bench.csv; the machine may be shared: say so)
"""
import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import labkit  # noqa: E402
from labkit import data  # noqa: E402
from labkit.parallel.data_parallel import DistributedDataParallel  # noqa: E402
from labkit.runs import reference  # noqa: E402
from common import compared_row, interleaved_rounds, replace_rows  # noqa: E402

# name -> (model shape, global batch): lesson 01's tiny GPT and its larger "small" run
MODELS = {"tiny": ({}, 8), "small": (dict(hidden=128, layers=4, ffn=512), 32)}
# What each variant switches on. "bare": the same step with every instrument off.
VARIANTS = {"bare": (), "log + memory": ("log", "memory"), "log + clock": ("log", "clock"),
            "instrumented": ("log", "memory", "clock")}
BUCKET_MB = 0.25   # the lesson's default: the tiny model's 0.47 MB of gradients in two buckets


def dp_overhead(ctx, model_kwargs, global_batch, rounds, steps, warmup):
    cfg = reference.RunConfig(model_kwargs=model_kwargs, global_batch=global_batch)
    model = DistributedDataParallel(reference.build_model(cfg), bucket_cap_mb=BUCKET_MB)
    optimizer = reference.build_optimizer(model.parameters(), cfg)
    ctx.memory.watch(model=model, optimizer=optimizer)
    x, y = reference.batch(model.module, cfg, 0)
    x, y = data.shard(x, ctx.rank, ctx.world_size), data.shard(y, ctx.rank, ctx.world_size)

    def step(on):
        """One data-parallel step; `on`: the instruments switched on ("log", "memory", "clock")."""
        region = ctx.clock.compute if "clock" in on else _no_region
        optimizer.zero_grad(set_to_none=True)
        with ctx.memory.track_activations() if "memory" in on else nullcontext():
            with region("forward"):
                loss = model(x, y)
            with region("backward"):    # the bucket all-reduces start and finish in here
                loss.backward()
        with region("optimizer step"):
            optimizer.step()

    def run(variant, n):
        on = VARIANTS[variant]
        was = ctx.comm.recording, ctx.clock.enabled
        ctx.comm.recording, ctx.clock.enabled = "log" in on, "clock" in on
        try:
            for i in range(n):
                if "memory" in on or "clock" in on:
                    with ctx.step(i):   # memory sample + clock mark
                        step(on)
                else:
                    step(on)
        finally:
            ctx.comm.recording, ctx.clock.enabled = was

    cpu = {variant: [] for variant in VARIANTS}

    def measure(variant):
        def one_round():
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            run(variant, steps)
            cpu[variant].append((time.process_time() - cpu_started) / steps)
            return (time.perf_counter() - started) / steps
        return one_round

    for variant in VARIANTS:
        run(variant, warmup)
    wall = interleaved_rounds({v: measure(v) for v in VARIANTS}, rounds=rounds, warmup=1)
    names = list(VARIANTS)
    per_round = []
    for r in range(rounds):   # the slowest rank's wall time; the CPU time of all ranks
        slowest = torch.tensor([wall[v][r] for v in names], dtype=torch.float64)
        dist.all_reduce(slowest, dist.ReduceOp.MAX)
        cpu_all = torch.tensor([cpu[v][r + 1] for v in names], dtype=torch.float64)
        dist.all_reduce(cpu_all)
        per_round.append(dict(zip(names, slowest.tolist()),
                              cpu=dict(zip(names, cpu_all.tolist()))))
    run("instrumented", 1)   # the last step on the clock: its modelled time
    return dict(rounds=per_round, modelled_step_s=ctx.clock.step_times()[-1],
                grad_bytes=sum(model.bucket_sizes))


def _no_region(name):
    return nullcontext()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--no-csv", action="store_true")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    rows = []
    for name in args.models:
        shape, global_batch = MODELS[name]
        for n in args.world_sizes:
            load = os.getloadavg()[0]
            out = labkit.launch(dp_overhead, n, shape, global_batch, args.rounds, args.steps,
                                args.warmup, timeout_s=1800)[0]
            rounds = out["rounds"]
            print(f"\n{name} GPT {shape or 'default'}, batch {global_batch}, {n} ranks, "
                  f"{out['grad_bytes'] / 1e6:.2f} MB of gradients, modelled step "
                  f"{out['modelled_step_s'] * 1e3:.4f} ms")
            for variant in VARIANTS:
                ms = [r[variant] * 1e3 for r in rounds]
                ratios = [r[variant] / r["bare"] for r in rounds]
                cpu = [r["cpu"][variant] / r["cpu"]["bare"] for r in rounds]
                print(f"  {variant:<13} {statistics.median(ms):8.2f} ms/step "
                      f"(rounds {min(ms):.2f}..{max(ms):.2f})  / bare: median "
                      f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}.."
                      f"{max(ratios):.2f}x); CPU seconds / bare: {statistics.median(cpu):.2f}x "
                      f"({min(cpu):.2f}..{max(cpu):.2f}x)")
                if variant == "bare":
                    continue
                base = dict(benchmark="instrumentation", labkit_impl=f"DP step, {variant}",
                            torch_impl="DP step, instruments off", world_size=n)
                notes = (f"{name} GPT {shape or 'default'}, batch {global_batch}; gloo CPU on "
                         f"{os.cpu_count()} shared cores, load {load:.1f}; labkit_over_torch "
                         f"here: this variant / the same step with instruments off")
                rows.append(compared_row(base, f"step_s ({name} GPT)",
                                         [r[variant] for r in rounds],
                                         [r["bare"] for r in rounds], notes))
                rows.append(compared_row(base, f"cpu_s_all_ranks ({name} GPT)",
                                         [r["cpu"][variant] for r in rounds],
                                         [r["cpu"]["bare"] for r in rounds], notes))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if not args.no_csv:
        replace_rows(rows)


if __name__ == "__main__":
    main()

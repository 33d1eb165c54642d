"""labkit's GPipe and 1F1B against torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B).

Same TinyGPT, same split (labkit's balanced split: every rank gets the same modules), the same
micro-batches and world size, gloo on CPU, in one run. For each schedule: median wall step time
(warm-up excluded, labkit's clock off), first-stage peak activation bytes (both measured by
labkit's saved-tensor tracker), and the largest gradient difference after one identical step.
"""
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from labkit import pipeline as pp  # noqa: E402
from labkit.runs import reference  # noqa: E402
from labkit.runtime.memory import MemoryTracker  # noqa: E402
from common import append_rows, median  # noqa: E402

WORLD, MICRO, WARMUP, ITERS = 4, 8, 2, 8
CFG = reference.RunConfig(steps=1, global_batch=32, optimizer="sgd",
                          model_kwargs=dict(layers=8, hidden=128, heads=4, seq=64, vocab=256,
                                            ffn=512))
TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def clock_off(ctx):
    """Turn labkit's clock off for timing (raw wall clock, like torch's side)."""
    ctx.clock.enabled = False


def bench_rank(ctx, cfg, schedule_name):
    p, rank = ctx.world_size, ctx.rank
    model = reference.build_model(cfg)
    x, y = reference.batch(model, cfg, 0)
    micro = list(zip(x.chunk(MICRO), y.chunk(MICRO)))
    ours = pp.build_chunks(model, rank, p)
    theirs = copy.deepcopy(ours[0])             # identical weights for torch's stage
    ops = pp.make_schedule(schedule_name, p, MICRO)
    stage = PipelineStage(theirs, rank, p, device=torch.device("cpu"))
    schedule = TORCH_SCHEDULES[schedule_name](stage, MICRO, loss_fn=loss_fn)

    def labkit_step():
        run_schedule_step(ctx, ours, ops, micro)

    def torch_step():
        for q in theirs.parameters():
            q.grad = None
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()

    # 1) equal gradients after one identical step; peak activations on each rank (measured)
    peaks = {}
    for name, step, module in (("labkit", labkit_step, ours[0]), ("torch", torch_step, theirs)):
        clock_off(ctx)
        ctx.memory = MemoryTracker(ctx).watch(model=module)
        with ctx.memory.track_activations():
            step()
        peaks[name] = ctx.memory.max_saved_bytes
    grad_diff = max((a.grad - b.grad).abs().max().item()
                    for a, b in zip(ours[0].parameters(), theirs.parameters()))
    # 2) step times, alternating the two so that load on the machine hits both alike
    times = {"labkit": [], "torch": []}
    for i in range(WARMUP + ITERS):
        for name, step in (("labkit", labkit_step), ("torch", torch_step)):
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return dict(rank=rank, peaks=peaks, grad_diff=grad_diff,
                step_s={k: median(v) for k, v in times.items()})


def run_schedule_step(ctx, chunks, ops, micro):
    for q in chunks[0].parameters():
        q.grad = None
    pp.run_schedule(ctx, chunks, ops, micro)


def main():
    rows = []
    print(f"TinyGPT {CFG.model_kwargs}, batch {CFG.global_batch}, {MICRO} micro-batches, "
          f"{WORLD} stages, gloo on CPU (wall clock, measured here; median of {ITERS})")
    for name in ("gpipe", "1f1b"):
        results = labkit.launch(bench_rank, WORLD, CFG, name, timeout_s=600)
        ours = max(r["step_s"]["labkit"] for r in results)
        theirs = max(r["step_s"]["torch"] for r in results)
        peak_ours, peak_theirs = results[0]["peaks"]["labkit"], results[0]["peaks"]["torch"]
        diff = max(r["grad_diff"] for r in results)
        print(f"  {name:>5}: step {ours * 1e3:7.1f} ms vs torch {theirs * 1e3:7.1f} ms "
              f"(ratio {ours / theirs:.2f}); stage-0 peak activations "
              f"{peak_ours / 1e6:.2f} MB vs {peak_theirs / 1e6:.2f} MB "
              f"(ratio {peak_ours / peak_theirs:.2f}); max grad diff {diff:.1e}")
        torch_impl = f"torch.distributed.pipelining.{TORCH_SCHEDULES[name].__name__}"
        common = dict(benchmark="pipeline", labkit_impl=f"labkit.pipeline {name}",
                      torch_impl=torch_impl, world_size=WORLD)
        note = f"TinyGPT 8x128, batch 32, M={MICRO}, gloo CPU, 2 busy cores"
        rows += [dict(common, metric="step_time_s", labkit=f"{ours:.4f}", torch=f"{theirs:.4f}",
                      ratio=f"{ours / theirs:.2f}", notes=note + "; target <= 1.3"),
                 dict(common, metric="stage0_peak_activation_bytes", labkit=peak_ours,
                      torch=peak_theirs, ratio=f"{peak_ours / peak_theirs:.2f}",
                      notes="saved-tensor bytes on rank 0 (labkit tracker for both)"),
                 dict(common, metric="max_grad_diff", labkit=f"{diff:.2e}", torch="",
                      ratio="", notes="after one identical step, every rank's stage")]
    append_rows(rows)


if __name__ == "__main__":
    main()

"""labkit's PipelineStage + ScheduleGPipe / Schedule1F1B against torch.distributed.pipelining's.

The same lines on both sides (`Schedule(PipelineStage(module, rank, P), M, loss_fn)`, then
`.step`), only the import differs. Same TinyGPT, same split (`split_into_stages`: every rank
gets the same modules, deep-copied for torch's side), the same micro-batches and loss, 4 ranks,
gloo on CPU, in one launch. Per schedule: wall step time in interleaved rounds (which side goes
first alternates; the slowest rank's time per round; median and spread over the rounds;
labkit's comm log and clock off), rank 0's peak saved activations (both measured by labkit's
saved-tensor tracker) and the largest gradient difference after one identical step. Rows
replace this bench's earlier rows in data/bench.csv (bench/common.py); ratios are
labkit_over_torch.
"""
import copy
import os
import sys

import torch
import torch.nn.functional as F
import torch.distributed.pipelining as torch_pipelining

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
import labkit.parallel as labkit_pipelining  # noqa: E402
from labkit.parallel.pipeline import split_into_stages  # noqa: E402
from labkit.runs import reference  # noqa: E402
from labkit.runtime.memory import MemoryTracker  # noqa: E402
import common  # noqa: E402

WORLD, MICRO, WARMUP, ROUNDS = 4, 8, 2, 7
CFG = reference.RunConfig(steps=1, global_batch=32, optimizer="sgd",
                          model_kwargs=dict(layers=8, hidden=128, heads=4, seq=64, vocab=256,
                                            ffn=512))
SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def learner_step(api, name, part, rank, p, x, y):
    """The learner's lines as torch's docs write them; `api` is where the names come from."""
    stage = api.PipelineStage(part, rank, p, torch.device("cpu"))
    schedule = getattr(api, name)(stage, MICRO, loss_fn=loss_fn)

    def step():
        part.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
    return step


def bench_rank(ctx, cfg):
    p, rank = ctx.world_size, ctx.rank
    model = reference.build_model(cfg)
    x, y = reference.batch(model, cfg, 0)
    module = split_into_stages(model, p)[rank]
    out = {}
    for name in SCHEDULES:
        ours, theirs = copy.deepcopy(module), copy.deepcopy(module)
        labkit_bare = learner_step(labkit_pipelining, name, ours, rank, p, x, y)
        torch_step = learner_step(torch_pipelining, name, theirs, rank, p, x, y)

        def labkit_step():
            with ctx.off_the_record():
                labkit_bare()

        steps = {"labkit": (labkit_step, ours), "torch": (torch_step, theirs)}
        peaks = {}
        for side, (step, stage) in steps.items():   # one step each, saved tensors tracked
            ctx.memory = MemoryTracker(ctx).watch(model=stage)
            with ctx.memory.track_activations():
                step()
            peaks[side] = ctx.memory.max_saved_bytes
        grad_diff = max((a.grad - b.grad).abs().max().item()
                        for a, b in zip(ours.parameters(), theirs.parameters()))

        times = common.interleaved_rounds(
            {side: common.slowest_rank_timer(step) for side, (step, _) in steps.items()},
            rounds=ROUNDS, warmup=WARMUP)
        out[name] = dict(peaks=peaks, grad_diff=grad_diff, times=times)
    return out


def main():
    model_note = ("TinyGPT 8x128 (seq 64, vocab 256), batch 32, M=8, 4 ranks, gloo CPU; "
                  "labkit's comm log and clock off")
    print(f"{model_note}; wall clock measured here, {ROUNDS} interleaved rounds after "
          f"{WARMUP} warm-up; load average {os.getloadavg()[0]:.1f}")
    results = labkit.launch(bench_rank, WORLD, CFG, timeout_s=900)
    rows = []
    for name in SCHEDULES:
        got = results[0][name]
        # labkit_impl keys the rows in data/bench.csv
        base = dict(benchmark="pipeline",
                    labkit_impl=f"labkit PipelineStage + {name}",
                    torch_impl=f"torch.distributed.pipelining.{name}",
                    world_size=WORLD)
        time_row = common.compared_row(base, "step_time_s", got["times"]["labkit"],
                                       got["times"]["torch"], notes=model_note,
                                       value_format="{:.4f}")
        peak_ours, peak_theirs = got["peaks"]["labkit"], got["peaks"]["torch"]
        diff = max(r[name]["grad_diff"] for r in results)
        print(f"  {name:>12}: step {time_row['labkit']} s vs torch {time_row['torch']} s; "
              f"labkit_over_torch {time_row['labkit_over_torch']} "
              f"({time_row['spread_min']}-{time_row['spread_max']}); stage-0 peak "
              f"activations {peak_ours / 1e6:.2f} MB vs {peak_theirs / 1e6:.2f} MB "
              f"({peak_ours / peak_theirs:.2f}); max grad diff {diff:.1e}")
        rows += [time_row,
                 dict(base, metric="stage0_peak_activation_bytes", labkit=peak_ours,
                      torch=peak_theirs, labkit_over_torch=f"{peak_ours / peak_theirs:.2f}",
                      notes="saved-tensor bytes on rank 0, one step, labkit's tracker for "
                            "both"),
                 dict(base, metric="max_grad_diff", labkit=f"{diff:.2e}",
                      notes="after one identical step, every rank")]
    common.replace_rows(rows)


if __name__ == "__main__":
    main()

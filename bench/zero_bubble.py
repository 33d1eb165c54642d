"""labkit's zero-bubble executor (ZB-H1) against torch.distributed.pipelining's own schedules.

Same TinyGPT, same micro-batches and loss, 4 ranks, gloo on CPU, in one launch:
- labkit: `ScheduleInterleavedZeroBubble` (run as ZB-H1) over `split_into_stages(model, 4)`,
  one stage per rank;
- torch ScheduleZBVZeroBubble: its zero-bubble schedule, which needs two stages per rank in a
  V: the model cut into 8 stages, rank r holding stages r and 7-r;
- torch Schedule1F1B over the same 4 stages as labkit (1F1B, unsplit backward).
Wall step time in interleaved rounds (which side goes first alternates; the slowest rank's
time per round; median and spread over the rounds; labkit's comm log and clock off), and the
largest gradient difference from one device after one identical step. Rows replace this
bench's earlier rows in data/bench.csv (bench/common.py); ratios are labkit_over_torch.
"""
import copy
import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import Schedule1F1B, ScheduleZBVZeroBubble

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from labkit.parallel.pipeline import PipelineStage, split_into_stages  # noqa: E402
from labkit.parallel.zero_bubble import ScheduleInterleavedZeroBubble  # noqa: E402
from labkit.runs import reference  # noqa: E402
import common  # noqa: E402

WORLD, MICRO, WARMUP, ROUNDS = 4, 8, 2, 11
CFG = reference.RunConfig(steps=1, global_batch=32, optimizer="sgd",
                          model_kwargs=dict(layers=8, hidden=128, heads=4, seq=64, vocab=256,
                                            ffn=512))
TORCH_SIDES = ("ScheduleZBVZeroBubble", "Schedule1F1B")


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def bench_rank(ctx, cfg):
    p, rank = ctx.world_size, ctx.rank
    cpu = torch.device("cpu")
    model = reference.build_model(cfg)
    x, y = reference.batch(model, cfg, 0)
    reference_model = copy.deepcopy(model)
    loss_fn(reference_model(x), y).backward()
    expected = [q.grad for q in reference_model.parameters()]
    index = {id(q): i for i, q in enumerate(model.parameters())}

    four, eight = split_into_stages(model, p), split_into_stages(model, 2 * p, "layers")
    v_index = (rank, 2 * p - 1 - rank)
    originals = {"labkit": [four[rank]], "ScheduleZBVZeroBubble": [eight[s] for s in v_index],
                 "Schedule1F1B": [four[rank]]}
    copies = {name: [copy.deepcopy(m) for m in mods] for name, mods in originals.items()}
    ours, v_stages, (plain,) = copies["labkit"][0], copies["ScheduleZBVZeroBubble"], \
        copies["Schedule1F1B"]
    shape = (cfg.global_batch // MICRO, cfg.model_kwargs["seq"], cfg.model_kwargs["hidden"])
    stage = PipelineStage(ours, rank, p, input_shape=None if rank == 0 else shape)
    pipe = ScheduleInterleavedZeroBubble(stage, MICRO, loss_fn)
    zbv = ScheduleZBVZeroBubble([TorchStage(m, s, 2 * p, cpu) for m, s in zip(v_stages, v_index)],
                                MICRO, loss_fn=loss_fn)
    one_f_one_b = Schedule1F1B(TorchStage(plain, rank, p, cpu), MICRO, loss_fn=loss_fn)

    def labkit_step():
        ours.zero_grad(set_to_none=True)
        with ctx.off_the_record():
            pipe.step(x if rank == 0 else None, target=y if rank == p - 1 else None)

    def torch_step(schedule, modules, first, last):
        def step():
            for m in modules:
                m.zero_grad(set_to_none=True)
            kwargs = dict(target=y, losses=[]) if last else {}
            schedule.step(*([x] if first else []), **kwargs)
        return step

    # ZBV: rank 0 holds the first stage and the last (the V comes back to it)
    sides = {"labkit": labkit_step,
             "ScheduleZBVZeroBubble": torch_step(zbv, v_stages, rank == 0, rank == 0),
             "Schedule1F1B": torch_step(one_f_one_b, [plain], rank == 0, rank == p - 1)}
    grad_diff = {}
    for name, step in sides.items():                 # one step each, against one device
        step()
        grad_diff[name] = max([0.0] + [
            (q.grad - expected[index[id(o)]]).abs().max().item()
            for mine, orig in zip(copies[name], originals[name])
            for q, o in zip(mine.parameters(), orig.parameters()) if q.grad is not None])

    times = common.interleaved_rounds({name: common.slowest_rank_timer(step) for name, step in sides.items()},
                                      rounds=ROUNDS, warmup=WARMUP)
    return dict(times=times, grad_diff=grad_diff)


def main():
    note = ("TinyGPT 8x128 (seq 64, vocab 256), batch 32, M=8, 4 ranks, gloo CPU; labkit's "
            "comm log and clock off; ZBV on 8 half stages (2 per rank, V)")
    print(f"{note}; wall clock measured here, {ROUNDS} interleaved rounds after {WARMUP} "
          f"warm-up; load average {os.getloadavg()[0]:.1f}")
    results = labkit.launch(bench_rank, WORLD, CFG, timeout_s=900)
    times = results[0]["times"]
    rows = []
    for name in TORCH_SIDES:
        # labkit_impl keys the rows in data/bench.csv: kept from the executor's earlier name
        base = dict(benchmark="zero_bubble", labkit_impl="labkit.ZeroBubbleSchedule zb-h1",
                    torch_impl=f"torch.distributed.pipelining.{name}", world_size=WORLD)
        row = common.compared_row(base, "step_time_s", times["labkit"], times[name],
                                  notes=note, value_format="{:.4f}")
        ours = max(r["grad_diff"]["labkit"] for r in results)
        theirs = max(r["grad_diff"][name] for r in results)
        print(f"  vs {name}: step {row['labkit']} s vs {row['torch']} s; labkit_over_torch "
              f"{row['labkit_over_torch']} ({row['spread_min']}-{row['spread_max']}); max grad "
              f"diff from one device {ours:.1e} (labkit) vs {theirs:.1e} (torch)")
        rows += [row, dict(base, metric="max_grad_diff_vs_one_device", labkit=f"{ours:.2e}",
                           torch=f"{theirs:.2e}", notes="after one step, every rank")]
    common.replace_rows(rows)


if __name__ == "__main__":
    main()

"""labkit's DistributedDataParallel against torch.nn.parallel.DistributedDataParallel, in one run.

Same model (a TinyGPT, hidden 128, 4 layers, 0.83M parameters), same data shards, same Adam,
same 1 MiB buckets, gloo on CPU. One launch per world size; inside it every rank runs the sides
in interleaved rounds (the order alternates between rounds, so neither side always runs on the
warmer machine). Sides:
  labkit view   DistributedDataParallel(gradient_as_bucket_view=True): .grad is a view of its bucket
  labkit copy   DistributedDataParallel() (the default): gradients copied into buckets and back
  torch         DDP(gradient_as_bucket_view=True, bucket_cap_mb=1): the anchor
Per side and world size:
  step_time_s   the slowest rank's wall time per step (warm-up steps excluded); the median per
                round, then the median over rounds and their spread (min-max); instrumentation
                off (`ctx.off_the_record()`: no comm log, no virtual clock) on both sides;
  peak_bytes    rank 0's peak during one extra step, measured on both sides by labkit's memory
                tracker (params, .grad, Adam state, saved activations, registered buffers: with
                bucket views the buckets are the .grads; in copy mode they are buffers);
  max_param_diff  labkit vs torch after the same steps (Adam eps 1e-6, see runs/reference.py).
labkit_over_torch = labkit / torch (below 1: labkit is faster or smaller).
Run: python bench/data_parallel.py [world sizes...]   (rows are appended to data/bench.csv)
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import replace_rows, side_steps  # noqa: E402
from labkit import data  # noqa: E402
from labkit.parallel.data_parallel import DistributedDataParallel  # noqa: E402
from labkit.runs import reference  # noqa: E402
from labkit.runtime.memory import MemoryTracker  # noqa: E402

MODEL = dict(hidden=128, layers=4, ffn=512)
BUCKET_MIB = 1   # DDP's bucket_cap_mb is in MiB, labkit's bucket_mb in MB (1e6 bytes)
WARMUP, TIMED, ROUNDS = 2, 6, 5
SIDES = ("labkit view", "labkit copy", "torch")


def wrap(side, model):
    if side == "torch":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, bucket_cap_mb=BUCKET_MIB, gradient_as_bucket_view=True)
    return DistributedDataParallel(model, bucket_cap_mb=BUCKET_MIB * 1.048576, overlap=True,
                                   gradient_as_bucket_view=side == "labkit view")


def one_side(ctx, cfg, side):
    """Build, train WARMUP + TIMED steps (timed, bare), then one step under the tracker."""
    ctx.memory = MemoryTracker(ctx)   # a fresh tracker: labkit's copy buckets register here
    model = reference.build_model(cfg)
    wrapped = wrap(side, model)
    optimizer = reference.build_optimizer(wrapped.parameters(), cfg)
    ctx.memory.watch(model=model, optimizer=optimizer)

    def step(i):
        x, y = reference.batch(model, cfg, i)
        x, y = data.shard(x, ctx.rank, ctx.world_size), data.shard(y, ctx.rank, ctx.world_size)
        optimizer.zero_grad(set_to_none=True)
        wrapped(x, y).backward()     # both sides: gradients averaged by the end of backward
        optimizer.step()

    times = []
    for i in range(WARMUP + TIMED):
        started = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - started)
    ctx.memory.reset_peak()
    with ctx.memory.track_activations():
        step(WARMUP + TIMED)
    ctx.memory.sample("after the measured step")
    return dict(step_wall_s=times[WARMUP:], peak=ctx.memory.peak,
                params={k: p.detach().clone() for k, p in model.named_parameters()})


def rounds(ctx, cfg):
    out = {side: [] for side in SIDES}
    with ctx.off_the_record():
        for r in range(ROUNDS):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for side in order:
                out[side].append(one_side(ctx, cfg, side))
    return out


def summarise(results):
    """Per side: the median over rounds of the per-round median step (slowest rank each step)."""
    out = side_steps(results, SIDES, ROUNDS)
    torch_rounds = out["torch"]["rounds"]
    for side in SIDES[:2]:
        ratios = [a / b for a, b in zip(out[side]["rounds"], torch_rounds)]
        out[side]["ratio_spread"] = (min(ratios), max(ratios))
        mine, theirs = results[0][side][-1]["params"], results[0]["torch"][-1]["params"]
        out[side]["diff"] = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    return out


def main(world_sizes=(2, 4)):
    cfg = reference.RunConfig(steps=WARMUP + TIMED + 1, global_batch=16, model_kwargs=MODEL)
    model = reference.build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    setting = (f"TinyGPT h128 L4 {params / 1e6:.2f}M params; batch 16 x {model.cfg.seq} tokens; "
               f"Adam; {BUCKET_MIB} MiB buckets; gloo CPU, {os.cpu_count()} cores; "
               f"{ROUNDS} interleaved rounds x {TIMED} timed steps")
    print(setting)
    rows = []
    for n in world_sizes:
        t0 = time.time()
        s = summarise(labkit.launch(rounds, n, cfg, timeout_s=1800))
        print(f"\nworld size {n} ({time.time() - t0:.0f} s)")
        print(f"  {'':12}{'step ms':>9}{'spread (min-max of rounds)':>30}{'peak MB':>9}"
              f"{'labkit_over_torch: time':>25}{' (spread)':>14}{'  memory':>8}{'  max diff':>11}")
        t = s["torch"]
        for side in SIDES:
            x = s[side]
            lo, hi = min(x["rounds"]) * 1e3, max(x["rounds"]) * 1e3
            line = (f"  {side:12}{x['step'] * 1e3:9.1f}{f'{lo:.1f} - {hi:.1f}':>30}"
                    f"{x['peak'] / 1e6:9.2f}")
            if side != "torch":
                ratio, peak_ratio = x["step"] / t["step"], x["peak"] / t["peak"]
                a, b = x["ratio_spread"]
                line += (f"{ratio:25.2f}{f' ({a:.2f}-{b:.2f})':>14}{peak_ratio:8.2f}"
                         f"{x['diff']:11.1e}")
                note = (f"{setting}; per-round ratio {a:.2f}-{b:.2f}; instrumentation off; "
                        "shared, loaded machine")
                base = dict(benchmark="data_parallel",
                            labkit_impl=f"DistributedDataParallel ({side[7:]})",
                            torch_impl="DDP gradient_as_bucket_view=True", world_size=n)
                rows += [
                    dict(base, metric="step_time_s_median", labkit=f"{x['step']:.4e}",
                         torch=f"{t['step']:.4e}", labkit_over_torch=f"{ratio:.2f}",
                         spread_min=f"{a:.2f}", spread_max=f"{b:.2f}", rounds=ROUNDS,
                         notes=note),
                    dict(base, metric="peak_bytes_rank0", labkit=x["peak"], torch=t["peak"],
                         labkit_over_torch=f"{peak_ratio:.2f}",
                         notes="labkit memory tracker on both"),
                    dict(base, metric="max_param_diff", labkit=f"{x['diff']:.1e}",
                         notes=f"after {cfg.steps} Adam steps (eps 1e-6)")]
            print(line)
    replace_rows(rows)
    print(f"\n{len(rows)} rows written to data/bench.csv (a rerun replaces its configurations' "
          "rows; column labkit_over_torch)")


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (2, 4))

"""labkit's bucketed data parallelism against torch.nn.parallel.DistributedDataParallel.

Same model (a TinyGPT, hidden 128, 4 layers), same data shards, same optimizer, gloo on CPU, one
launch per world size in which every rank runs both, alternating (labkit, torch, labkit, torch)
so neither profits from a warmer machine. Reported, per world size:
  step_time_s   median over the timed steps (warm-up excluded) of the slowest rank's wall time,
                labkit with its virtual clock off (`ctx.clock.enabled = False`) and, as a second
                row, with it on;
  peak_bytes    the labkit memory tracker's peak on rank 0 for both sides (params, grads,
                optimizer state, saved activations, and the gradient buckets: labkit's own
                buffers, DDP's from its logging data `bucket_sizes`);
  max_param_diff  between the two after the same steps (Adam; the attention key bias, whose
                true gradient is 0, is left out: see tests/test_data_parallel.py).
Both sides run inside the memory tracker's saved-tensor hooks, so that cost is on both.
Run: python bench/data_parallel.py   (rows are appended to data/bench.csv)
"""
import csv
import datetime
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import labkit  # noqa: E402
from labkit import data, data_parallel as dp  # noqa: E402
from labkit.runs import reference  # noqa: E402
from labkit.runtime.memory import MemoryTracker  # noqa: E402

MODEL = dict(hidden=128, layers=4, ffn=512)
BUCKET_MIB = 1  # DDP's bucket_cap_mb is in MiB; labkit's bucket_mb in MB (1e6): 1 MiB both
WARMUP, TIMED, ROUNDS = 2, 6, 2


def torch_ddp(ctx, cfg):
    """PyTorch's own DDP on the default process group (called directly: this is the anchor)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = reference.build_model(cfg)
    ddp = DDP(model, bucket_cap_mb=BUCKET_MIB)
    optimizer = reference.build_optimizer(ddp.parameters(), cfg)
    memory = MemoryTracker(ctx).watch(model=model, optimizer=optimizer)
    times = []
    for step in range(cfg.steps):
        started = time.perf_counter()
        x, y = reference.batch(model, cfg, step)
        x, y = data.shard(x, ctx.rank, ctx.world_size), data.shard(y, ctx.rank, ctx.world_size)
        optimizer.zero_grad(set_to_none=True)
        with memory.track_activations():
            loss = ddp(x, y)
            loss.backward()
        optimizer.step()
        memory.sample(f"after step {step}")
        times.append(time.perf_counter() - started)
    sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
    bucket_bytes = sum(int(s) for s in str(sizes).split(",") if s.strip())
    report = memory.report()
    return dict(step_wall_s=times, peak=report["peak"] + bucket_bytes, bucket_bytes=bucket_bytes,
                params={k: p.detach().clone() for k, p in model.named_parameters()})


def labkit_dp(ctx, cfg, clock):
    ctx.memory = MemoryTracker(ctx)  # a fresh tracker and log per round
    ctx.comm.reset()
    ctx.clock.enabled = clock
    out = dp.train(ctx, cfg, mode="bucketed", bucket_mb=BUCKET_MIB * 1.048576, overlap=True)
    return dict(step_wall_s=out["step_wall_s"], peak=out["memory"]["peak"],
                bucket_bytes=out["memory"]["buffers"], params=out.get("params"))


def both(ctx, cfg):
    runs = {"labkit": [], "labkit+clock": [], "torch": []}
    for _ in range(ROUNDS):
        runs["labkit"].append(labkit_dp(ctx, cfg, clock=False))
        runs["torch"].append(torch_ddp(ctx, cfg))
        runs["labkit+clock"].append(labkit_dp(ctx, cfg, clock=True))
    return runs


def summarise(results, cfg):
    out = {}
    for side in ("labkit", "labkit+clock", "torch"):
        steps = []
        for rnd in range(ROUNDS):
            per_rank = [r[side][rnd]["step_wall_s"][WARMUP:] for r in results]
            steps += [max(ts) for ts in zip(*per_rank)]   # the slowest rank sets the step
        out[side] = dict(step=statistics.median(steps), peak=results[0][side][0]["peak"],
                         buckets=results[0][side][0]["bucket_bytes"])
    mine, theirs = results[0]["labkit"][0]["params"], results[0]["torch"][0]["params"]
    h = MODEL["hidden"]
    keep = lambda k, t: torch.cat([t[:h], t[2 * h:]]) if k.endswith("qkv.bias") else t  # noqa
    out["diff_all"] = reference.max_param_diff(mine, theirs)
    out["diff"] = max((keep(k, mine[k]) - keep(k, theirs[k])).abs().max().item() for k in mine)
    return out


def main(world_sizes=(2, 4)):
    cfg = reference.RunConfig(steps=WARMUP + TIMED, global_batch=16, model_kwargs=MODEL)
    params = sum(p.numel() for p in reference.build_model(cfg).parameters())
    print(f"TinyGPT {MODEL}: {params / 1e6:.2f}M parameters, global batch {cfg.global_batch} x "
          f"{reference.build_model(cfg).cfg.seq} tokens, Adam, buckets {BUCKET_MIB} MiB, gloo CPU, "
          f"{os.cpu_count()} cores; {TIMED} timed steps x {ROUNDS} rounds after {WARMUP} warm-up")
    rows, today = [], datetime.date.today().isoformat()
    for n in world_sizes:
        t0 = time.time()
        s = summarise(labkit.launch(both, n, cfg, timeout_s=900), cfg)
        print(f"\nworld size {n} ({time.time() - t0:.0f} s)")
        print(f"  {'':22}{'labkit':>12}{'torch DDP':>12}{'ratio':>8}")
        for label, side in (("step time, clock off", "labkit"),
                            ("step time, clock on", "labkit+clock")):
            r = s[side]["step"] / s["torch"]["step"]
            ms, torch_ms = s[side]["step"] * 1e3, s["torch"]["step"] * 1e3
            print(f"  {label:22}{ms:10.1f}ms{torch_ms:10.1f}ms{r:8.2f}")
            clock = "clock on" if "clock" in side else "clock off"
            rows.append(["data_parallel", f"dp.train bucketed ({clock})",
                         "DistributedDataParallel", n, "step_time_s_median",
                         f"{s[side]['step']:.4e}", f"{s['torch']['step']:.4e}", f"{r:.2f}",
                         f"wall clock; TinyGPT h128 L4 {params / 1e6:.2f}M params; batch 16; "
                         f"1 MiB buckets; Adam; gloo CPU {os.cpu_count()} cores; shared machine",
                         today])
        r = s["labkit"]["peak"] / s["torch"]["peak"]
        mb, torch_mb = s["labkit"]["peak"] / 1e6, s["torch"]["peak"] / 1e6
        print(f"  {'peak memory':22}{mb:10.2f}MB{torch_mb:10.2f}MB{r:8.2f}")
        print(f"  {'  of it grad buckets':22}{s['labkit']['buckets'] / 1e6:10.2f}MB"
              f"{s['torch']['buckets'] / 1e6:10.2f}MB")
        print(f"  max |param diff| labkit vs DDP: {s['diff']:.2e} "
              f"({s['diff_all']:.2e} with the attention key bias, whose true gradient is 0)")
        rows.append(["data_parallel", "dp.train bucketed", "DistributedDataParallel", n,
                     "peak_bytes_rank0", s["labkit"]["peak"], s["torch"]["peak"], f"{r:.2f}",
                     "labkit memory tracker on both (params+grads+Adam+saved activations) + "
                     "grad buckets (labkit buffers; DDP logging-data bucket_sizes)", today])
        rows.append(["data_parallel", "dp.train bucketed", "DistributedDataParallel", n,
                     "max_param_diff", f"{s['diff']:.2e}", "", "",
                     f"after {cfg.steps} Adam steps, key bias excluded; "
                     f"with it {s['diff_all']:.2e}",
                     today])
    with open(os.path.join(ROOT, "data", "bench.csv"), "a", newline="") as f:
        csv.writer(f).writerows(rows)
    print(f"\n{len(rows)} rows appended to data/bench.csv")


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (2, 4))

"""labkit's ZeRO blocks against PyTorch's own, in one launch, on the same ranks, model and data.

  stage 1: labkit DistributedDataParallel + ShardedOptimizer(stage=1)
                                                        vs  DDP + ZeroRedundancyOptimizer
  stage 3: labkit fully_shard (FSDP2, per-parameter)    vs  torch.distributed.fsdp.fully_shard
  stage 3: labkit FullyShard (the FSDP1 variant, flat)  vs  torch.distributed.fsdp.fully_shard
  stage 3, explicit prefetch: both fully_shards with torchtitan's prefetch lines (each block
           prefetches the next in forward and the previous in backward, the root the first
           block in forward and the last in backward)
Both sides: the same tiny GPT from the same seed, Adam (eps 1e-6, foreach=False), gradients as
bucket views (labkit's and torch's DDP); stage 3 applied bottom-up on both sides with the same
lines (fully_shard on each block, then on the model, over init_device_mesh("cpu", (N,))), only
the import differs; FullyShard's units are the same modules. Every rank runs the two sides of a
pair in interleaved rounds
(the order alternates, so neither side always runs second on a warmer machine):
  step_time_s  the slowest rank's median wall time per step in each round (warm-up excluded);
               the median over rounds, the spread (min-max over rounds), and labkit_over_torch
               = the median of the per-round ratios. labkit's instrumentation is off (no comm
               log, no virtual clock: ctx.off_the_record(); a memory tracker that does nothing);
               torch has none.
  peak_heap_bytes_per_rank  measured the same way for both: glibc's bytes in use (mallinfo2:
               arena chunks + mmapped blocks), polled by a thread while the side is built and
               takes two steps, minus the bytes in use before; it sees everything either side
               allocates (weights, grads, optimizer state, activations, comm buffers).
  max_param_diff  labkit vs torch after the same steps from the same weights.
Rows replace their configurations' rows in data/bench.csv (column `labkit_over_torch`).
Run: python bench/zero.py [--dry-run] [--only "stage 3|stage 3, explicit prefetch"]
(--only: the pairs named, '|' between names; the other rows stay as they are)
"""
import ctypes
import gc
import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
import common  # noqa: E402
from labkit import data, models  # noqa: E402
from labkit.parallel.data_parallel import DistributedDataParallel  # noqa: E402
from labkit.parallel import fsdp2  # noqa: E402
from labkit.parallel.fully_shard import FullyShard  # noqa: E402
from labkit.parallel.zero import ShardedOptimizer  # noqa: E402
from labkit.runs import reference  # noqa: E402

WORLD_SIZE = 2
WARMUP, TIMED, ROUNDS = 2, 5, 6
CFG = reference.RunConfig(global_batch=8, model_kwargs=dict(
    vocab=256, seq=64, hidden=128, heads=4, layers=4, ffn=512))
ADAM = dict(lr=CFG.lr, eps=1e-6, foreach=False)   # what reference.build_optimizer uses


# ---------------------------------------------------------------------------- the four sides

class Quiet:
    """A memory tracker that records nothing (labkit's instrumentation off while timing)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def labkit_stage1(ctx):
    model = reference.build_model(CFG)
    module = DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.Adam, stage=1, **ADAM)
    return module, optimizer, lambda: {k: p.detach().clone() for k, p in model.named_parameters()}


def torch_zero1(ctx):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = reference.build_model(CFG)
    module = DDP(model, gradient_as_bucket_view=True)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, **ADAM)
    return module, optimizer, lambda: {k: p.detach().clone() for k, p in model.named_parameters()}


def labkit_fsdp1(ctx):
    model = reference.build_model(CFG)
    module = FullyShard(model, units=lambda m: m is model or isinstance(m, models.Block))
    optimizer = torch.optim.Adam(module.parameters(), **ADAM)
    return module, optimizer, module.full_state_dict


def fsdp2_side(fully_shard, full_tensor, prefetch=False):
    """The learner's FSDP2 lines, the same for both sides: only `fully_shard` differs."""
    def build(ctx):
        from torch.distributed.device_mesh import init_device_mesh
        model = reference.build_model(CFG)
        mesh = init_device_mesh("cpu", (ctx.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if prefetch:   # torchtitan's explicit prefetch
            blocks = list(model.blocks)
            model.set_modules_to_forward_prefetch([blocks[0]])
            model.set_modules_to_backward_prefetch([blocks[-1]])
            for i, block in enumerate(blocks):
                if i + 1 < len(blocks):
                    block.set_modules_to_forward_prefetch([blocks[i + 1]])
                if i > 0:
                    block.set_modules_to_backward_prefetch([blocks[i - 1]])
        optimizer = torch.optim.Adam(model.parameters(), **ADAM)
        return model, optimizer, lambda: {k: full_tensor(p).detach().clone()
                                          for k, p in model.named_parameters()}
    return build


def torch_fsdp2(ctx, prefetch=False):
    from torch.distributed.fsdp import fully_shard
    return fsdp2_side(fully_shard, lambda p: p.full_tensor(), prefetch)(ctx)


def torch_fsdp2_prefetch(ctx):
    return torch_fsdp2(ctx, prefetch=True)


labkit_fsdp2 = fsdp2_side(fsdp2.fully_shard, fsdp2.full_tensor)
labkit_fsdp2_prefetch = fsdp2_side(fsdp2.fully_shard, fsdp2.full_tensor, prefetch=True)

# the labels key this bench's rows in data/bench.csv
TORCH_FSDP2 = "torch.distributed.fsdp.fully_shard (FSDP2; blocks + root)"
PAIRS = (("stage 1", labkit_stage1, torch_zero1,
          "labkit DistributedDataParallel + ShardedOptimizer(stage=1)",
          "DDP(gradient_as_bucket_view) + torch.distributed.optim.ZeroRedundancyOptimizer"),
         ("stage 3", labkit_fsdp2, torch_fsdp2,
          "labkit fully_shard (FSDP2; blocks + root)", TORCH_FSDP2),
         ("stage 3, FSDP1 variant", labkit_fsdp1, torch_fsdp2,
          "labkit FullyShard (FSDP1 variant, flat; blocks + root)", TORCH_FSDP2),
         ("stage 3, explicit prefetch", labkit_fsdp2_prefetch, torch_fsdp2_prefetch,
          "labkit fully_shard (FSDP2; blocks + root; torchtitan's explicit prefetch)",
          "torch.distributed.fsdp.fully_shard (FSDP2; blocks + root; torchtitan's explicit "
          "prefetch)"))


def chosen_pairs(argv):
    """The pairs `--only "name|name"` names (all without it)."""
    if "--only" not in argv:
        return PAIRS
    names = argv[argv.index("--only") + 1].split("|")
    unknown = set(names) - {p[0] for p in PAIRS}
    if unknown:
        raise SystemExit(f"--only: no pair named {sorted(unknown)}")
    return tuple(p for p in PAIRS if p[0] in names)


def step(ctx, side, index):
    module, optimizer, _ = side
    model = getattr(module, "module", module)
    x, y = (data.shard(t, ctx.rank, ctx.world_size)
            for t in reference.batch(model, CFG, index))
    # zero every .grad (ZeroRedundancyOptimizer.zero_grad clears only the owned ones)
    model.zero_grad(set_to_none=True)
    optimizer.zero_grad(set_to_none=True)
    module(x, y).backward()
    optimizer.step()


def timed_steps(ctx, side, first):
    dist.barrier()
    times = []
    for i in range(first, first + TIMED):
        start = time.perf_counter()
        step(ctx, side, i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------ heap peak

_LIBC = {}


def heap_in_use():
    """glibc's bytes in use: chunks handed out from the arenas plus mmapped blocks."""
    if not _LIBC:
        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        _LIBC["libc"] = libc
    info = _LIBC["libc"].mallinfo2()
    return info.uordblks + info.hblkhd


def heap_peak(ctx, build):
    """Most heap bytes in use above the start while `build` makes a side and it takes 2 steps."""
    gc.collect()
    dist.barrier()
    base = peak = heap_in_use()
    running = [True]

    def poll():
        nonlocal peak
        while running[0]:
            peak = max(peak, heap_in_use())
            time.sleep(2e-4)
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    side = build(ctx)
    for i in range(2):
        step(ctx, side, i)
        peak = max(peak, heap_in_use())
    running[0] = False
    thread.join()
    del side
    gc.collect()
    return peak - base


# ------------------------------------------------------------------------------ one launch

def compare(ctx, names=None):
    ctx.memory = Quiet()
    out = {}
    with ctx.off_the_record():
        for name, ours, theirs, _, _ in PAIRS:
            if names is not None and name not in names:
                continue
            sides = {"labkit": ours(ctx), "torch": theirs(ctx)}
            for side in sides.values():   # warm-up, also imports and one-off set-up
                for i in range(WARMUP):
                    step(ctx, side, i)
            rounds = {"labkit": [], "torch": []}
            for r in range(ROUNDS):
                order = ("labkit", "torch") if r % 2 == 0 else ("torch", "labkit")
                for who in order:
                    rounds[who].append(timed_steps(ctx, sides[who], WARMUP + r * TIMED))
            params = {who: side[2]() for who, side in sides.items()}
            del sides
            peaks = {"labkit": heap_peak(ctx, ours), "torch": heap_peak(ctx, theirs)}
            out[name] = dict(rounds=rounds, peaks=peaks,
                             params=params if ctx.rank == 0 else None)
    return out


def replace_rows(benchmark, rows):
    """Rows into data/bench.csv (bench/common.py): each replaces its configuration's row."""
    assert all(r["benchmark"] == benchmark for r in rows)
    common.replace_rows(rows)


def main():
    pairs = chosen_pairs(sys.argv)
    ranks = labkit.launch(compare, WORLD_SIZE, [p[0] for p in pairs], timeout_s=900)
    psi = sum(p.numel() for p in reference.build_model(CFG).parameters())
    where = (f"tiny GPT {psi} params (h128 L4 seq64 vocab256), batch {CFG.global_batch}, "
             f"Adam fp32, {WORLD_SIZE} ranks gloo CPU (2 shared, busy cores); {ROUNDS} "
             f"interleaved rounds of {TIMED} steps after {WARMUP} warm-up")
    print(where)
    rows = []
    for name, _, _, ours, theirs in pairs:
        # per round: the slowest rank's median step, for each side
        per_round = {who: [max(r[name]["rounds"][who][k] for r in ranks) for k in range(ROUNDS)]
                     for who in ("labkit", "torch")}
        med = {who: statistics.median(v) for who, v in per_round.items()}
        ratios = [a / b for a, b in zip(per_round["labkit"], per_round["torch"])]
        ratio = statistics.median(ratios)
        peak = {who: max(r[name]["peaks"][who] for r in ranks) for who in ("labkit", "torch")}
        a, b = ranks[0][name]["params"]["labkit"], ranks[0][name]["params"]["torch"]
        diff = reference.max_param_diff(a, b)
        close = sum(int(((a[k] - b[k]).abs() <= 1e-5).sum()) for k in a) / psi
        steps = WARMUP + ROUNDS * TIMED
        print(f"\n{name}: {ours}\n   vs {theirs}")
        print(f"  step time (median of per-round medians): labkit {med['labkit'] * 1e3:.1f} ms "
              f"(range {min(per_round['labkit']) * 1e3:.1f}-{max(per_round['labkit']) * 1e3:.1f})"
              f", torch {med['torch'] * 1e3:.1f} ms (range {min(per_round['torch']) * 1e3:.1f}-"
              f"{max(per_round['torch']) * 1e3:.1f})")
        print(f"  labkit_over_torch time {ratio:.2f} (per-round {min(ratios):.2f}-"
              f"{max(ratios):.2f}); peak heap per rank {peak['labkit'] / 1e6:.2f} MB vs "
              f"{peak['torch'] / 1e6:.2f} MB, ratio {peak['labkit'] / peak['torch']:.2f}")
        print(f"  max |param difference| after {steps} steps: {diff:.2e} "
              f"({close:.4%} of elements within 1e-5)")
        common = dict(benchmark="zero", labkit_impl=ours, torch_impl=theirs,
                      world_size=WORLD_SIZE)
        rows += [
            dict(common, metric="step_time_s", labkit=f"{med['labkit']:.4f}",
                 torch=f"{med['torch']:.4f}", labkit_over_torch=f"{ratio:.2f}",
                 spread_min=f"{min(ratios):.2f}", spread_max=f"{max(ratios):.2f}",
                 rounds=len(ratios),
                 notes=f"{where}; per-round ratio range {min(ratios):.2f}-{max(ratios):.2f}; "
                       f"labkit {min(per_round['labkit']):.4f}-{max(per_round['labkit']):.4f} s,"
                       f" torch {min(per_round['torch']):.4f}-{max(per_round['torch']):.4f} s; "
                       "labkit instrumentation off"),
            dict(common, metric="peak_heap_bytes_per_rank", labkit=f"{peak['labkit']:.0f}",
                 torch=f"{peak['torch']:.0f}",
                 labkit_over_torch=f"{peak['labkit'] / peak['torch']:.2f}",
                 notes="glibc mallinfo2 in-use bytes above the start, while building the side "
                       "and 2 steps; the same measure for both"),
            dict(common, metric="max_param_diff", labkit=f"{diff:.2e}", torch="",
                 notes=f"labkit vs torch after {steps} Adam steps from the same "
                                 f"weights; {close:.4%} of elements within 1e-5"),
        ]
    if "--dry-run" not in sys.argv:
        replace_rows("zero", rows)
        print(f"\n{len(rows)} rows written to data/bench.csv (replacing their configurations' "
              "rows; column labkit_over_torch)")


if __name__ == "__main__":
    main()

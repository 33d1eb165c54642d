"""labkit's `parallelize_module` against PyTorch's (DTensor tensor parallelism).

Same weights (one seeded reference module, copied), same input, same world size, one launch,
the same call on both sides with only the import differing:
parallelize_module(module, init_device_mesh("cpu", (N,)), {"fc1": ColwiseParallel(),
"fc2": RowwiseParallel(), ...}) from labkit.parallel and from torch.distributed.tensor.parallel,
over gloo, on labkit's MLP block
(h -> ffn -> h) and on a whole transformer block (attention split by heads: labkit splits the
fused qkv part by part; torch gets q, k and v as three Linears, since its ColwiseParallel would
cut a fused weight in contiguous thirds). Per side:
  step_s      the slowest rank's wall time of one forward + backward (warm-up excluded): the
              median per round, then the median over interleaved rounds (the order alternates)
              and the spread (min-max) of the per-round ratio; instrumentation off on both
              sides (labkit: `ctx.off_the_record()`, no comm log, no virtual clock);
  peak_bytes  parameters + gradients + the most saved for backward at once, counted the same
              way on both sides (unique storages, DTensors unwrapped to their local shards);
  equal       outputs and gradient shards equal the single-device module's (atol 1e-5).
labkit_over_torch = labkit / torch (below 1: labkit is faster or smaller).
Run: python bench/tensor_parallel.py   (rows replace their configurations' in data/bench.csv)
"""
import copy
import os
import statistics
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import replace_rows  # noqa: E402
from labkit import models  # noqa: E402
from labkit.parallel import tensor_parallel as tp  # noqa: E402

WORLD, BATCH, SEQ, HIDDEN, HEADS, FFN = 2, 4, 128, 256, 8, 1024
WARMUP, TIMED, ROUNDS = 2, 5, 7
SIDES = ("labkit", "torch")
PLANS = {"mlp": {"fc1": "colwise", "fc2": "rowwise"},   # the style of each module, by name
         "block": {"attn.qkv": "colwise", "attn.proj": "rowwise",
                   "mlp.fc1": "colwise", "mlp.fc2": "rowwise"}}


class SplitQKVAttention(nn.Module):
    """labkit's attention with q, k, v as three Linears (the same weights); heads per rank
    from the local width, as labkit's Attention reads them."""

    def __init__(self, attn):
        super().__init__()
        h = attn.proj.in_features
        self.head_dim = attn.head_dim
        self.q, self.k, self.v = (nn.Linear(h, h) for _ in range(3))
        for i, lin in enumerate((self.q, self.k, self.v)):
            lin.weight.data.copy_(attn.qkv.weight.data[i * h:(i + 1) * h])
            lin.bias.data.copy_(attn.qkv.bias.data[i * h:(i + 1) * h])
        self.proj = copy.deepcopy(attn.proj)

    def forward(self, x):
        q, k, v = (_local(t) for t in (self.q(x), self.k(x), self.v(x)))
        return self.proj(models.causal_attention(q, k, v, q.shape[-1] // self.head_dim))


class TorchBlock(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = SplitQKVAttention(block.attn)
        self.mlp = copy.deepcopy(block.mlp)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _local(t):
    """A DTensor's local tensor (an AsyncCollectiveTensor waits on first use, in the graph)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _plain(t):
    """The storage-owning tensor behind a DTensor or an AsyncCollectiveTensor."""
    t = _local(t)
    return t.elem if type(t).__name__ == "AsyncCollectiveTensor" else t


class _Box:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedBytes:
    """The most bytes saved for backward at once (unique storages, DTensors unwrapped): the
    same count for both sides (labkit's MemoryTracker cannot look inside a DTensor)."""

    def __init__(self, exclude):
        self.exclude, self.live, self.most = set(exclude), {}, 0

    def _pack(self, t):
        storage = _plain(t).untyped_storage()
        key = storage.data_ptr()
        if not key or key in self.exclude:
            return t
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        entry[1] += 1
        self.most = max(self.most, sum(size for size, _ in self.live.values()))
        box = _Box(t)
        weakref.finalize(box, self._release, key)
        return box

    def _release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if not entry[1]:
            del self.live[key]

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(
            self._pack, lambda b: b.tensor if isinstance(b, _Box) else b)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def _step(module, x):
    for p in module.parameters():
        p.grad = None
    out = _local(module(x))
    out.pow(2).mean().backward()
    return out


def _peak(module, x):
    """params + grads + the most saved activations in one forward+backward."""
    params = [_plain(p) for p in module.parameters()]
    with SavedBytes(p.untyped_storage().data_ptr() for p in params) as saved:
        _step(module, x)
    return 2 * sum(p.nbytes for p in params) + saved.most


def _grad_shards(module):
    """{name: this rank's gradient shard}; labkit's fused qkv split into torch's q, k, v."""
    out = {}
    for name, p in module.named_parameters():
        grad = _local(p.grad)
        if ".qkv." in name:
            for part, g in zip("qkv", grad.chunk(3, dim=0)):
                out[name.replace("qkv", part)] = g
        else:
            out[name] = grad
    return out


def plan(kind, styles, split_qkv):
    """{module name: ColwiseParallel() / RowwiseParallel()} from `styles` (labkit's or
    torch's); split_qkv: q, k and v as three names where labkit has the fused qkv."""
    colwise, rowwise = styles
    out = {}
    for name, style in PLANS[kind].items():
        for one in ([name.replace("qkv", p) for p in "qkv"] if split_qkv and "qkv" in name
                    else [name]):
            out[one] = colwise() if style == "colwise" else rowwise()
    return out


def compare(ctx, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as torch_tp
    from labkit import parallel as labkit_tp
    torch.manual_seed(0)
    cfg = models.GPTConfig(vocab=128, seq=SEQ, hidden=HIDDEN, heads=HEADS, ffn=FFN, layers=1)
    full = models.MLPBlock(HIDDEN, FFN) if kind == "mlp" else models.Block(cfg)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    expected = _step(full, x)
    theirs = copy.deepcopy(full) if kind == "mlp" else TorchBlock(full)
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    sides = {}
    for side, lib, module in (("labkit", labkit_tp, copy.deepcopy(full)),
                              ("torch", torch_tp, theirs)):
        styles = (lib.ColwiseParallel, lib.RowwiseParallel)
        sides[side] = lib.parallelize_module(module, mesh, plan(kind, styles, side == "torch"))
    with ctx.off_the_record():
        outs = {side: _step(m, x) for side, m in sides.items()}
        ok = all(torch.allclose(o, expected, atol=1e-5) for o in outs.values())
        grads = tp.gather_grads(sides["labkit"])
        ok &= all(torch.allclose(grads[n], p.grad, atol=1e-5) for n, p in full.named_parameters())
        ours, other = _grad_shards(sides["labkit"]), _grad_shards(sides["torch"])
        ok &= set(ours) == set(other) and all(torch.allclose(g, other[n], atol=1e-5)
                                              for n, g in ours.items())
        peaks = {side: _peak(m, x) for side, m in sides.items()}
        times = {side: [] for side in SIDES}
        for r in range(ROUNDS):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                per_step = []
                for i in range(WARMUP + TIMED):
                    dist.barrier()
                    start = time.perf_counter()
                    _step(sides[side], x)
                    if i >= WARMUP:
                        per_step.append(time.perf_counter() - start)
                times[side].append(per_step)
    return dict(times=times, peaks=peaks, equal=bool(ok), logged=len(ctx.comm.totals))


def summarise(per_rank):
    out = {}
    for side in SIDES:   # per round: the median over steps of the slowest rank
        out[side] = [statistics.median(max(ts) for ts in zip(*(r["times"][side][k]
                                                                 for r in per_rank)))
                     for k in range(ROUNDS)]
    ratios = [a / b for a, b in zip(out["labkit"], out["torch"])]
    return dict(step={s: statistics.median(out[s]) for s in SIDES},
                ratio=statistics.median(ratios), spread=(min(ratios), max(ratios)),
                peak={s: max(r["peaks"][s] for r in per_rank) for s in SIDES},
                equal=all(r["equal"] for r in per_rank),
                logged=max(r["logged"] for r in per_rank))


def main():
    rows = []
    setting = (f"b={BATCH} s={SEQ} h={HIDDEN} ffn={FFN} heads={HEADS}; gloo CPU, "
               f"{os.cpu_count()} cores, world {WORLD}; {ROUNDS} interleaved rounds x {TIMED} "
               "timed fwd+bwd")
    print(setting)
    for kind in ("mlp", "block"):
        t0 = time.time()
        s = summarise(labkit.launch(compare, WORLD, kind, timeout_s=1200))
        a, b = s["spread"]
        peak_ratio = s["peak"]["labkit"] / s["peak"]["torch"]
        print(f"\n{kind} ({time.time() - t0:.0f} s): step {s['step']['labkit'] * 1e3:.1f} ms "
              f"(labkit) vs {s['step']['torch'] * 1e3:.1f} ms (torch); labkit_over_torch: time "
              f"{s['ratio']:.2f} (per-round {a:.2f}-{b:.2f}), peak memory {peak_ratio:.2f} "
              f"({s['peak']['labkit'] / 1e6:.2f} vs {s['peak']['torch'] / 1e6:.2f} MB); outputs "
              f"and gradients equal: {s['equal']}; labkit comm-log rows while off: {s['logged']}")
        assert s["equal"], "the two implementations disagree"
        base = dict(benchmark="tensor_parallel", world_size=WORLD,
                    labkit_impl=(f"parallelize_module Colwise/RowwiseParallel ({kind}: "
                                 f"{', '.join(PLANS[kind])})"),
                    torch_impl="parallelize_module Colwise/RowwiseParallel (DTensor)")
        note = (f"{setting}; per-round ratio {a:.2f}-{b:.2f}; instrumentation off; shared, "
                "loaded machine")
        rows += [dict(base, metric=f"{kind}_step_s_median", labkit=f"{s['step']['labkit']:.4e}",
                      torch=f"{s['step']['torch']:.4e}", labkit_over_torch=f"{s['ratio']:.2f}",
                      spread_min=f"{a:.2f}", spread_max=f"{b:.2f}", rounds=ROUNDS, notes=note),
                 dict(base, metric=f"{kind}_peak_bytes", labkit=s["peak"]["labkit"],
                      torch=s["peak"]["torch"], labkit_over_torch=f"{peak_ratio:.2f}",
                      notes="params + grads + max saved for backward, unique storages")]
    replace_rows(rows)
    print(f"\n{len(rows)} rows written to data/bench.csv (a rerun replaces its configurations' "
          "rows; column labkit_over_torch)")


if __name__ == "__main__":
    main()

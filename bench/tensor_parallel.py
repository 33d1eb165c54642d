"""labkit's tensor-parallel MLP and block against PyTorch's DTensor tensor parallelism.

Same weights (one seeded reference module), same input, same world size, one run:
`labkit.tensor_parallel.ParallelMLP` / `ParallelBlock` vs
`torch.distributed.tensor.parallel.parallelize_module` with ColwiseParallel / RowwiseParallel
(gloo, CPU, `init_device_mesh("cpu", (N,))`). Reported: median forward+backward wall time
(warm-up excluded, labkit's clock off, the two implementations alternating), peak memory
(parameters + gradients + the most saved for backward, counted by unique storage), and whether
outputs and gradients equal the single-device module's.
"""
import copy
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import labkit  # noqa: E402
from common import append_rows, median  # noqa: E402
from labkit import models  # noqa: E402
from labkit import tensor_parallel as tp  # noqa: E402

WORLD, BATCH, SEQ, HIDDEN, HEADS, FFN = 2, 4, 128, 256, 8, 1024
WARMUP, ITERS = 3, 12


class SplitQKVAttention(nn.Module):
    """The reference attention with q, k, v as three Linears (DTensor's ColwiseParallel shards
    a Linear's rows contiguously, which would mix q|k|v of a fused weight); heads per rank are
    read from the local width."""

    def __init__(self, attn, heads):
        super().__init__()
        h = attn.proj.in_features
        self.head_dim = h // heads
        self.q, self.k, self.v = (nn.Linear(h, h) for _ in range(3))
        for i, lin in enumerate((self.q, self.k, self.v)):
            lin.weight.data.copy_(attn.qkv.weight.data[i * h:(i + 1) * h])
            lin.bias.data.copy_(attn.qkv.bias.data[i * h:(i + 1) * h])
        self.proj = copy.deepcopy(attn.proj)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.proj(models.causal_attention(q, k, v, q.shape[-1] // self.head_dim))


class TorchBlock(nn.Module):
    def __init__(self, block, heads):
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = SplitQKVAttention(block.attn, heads)
        self.mlp = copy.deepcopy(block.mlp)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _local(t):
    """A DTensor's local tensor (an output may be an AsyncCollectiveTensor: it waits on first
    use and stays in the autograd graph, so it is used as it is)."""
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
    """The most bytes saved for backward at once (unique storages; DTensors unwrapped), the
    way labkit's MemoryTracker counts them (which cannot look inside a DTensor)."""

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
    out = _local(module(x))
    out.pow(2).mean().backward()
    return out


def _state_bytes(module):
    ps = [_local(p) for p in module.parameters()]
    return sum(p.nbytes for p in ps) + sum(p.nbytes for p in ps), ps


def _peak(module, x):
    """params + grads + the most saved activations in one forward+backward."""
    states, ps = _state_bytes(module)
    with SavedBytes(_plain(p).untyped_storage().data_ptr() for p in ps) as saved:
        _step(module, x)
    return states + saved.most


def compare(ctx, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    ctx.clock.enabled = False  # timing: no modelled clock (the comm log stays on)
    torch.manual_seed(0)
    cfg = models.GPTConfig(vocab=128, seq=SEQ, hidden=HIDDEN, heads=HEADS, ffn=FFN, layers=1)
    full = models.MLPBlock(HIDDEN, FFN) if kind == "mlp" else models.Block(cfg)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    expected = full(x)
    expected.pow(2).mean().backward()

    if kind == "mlp":
        ours = tp.ParallelMLP(ctx, ctx.world, full)
        theirs = copy.deepcopy(full)
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    else:
        ours = tp.ParallelBlock(ctx, ctx.world, full, HEADS)
        theirs = TorchBlock(full, HEADS)
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    theirs = parallelize_module(theirs, mesh, plan)

    # equal results: outputs and this rank's gradient shards vs the full module's
    out_ours, out_theirs = _step(ours, x), _step(theirs, x)
    ok = torch.allclose(out_ours, expected, atol=1e-5) and \
        torch.allclose(out_theirs, expected, atol=1e-5)
    full_grads = tp.gather_grads(ctx, ours)
    for name, p in full.named_parameters():
        ok &= torch.allclose(full_grads[name], p.grad, atol=1e-5)
    ours_shards, theirs_shards = _grad_shards(ours), _grad_shards(theirs)
    ok &= set(ours_shards) == set(theirs_shards)
    for name, g in ours_shards.items():
        ok &= torch.allclose(g, theirs_shards[name], atol=1e-5)

    peaks = dict(labkit=_peak(_zeroed(ours), x), torch=_peak(_zeroed(theirs), x))
    times = {"labkit": [], "torch": []}
    for i in range(WARMUP + ITERS):
        for name, module in (("labkit", ours), ("torch", theirs)):
            _zeroed(module)
            dist.barrier()
            start = time.perf_counter()
            _step(module, x)
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    calls = len(ctx.comm.records)
    return dict(times=times, peaks=peaks, equal=bool(ok), calls=calls)


def _zeroed(module):
    for p in module.parameters():
        p.grad = None
    return module


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


def main():
    rows = []
    for kind in ("mlp", "block"):
        per_rank = labkit.launch(compare, WORLD, kind, timeout_s=600)
        r = per_rank[0]
        t = {k: max(median(rr["times"][k]) for rr in per_rank) for k in ("labkit", "torch")}
        peak = {k: max(rr["peaks"][k] for rr in per_rank) for k in ("labkit", "torch")}
        equal = all(rr["equal"] for rr in per_rank)
        shape = f"b={BATCH} s={SEQ} h={HIDDEN} ffn={FFN}" + (f" heads={HEADS}" if kind == "block"
                                                             else "")
        print(f"{kind}: step {t['labkit'] * 1e3:.1f} ms (labkit) vs {t['torch'] * 1e3:.1f} ms "
              f"(torch), ratio {t['labkit'] / t['torch']:.2f}; peak {peak['labkit'] / 1e6:.2f} "
              f"MB vs {peak['torch'] / 1e6:.2f} MB, ratio {peak['labkit'] / peak['torch']:.2f}; "
              f"outputs and gradients equal: {equal}")
        common = dict(benchmark="tensor_parallel", world_size=WORLD,
                      labkit_impl=f"tensor_parallel.Parallel{'MLP' if kind == 'mlp' else 'Block'}",
                      torch_impl="parallelize_module Colwise/RowwiseParallel (DTensor)")
        note = f"{shape}; gloo CPU; fwd+bwd median of {ITERS}; equal outputs+grads: {equal}"
        rows.append(dict(common, metric=f"{kind}_step_s", labkit=f"{t['labkit']:.4f}",
                         torch=f"{t['torch']:.4f}", ratio=f"{t['labkit'] / t['torch']:.2f}",
                         notes=note))
        rows.append(dict(common, metric=f"{kind}_peak_bytes", labkit=peak["labkit"],
                         torch=peak["torch"], ratio=f"{peak['labkit'] / peak['torch']:.2f}",
                         notes="params + grads + max saved activations, unique storages"))
    append_rows(rows)


if __name__ == "__main__":
    main()

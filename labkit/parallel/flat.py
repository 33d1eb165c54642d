"""The mechanics the techniques share: flat buffers, gradient averaging, wrapper names.

A collective costs a latency α per call on top of its bytes (α + S/β per message, ring model),
so the blocks send many small tensors as one: they pack them end to end into a flat buffer and
read each back as a view at its offset. `FlatBuffer` is that packing (DataParallel's gradient
buckets, ZeRO's sharded buckets, ZeRO-1's owner broadcasts, the experts MoE gathers, FullyShard's
units: a layout of meta tensors laid over buffers it keeps itself);
`bucket_params` cuts parameters into buckets of about a byte budget (backward order: backward
produces the last layer's gradients first, PyTorch DDP, Li et al. 2020, arXiv 2006.15704).

`average_gradients(params, group)` is data parallelism's one collective: the average of the
replicas' gradients, one flat all-reduce, 2(N-1)/N x 4Ψ bytes per rank on a ring (Patarasuk &
Yuan 2009). DataParallel does the same in buckets during backward; drivers and the hybrid call
this after backward. `unwrapped_name` drops the `.module.` a wrapper (ExpertParallel,
ContextParallel) adds to its parameters' names, giving the single-device model's names back.
"""
import io
import math
from collections.abc import Iterable

import torch

from ..runtime.comm import GroupLike
from ..runtime.context import context


class FlatBuffer:
    """`tensors` packed end to end, in order, into one 1-D `data` buffer of `padded` elements
    (`numel` rounded up to a multiple of `pad_to`; the padding is zero).

    `view(t, buffer)` is tensor t's part of `buffer` (default `data`) shaped like t; `views`
    all of them; `pack(values)` copies values in, `bind()` makes the tensors' storage the
    buffer's (they become views of it); `part(rank, size)` is member rank's 1/size slice.
    Meta tensors describe a layout only (no `data`: pass the buffer to read). `arrived`, `handle`
    hold the technique's bookkeeping: which gradients are in, the collective in flight.
    """

    def __init__(self, tensors: Iterable[torch.Tensor], *, pad_to: int = 1,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 index: int = 0, copy: bool = True) -> None:
        self.tensors, self.index = list(tensors), index
        if not self.tensors:
            raise ValueError("a FlatBuffer needs at least one tensor")
        first = self.tensors[0]
        self.offsets, offset = {}, 0
        for t in self.tensors:
            self.offsets[t] = offset
            offset += t.numel()
        self.numel = offset
        self.padded = math.ceil(offset / pad_to) * pad_to
        layout_only = first.device.type == "meta" and device is None
        self.data = None if layout_only else torch.zeros(
            self.padded, dtype=dtype or first.dtype, device=device or first.device)
        if copy and not layout_only:
            self.pack(self.tensors)
        self.arrived, self.handle = set(), None

    def view(self, tensor: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """`tensor`'s place in `buffer` (default: data), shaped like it."""
        buffer = self.data if buffer is None else buffer
        offset = self.offsets[tensor]
        return buffer[offset:offset + tensor.numel()].view(tensor.shape)

    def views(self, buffer: torch.Tensor | None = None) -> list[torch.Tensor]:
        return [self.view(t, buffer) for t in self.tensors]

    @torch.no_grad()
    def pack(self, values: Iterable[torch.Tensor | None],
             buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Copy `values` (one per tensor, in order; None: zeros) into `buffer` (default data)."""
        for t, value in zip(self.tensors, values):
            view = self.view(t, buffer)
            view.zero_() if value is None else view.copy_(value)
        return self.data if buffer is None else buffer

    def bind(self) -> None:
        """The tensors (parameters) become views of the buffer: updating one updates both."""
        for t in self.tensors:
            t.data = self.view(t)

    def part(self, rank: int, size: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Member `rank`'s slice of `size` equal slices (pad_to a multiple of size)."""
        n = self.padded // size
        buffer = self.data if buffer is None else buffer
        return buffer[rank * n:(rank + 1) * n]

    def part_views(self, rank: int, size: int, part: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's piece (1-D, maybe empty) inside `part`, member rank's slice of a
        buffer laid out like this one: what a shard holds of each tensor (FullyShard)."""
        lo = rank * self.padded // size
        hi = lo + part.numel()
        spans = [(max(self.offsets[t], lo), min(self.offsets[t] + t.numel(), hi))
                 for t in self.tensors]
        return [part[a - lo:max(a, b) - lo] for a, b in spans]

    @property
    def complete(self):
        return len(self.arrived) == len(self.tensors)

    @property
    def nbytes(self):
        return self.data.nbytes


def bucket_params(params: Iterable[torch.Tensor], cap_bytes: float,
                  may_exceed: bool = True) -> list[list[torch.Tensor]]:
    """`params` cut, in the order given, into lists of about `cap_bytes` (never mixing dtypes
    or devices). may_exceed (PyTorch DDP's rule): a bucket closes once it holds cap_bytes or
    more; otherwise (DeepSpeed's) a tensor that would take it past the cap opens the next one.
    Either way a bucket holds at least one tensor; cap 0 gives one tensor per bucket."""
    buckets, current, size = [], [], 0
    for p in params:
        full = size >= cap_bytes if may_exceed else size + p.nbytes > cap_bytes
        if current and (full or p.dtype != current[-1].dtype or p.device != current[-1].device):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += p.nbytes
    if current:
        buckets.append(current)
    return buckets


@torch.no_grad()
def average_gradients(params: Iterable[torch.Tensor], group: GroupLike = None, *,
                      skip_unused: bool = False, per_tensor: bool = False,
                      tag: str = "grad average") -> None:
    """Average the `.grad` of `params` over `group` (None: the world) in one flat all-reduce.

    A parameter without a gradient on this rank contributes zeros. skip_unused: one presence
    flag per tensor rides along, and a parameter no rank has a gradient for keeps grad None
    (as on one device: no optimizer step on zeros). per_tensor: one blocking all-reduce per
    parameter instead (the naive way: a latency α per tensor). `.grad` is updated in place.
    """
    ctx = context()
    group = ctx.group(group)
    params = [p for p in params if p.requires_grad]
    if not params or group.size == 1:
        return
    if per_tensor:
        for i, p in enumerate(params):
            if p.grad is None:   # every rank must join every all-reduce
                p.grad = torch.zeros_like(p)
            ctx.comm.all_reduce(p.grad, op="avg", group=group, tag=f"{tag} {i}")
        return
    grads = [p.grad for p in params]
    flags = [torch.tensor([float(g is not None)], device=p.device)
             for g, p in zip(grads, params)] if skip_unused else []
    flat = FlatBuffer(params + flags, copy=False)
    flat.pack(grads + flags)
    ctx.comm.all_reduce(flat.data, op="avg", group=group, tag=tag)
    for i, (p, g) in enumerate(zip(params, grads)):
        if skip_unused and flat.view(flags[i]).item() == 0:
            continue
        if g is None:
            p.grad = flat.view(p).clone()
        else:
            g.copy_(flat.view(p))


def all_gather_objects(obj, group=None, tag="objects"):
    """Every member's picklable `obj`, in member order: pickled into bytes, then two
    all_gathers through ctx.comm (the sizes, then the bytes padded to the largest)."""
    ctx = context()
    group = ctx.group(group)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=ctx.device)
    sizes = ctx.comm.all_gather(size, group=group, tag=f"{tag} sizes").tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=ctx.device)
    padded[:data.numel()] = data.to(ctx.device)
    everything = ctx.comm.all_gather(padded, group=group, tag=tag).view(group.size, -1).cpu()
    return [torch.load(io.BytesIO(everything[r, :n].numpy().tobytes()), weights_only=False)
            for r, n in enumerate(sizes)]


def unwrapped_name(name: str) -> str:
    """A parameter's name without the `.module` a wrapper adds (`blocks.0.mlp.module.router.w`
    -> `blocks.0.mlp.router.w`): the name in the unwrapped model."""
    return name.replace(".module.", ".")

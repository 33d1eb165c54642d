"""fully_shard: FSDP2, each parameter sharded on dim 0, applied bottom-up like PyTorch's.

The idea (Zhao et al. 2023, PyTorch FSDP, arXiv 2304.11277; ZeRO-3, Rajbhandari et al. 2020;
FSDP2's per-parameter sharding, torch.distributed.fsdp.fully_shard): no rank keeps a full copy
of any parameter. Each parameter of shape (d0, ...) is cut on dim 0 as `torch.chunk` cuts it:
rank r holds rows [r c, min((r + 1) c, d0)) with c = ceil(d0 / N), stored in a buffer of c rows
(the last ranks' padded with zeros, possibly all padding) so every rank sends the same bytes.
`fully_shard(layer)` for each layer, then `fully_shard(model)` for the root (which owns the
parameters no layer took), makes one *group* per call: before the module's forward, one
all-gather of its group's shards (copied into one buffer, gathered, copied out into full
parameters); after its forward the full parameters are freed (`reshard_after_forward`; the
root keeps them, its backward comes next), gathered again when backward reaches the module's
outputs; as soon as every gradient of the group is in, one reduce-scatter averages them and
leaves each rank the gradient of its own rows in the shard's `.grad`. Bytes per rank for Ψ
fp32 parameters, K bytes of optimizer state each: (4 + 4 + K) Ψ / N (+ the padding: c N - d0 < N
rows per parameter) plus the largest group gathered (two with the root's); communication per
step: all-gathers of Ψ before forward and again before backward, a reduce-scatter of Ψ: 3Ψ,
1.5x DDP's all-reduce (2Ψ).

    for layer in model.layers:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)                        # the root: what is left (embeddings, norms, head)
    optimizer = torch.optim.Adam(model.parameters())   # this rank's rows of every parameter

The module keeps its class: it becomes an instance of a subclass `FSDP<Class>` of
(`FSDPModule`, its class), as torch does, with torch's methods: `unshard()`/`reshard()` gather
and free by hand; `set_requires_gradient_sync(False)` accumulates micro-batches' full gradients
without a reduce-scatter (one, of their sum, on the step it is back on);
`set_modules_to_forward_prefetch([next])` / `set_modules_to_backward_prefetch([previous])`
issue those modules' all-gathers, asynchronously, as soon as this module's own is in, so they
run while this module computes (torchtitan: each block prefetches the next; one more group's
full parameters held meanwhile). The parameters it then shows are plain tensors holding this
rank's rows (torch: DTensors with the full shape, `.to_local()` the rows); `full_tensor(p)`
gathers one. The flat-buffer wrapper (`FullyShard`, fully_shard.py) is the FSDP1 design (one
FlatParameter per unit).
"""
from dataclasses import dataclass
import itertools
import math
import weakref

import torch
import torch.nn as nn

from ..runtime import torch_compat
from ..runtime.context import context
from .fully_shard_layout import _each_tensor, _map_tensors
from .self_check import BATCH, batch_share_forward, check_against_one_device, is_hugging_face


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """torch's: compute (and all-gather) in `param_dtype`, reduce gradients in `reduce_dtype`
    (None: param_dtype), cast the module's outputs to `output_dtype`; the shards, their
    gradients and so the optimizer stay in the parameters' own dtype (fp32 masters)."""
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading (torch's default)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """The shards, their gradients and so the optimizer state in host memory; copied to the
    device before each all-gather (ZeRO-Offload). On a CPU-only run host and device are one."""
    pin_memory: bool = True


_STATES = weakref.WeakSet()   # every group of this process, for the memory tracker
_RUNNING = []                 # the groups whose forward is running now (root: the first)
_NUMBER = itertools.count()   # a group's number: two "Block"s' buffers keep apart


class FSDPModule:
    """What `fully_shard` mixes into a module's class: torch's FSDPModule methods a training
    script calls (torchtitan's), with torch's signatures. Not recursive unless `recurse`."""

    def unshard(self, async_op: bool = False):
        """All-gather this module's parameters now (they stay until `reshard()`). async_op:
        only issue the all-gather and return a handle; `wait()` (or the module's forward)
        copies the gathered rows out."""
        if async_op:
            self._fsdp_state.prefetch()
            return UnshardHandle(self._fsdp_state)
        self._fsdp_state.unshard()
        return None

    def reshard(self):
        """Free the full parameters; the module shows its shards again."""
        self._fsdp_state.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """False: backward keeps each full gradient (added to the last micro-batch's, in the
        reduce dtype) and reduce-scatters nothing; the first backward with True reduce-scatters
        the sum once (torch's gradient accumulation without communication; FSDP1's no_sync)."""
        for state in self._states(recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True):
        """False: the full parameters stay after backward, so the next micro-batch's forward
        gathers nothing (set it back to True before the step: the optimizer moves the shards)."""
        for state in self._states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True):
        """`fully_shard`'s reshard_after_forward, changed between steps (e.g. the root: True)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError("reshard_after_forward should be a bool, got "
                             f"{type(reshard_after_forward)}")
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]):
        """When this module's forward starts (its own parameters gathered), issue `modules`'
        all-gathers without waiting: they run while this module computes."""
        self._fsdp_state.forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]):
        """The same in backward: when this module's backward starts, issue `modules`'."""
        self._fsdp_state.backward_prefetch = _states_of(modules)

    def _states(self, recurse):
        return [m._fsdp_state for m in (self.modules() if recurse else [self])
                if isinstance(m, FSDPModule)]


def _states_of(modules):
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(m)}: {m}")
    return [m._fsdp_state for m in modules]


class UnshardHandle:
    """What `unshard(async_op=True)` returns: `wait()` finishes the all-gather and shows the
    full parameters (the module's forward waits by itself)."""

    def __init__(self, state):
        self.state = state

    def wait(self):
        self.state.unshard()


def full_tensor(param):
    """The full parameter behind a shard `fully_shard` made (an all-gather on its group), as
    torch's `param.full_tensor()`."""
    sharded = param._labkit_fsdp2
    return sharded.state.gather([sharded], off_the_record=True)[0].clone()


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy | None = None,
                verify: bool | None = None) -> nn.Module:
    """Shard `module`'s parameters (those no earlier `fully_shard` below it took) over `mesh`
    (a 1-D DeviceMesh, a process group, or None: the world) and hook its forward and backward.
    reshard_after_forward: None (torch's default): True except for the root; False keeps the
    full parameters from forward to backward (2Ψ of communication instead of 3Ψ).
    verify: None (default) checks a Hugging Face model (the root call; a layer has no config)
    first: the same calls on a miniature of it (its sharded submodules by name, then the root),
    each rank its own rows of a batch, must give one device's logits and gradients
    (self_check.py; float32: the mp_policy left out, its rounding is a choice, not a fault).
    Cost, measured on 2 gloo ranks of a busy 2-core CPU: ~0.1 s for a tiny Llama. True forces
    it, False skips it."""
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard applied twice to {module._fsdp_state.name}: call it "
                         "once per module, bottom-up")
    if mesh is not None and getattr(mesh, "ndim", 1) != 1:
        raise ValueError(f"fully_shard: labkit shards over a 1-D mesh, got {mesh.ndim}-D "
                         "(HSDP: HybridParallel(dp_replicate=...))")
    group = mesh.get_group() if hasattr(mesh, "get_group") else mesh
    if verify or (verify is None and is_hugging_face(module)):
        _verify(module, context().group(group), reshard_after_forward, offload_policy)
    state = _Group(module, context().group(group), reshard_after_forward, mp_policy,
                   offload_policy or OffloadPolicy())
    cls = type(module)
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module._fsdp_state = state
    module.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    return module


def _verify(module, group, reshard_after_forward, offload_policy):
    """The self-check (self_check.py): `module`'s sharded submodules (by name, deepest first,
    each with its own settings) and then the root sharded alike on a miniature of it."""
    inner = sorted(((name, m._fsdp_state) for name, m in module.named_modules()
                    if isinstance(m, FSDPModule)), key=lambda item: -item[0].count("."))
    before = set(_STATES)

    def apply(mini):
        for name, state in inner:
            try:
                target = mini.get_submodule(name)
            except AttributeError:   # a layer the miniature does not have
                continue
            fully_shard(target, mesh=group, reshard_after_forward=state.reshard_after_forward,
                        offload_policy=state.offload, verify=False)
        return fully_shard(mini, mesh=group, reshard_after_forward=reshard_after_forward,
                           offload_policy=offload_policy, verify=False)
    try:
        check_against_one_device(
            module, apply, group, what="fully_shard", batch=BATCH * group.size,
            forward=batch_share_forward(lambda m: isinstance(m, FSDPModule), group),
            gradients=lambda sharded: {n: _full_gradient(p) for n, p in
                                       sharded.named_parameters() if p.grad is not None})
    finally:   # the miniature's groups are no part of this rank's memory
        for state in set(_STATES) - before:
            _STATES.discard(state)


def _full_gradient(param):
    """The whole gradient of a shard `fully_shard` made (its rows gathered from every rank)."""
    sharded = param._labkit_fsdp2
    rows = torch.zeros_like(sharded.padded)
    rows[:len(param.grad)] = param.grad
    state = sharded.state
    return state.ctx.comm.all_gather(rows, group=state.group)[:sharded.rows]


class _ShardedParam:
    """One parameter: its rows on this rank (`padded`: c rows; `sharded`: the real ones, what
    the optimizer steps) and the full parameter modules compute with (`unsharded`, its storage
    freed between uses; `full` shares it and is what the all-gather writes into)."""

    def __init__(self, state, param, uses):
        n, r = state.group.size, state.group.rank
        self.state, self.uses, self.shape = state, uses, param.shape
        self.rows = param.shape[0]
        self.chunk = math.ceil(self.rows / n)   # torch.chunk's rows per rank
        mine = param.detach()[r * self.chunk:(r + 1) * self.chunk]
        host = torch.device("cpu") if state.offload else param.device
        self.padded = torch.zeros((self.chunk,) + tuple(param.shape[1:]), dtype=param.dtype,
                                  device=host)
        self.padded[:len(mine)] = mine
        if host != param.device and state.offload.pin_memory and torch.cuda.is_available():
            self.padded = self.padded.pin_memory()
        self.sharded = nn.Parameter(self.padded[:len(mine)], requires_grad=param.requires_grad)
        self.sharded._labkit_fsdp2 = self
        dtype = state.mp.param_dtype or param.dtype
        self.full = torch.empty(param.shape, dtype=dtype, device=param.device)
        self.unsharded = nn.Parameter(torch.empty(0, dtype=dtype, device=param.device),
                                      requires_grad=param.requires_grad)
        # `.data =`: the leaf keeps its own version counter, so refilling `full` in place
        # before backward does not look to autograd like a change of a saved tensor
        self.unsharded.data = self.full
        self.full.untyped_storage().resize_(0)
        self.accumulated = None   # sync off: the full gradients kept so far (reduce dtype)
        if param.requires_grad:
            self.unsharded.register_post_accumulate_grad_hook(state.on_gradient)

    @property
    def row_numel(self):
        return self.padded[0].numel() if self.chunk else 0

    def show(self, param):
        for module, name in self.uses:
            module._parameters[name] = param


class _Group:
    """What one `fully_shard(module)` call owns: its parameters and their collectives."""

    def __init__(self, module, group, reshard_after_forward, mp, offload):
        self.ctx, self.group, self.mp = context(), group, mp
        self.name = type(module).__name__
        self.buffer = f"{self.name}#{next(_NUMBER)}"   # its name in the memory tracker
        self.offload = offload if isinstance(offload, CPUOffloadPolicy) else None
        self.reshard_after_forward, self.is_root = reshard_after_forward, None
        uses = {}
        for m in _own_modules(module):
            for attr, p in m.named_parameters(recurse=False):
                if not hasattr(p, "_labkit_fsdp2"):
                    uses.setdefault(p, []).append((m, attr))
        for p in uses:
            if p.dim() == 0:
                raise ValueError(f"fully_shard: a 0-dim parameter in {self.name} has no dim 0 "
                                 "to shard; make it shape (1,)")
        self.params = [_ShardedParam(self, p, where) for p, where in uses.items()]
        for p in self.params:
            p.show(p.sharded)
        self.gathered, self.inflight = False, None   # inflight: an issued all-gather
        self.arrived, self.reduced, self.backward_started = set(), False, False
        self.requires_gradient_sync, self.reshard_after_backward = True, True
        self.forward_prefetch, self.backward_prefetch = [], []   # groups (set_modules_to_...)
        _STATES.add(self)
        ctx = self.ctx
        ctx.memory.watch(params=lambda: [p.padded for s in _STATES if s.ctx is ctx
                                         for p in s.params if not s.offload],
                         grads=lambda: [t for s in _STATES if s.ctx is ctx for p in s.params
                                        for t in (p.unsharded.grad, p.accumulated,
                                                  p.sharded.grad)
                                        if t is not None])

    # --- all-gather and free ---------------------------------------------------------------
    def gather(self, params, off_the_record=False, async_op=False):
        """All-gather `params` in one collective: each rank's padded rows copied into one
        buffer (in the compute dtype), gathered; `split` copies each parameter's rows out.
        async_op: issue it and return the handle (its `wait()` gives the gathered buffer)."""
        dtype = self.mp.param_dtype
        local = torch.cat([p.padded.to(p.full.device, dtype or p.padded.dtype).reshape(-1)
                           for p in params])
        if off_the_record:
            with self.ctx.off_the_record():
                return self.split(params, self.ctx.comm.all_gather(local, group=self.group))
        gathered = self.ctx.comm.all_gather(local, group=self.group, async_op=async_op,
                                            tag=f"params {self.name}")
        return gathered if async_op else self.split(params, gathered)

    def split(self, params, gathered):
        """The full tensors in the gathered buffer: rank by rank, each parameter's rows."""
        by_rank, out, at = gathered.view(self.group.size, -1), [], 0
        for p in params:
            size = p.chunk * p.row_numel
            rows = by_rank[:, at:at + size].reshape((-1,) + tuple(p.shape[1:]))
            out.append(rows[:p.rows])
            at += size
        return out

    def prefetch(self):
        """Issue this group's all-gather now and go on (explicit prefetch); `unshard` waits."""
        if self.gathered or self.inflight is not None or not self.params:
            return
        self.inflight = self.gather(self.params, async_op=True)
        self.ctx.memory.add_buffer(f"prefetch {self.buffer}", self.inflight.result)

    def unshard(self):
        if self.gathered or not self.params:
            return
        if self.inflight is not None:   # prefetched: wait for it
            values = self.split(self.params, self.inflight.wait())
            self.inflight = None
            self.ctx.memory.remove_buffer(f"prefetch {self.buffer}")
        else:
            values = self.gather(self.params)
        for i, (p, value) in enumerate(zip(self.params, values)):
            p.full.untyped_storage().resize_(p.full.numel() * p.full.element_size())
            with torch.no_grad():
                p.full.copy_(value)
            self.ctx.memory.exclude(p.full)   # saved for backward: not an activation
            self.ctx.memory.add_buffer(f"gathered {self.buffer} {i}", p.full)
            p.show(p.unsharded)
        self.gathered = True

    def reshard(self):
        if not self.gathered:
            return
        for i, p in enumerate(self.params):
            p.show(p.sharded)
            self.ctx.memory.include(p.full)
            p.full.untyped_storage().resize_(0)   # `unsharded` stays valid, its bytes go
            self.ctx.memory.remove_buffer(f"gathered {self.buffer} {i}")
        self.gathered = False

    # --- forward ------------------------------------------------------------------------------
    def pre_forward(self, module, args, kwargs):
        if self.is_root is None:   # the first group whose forward runs with no other running
            self.is_root = not _RUNNING
        _RUNNING.append(self)
        self.unshard()
        for target in self.forward_prefetch:   # after its own gather, before its compute
            target.prefetch()
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            args, kwargs = _map_tensors((args, kwargs), lambda t: t.to(self.mp.param_dtype)
                                        if t.is_floating_point() else t)
        return args, kwargs

    def post_forward(self, module, args, output):
        _RUNNING.remove(self)
        keep = self.reshard_after_forward is False or (self.reshard_after_forward is None
                                                        and self.is_root)
        if not keep:
            self.reshard()
        if self.mp.output_dtype is not None:
            output = _map_tensors(output, lambda t: t.to(self.mp.output_dtype)
                                  if t.is_floating_point() else t)
        if torch.is_grad_enabled():
            for t in _each_tensor(output):   # backward reaching the outputs gathers again
                if t.requires_grad:
                    t.register_hook(self.pre_backward)
        return output

    # --- backward: gather again, reduce-scatter once every gradient is in --------------------
    def start_backward(self):
        if not self.backward_started:   # like DDP: finish by itself when backward ends
            self.backward_started = True
            torch_compat.queue_callback(self.finish_backward)

    def pre_backward(self, grad):
        self.start_backward()
        if not self.reduced:
            self.unshard()
            for target in self.backward_prefetch:
                if not target.reduced:   # its backward is still to come
                    target.prefetch()

    def on_gradient(self, unsharded):
        self.start_backward()
        self.arrived.add(id(unsharded))
        if len(self.arrived) == sum(p.sharded.requires_grad for p in self.params):
            self.gradients_in()

    def gradients_in(self):
        """Every gradient of the group is in: reduce-scatter them (sync off: keep them)."""
        if self.requires_gradient_sync:
            self.reduce_scatter()
        else:
            self.accumulate()
        self.reduced = True
        if self.reshard_after_backward and all(p.sharded.requires_grad for p in self.params):
            self.reshard()   # a frozen weight may still be read: wait for the end

    def accumulate(self):
        """Sync off: each full gradient is kept (in the reduce dtype), added to what the earlier
        micro-batches left; the next reduce-scatter sends the sum."""
        for p in self.params:
            grad, p.unsharded.grad = p.unsharded.grad, None
            if grad is not None:
                dtype = self.mp.reduce_dtype or self.mp.param_dtype or grad.dtype
                p.accumulated = grad.to(dtype) if p.accumulated is None else \
                    p.accumulated.add_(grad)

    def reduce_scatter(self):
        """One reduce-scatter (average) of the group's gradients (with what sync-off backwards
        kept): each padded to c N rows, laid out rank by rank; this rank's rows land in its
        shards' `.grad` (in their dtype)."""
        with_grad = [p for p in self.params
                     if p.unsharded.grad is not None or p.accumulated is not None]
        if with_grad:
            n, dtype = self.group.size, self.mp.reduce_dtype or self.mp.param_dtype
            pieces = []
            for p in with_grad:
                grad = p.unsharded.grad
                if grad is None:
                    grad = p.accumulated
                elif p.accumulated is not None:   # as torch: the kept sum + this one
                    grad = p.accumulated.add_(grad)
                grad = grad.to(dtype or grad.dtype)
                p.accumulated = None
                padded = grad.new_zeros((p.chunk * n,) + tuple(p.shape[1:]))
                padded[:p.rows] = grad
                pieces.append(padded.view(n, -1))
                p.unsharded.grad = None   # the full gradient goes once it is in the bucket
            mine = self.ctx.comm.reduce_scatter(torch.cat(pieces, dim=1).reshape(-1), op="avg",
                                                group=self.group, tag=f"grads {self.name}")
            at = 0
            for p in with_grad:
                rows = mine[at:at + p.chunk * p.row_numel].view(p.padded.shape)
                at += p.chunk * p.row_numel
                grad = rows[:len(p.sharded)].to(p.padded.dtype).to(p.sharded.device)
                p.sharded.grad = grad if p.sharded.grad is None else p.sharded.grad.add_(grad)

    def finish_backward(self):
        """At the end of backward: reduce what did not come in full (a parameter unused this
        step), free the full parameters, ready for the next step; a prefetch nobody used
        lands and is dropped (the optimizer is about to move the shards)."""
        if not self.reduced and self.arrived:
            self.gradients_in()
        if self.reshard_after_backward:
            self.reshard()
        self.arrived, self.reduced, self.backward_started = set(), False, False
        for state in [s for s in _STATES if s.ctx is self.ctx and s.inflight is not None]:
            state.inflight.wait()
            state.inflight = None
            self.ctx.memory.remove_buffer(f"prefetch {state.buffer}")


def _own_modules(module):
    """`module` and its descendants, leaving out the subtrees an earlier `fully_shard` took."""
    yield module
    for child in module.children():
        if not isinstance(child, FSDPModule):
            yield from _own_modules(child)

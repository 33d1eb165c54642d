"""FullyShard: ZeRO stage 3 as a wrapper of any nn.Module, in FSDP1's flat-buffer design.

PyTorch's FSDP1 (`FullyShardedDataParallel`) laid each unit out as one FlatParameter; its FSDP2
(`torch.distributed.fsdp.fully_shard`) shards each parameter on dim 0: that is labkit's
`fully_shard` (fsdp2.py), with torch's signature. This wrapper stays for the mesh (hybrid.py).

The idea (Rajbhandari et al. 2020, ZeRO, arXiv 1910.02054, stage 3; Zhao et al. 2023, PyTorch
FSDP, arXiv 2304.11277): no rank keeps a full copy of anything. The model is cut into *units*
(by default every module holding parameters of its own); each unit's parameters are laid out in
one flat buffer padded to a multiple of N, and rank r keeps elements [r*S, (r+1)*S) of it. The
wrapped module's parameters *are* these shards, so the user's own optimizer steps 1/N of the
model. A unit's full weights exist only while it computes: a forward pre-hook all-gathers them
(the next unit is prefetched, async), they are freed after its forward, gathered again just
before its backward, and its gradients are reduce-scattered (averaged) into the shards' `.grad`.

Bytes per rank, Ψ parameters, K bytes of optimizer state per parameter (the ZeRO paper's K: 12
for mixed-precision Adam, the fp32 master included; 8 for fp32 Adam, whose 2s are 4s):

    (2 + 2 + K) Ψ / N  +  the largest gathered unit (two at once with the prefetch)

Here the fp32 master *is* the shard and the 2-byte copy exists only while gathered, so the split
measured is 4 + 4 + 8 per parameter over N: the same 16Ψ/N. Communication per rank and step:
all-gathers before forward (Ψ) and before backward (Ψ), a reduce-scatter of the gradients (Ψ):
3Ψ, 1.5x data parallelism's all-reduce (2Ψ); `reshard_after_forward=False`: 2Ψ, holding the
full weights from forward to backward.

A forward may read a child's parameter without calling the child (nn.MultiheadAttention passes
`out_proj.weight` to its kernel; a tied head computes `F.linear(h, wte.weight)`): while the
wrapped module runs, a shard that reaches any op is replaced by its full parameter, its unit
gathered first (a TorchFunctionMode), and that op's outputs gather the unit again before their
backward. So every parameter a forward reads is gathered, whoever owns it; a unit read again
after its own forward freed it (a tied head) costs one all-gather more per step.

A FullyShard may sit inside the module another one wraps (torchtitan shards a block's experts
over the ranks holding the same experts, then the block over dp): the outer one leaves the
inner one's parameters to it, each gathers and reduce-scatters over its own group, and the
outer's `full_state_dict` asks the inner for its part. Wrapping a module twice is refused.

Parameters outside the units (a custom `units`) stay whole and their gradients are all-reduced.
Frozen parameters are gathered, never reduced; a parameter two modules share (tied weights) is
sharded once and gathered wherever it is used. `offload=True` keeps the shards, their gradients
and so the optimizer's state in host memory (ZeRO-Offload, Ren et al. 2021): on a GPU they live
on the CPU and cross PCIe; on a CPU-only run host and device are the same memory, so the split
(and the PCIe time on the clock) is modelled.

    model = FullyShard(model, compute_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # this rank's shards
    loss_fn(model(x_shard), y_shard).backward()   # gradients reduce-scattered during backward
    optimizer.step()
"""
from collections.abc import Callable

import torch
import torch.nn as nn

from ..runtime.comm import GroupLike
from ..runtime import torch_compat
from ..runtime.context import context
from .fully_shard_layout import (_make_units, _GatherOnUse, _map_tensors, copy_views_of,
                                 gather_before_backward)
from .self_check import BATCH, batch_share_forward, check_against_one_device, is_hugging_face
from ..theory import hardware   # PCIe numbers for the modelled host <-> device copies

OFFLOAD_LINK = "PCIe 5"        # what ZeRO-Offload's copies cross (modelled)
IN_FLIGHT = 2                  # gradient reduce-scatters outstanding at once (bounds memory)


def holds_parameters(module):
    """The default `units` predicate: a module that holds parameters of its own."""
    return any(True for _ in module.parameters(recurse=False))


def layer_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model cut into layers, in forward order: each child, each ModuleList entry (those
    holding parameters), as (name, module); `units=one_unit_per_layer(model)` shards by them."""
    units = []
    for name, child in model.named_children():
        members = ([(f"{name}.{i}", m) for i, m in enumerate(child)]
                   if isinstance(child, nn.ModuleList) else [(name, child)])
        units += [(n, m) for n, m in members if any(True for _ in m.parameters())]
    return units


def one_unit_per_layer(model: nn.Module) -> Callable[[nn.Module], bool]:
    """A `units` predicate: the layers of `layer_units(model)`, each one unit."""
    layers = {id(m) for _, m in layer_units(model)}
    return lambda module: id(module) in layers


def nested_shards(module):
    """(name, FullyShard) of the outermost FullyShards strictly inside `module`: a module
    sharded over its own group before its parent is (torchtitan shards a block's experts over
    the ranks holding the same experts, then the block over dp). The parent leaves them alone."""
    found = []
    for name, m in module.named_modules():
        if m is not module and isinstance(m, FullyShard) and not any(
                name.startswith(f"{outer}.") for outer, _ in found):
            found.append((name, m))
    return found


def _refuse_sharded_twice(module):
    """Its parameters are already shards (views of a FullyShard's flat buffer) outside a
    FullyShard of their own below it: sharding them again would shard shards, and fail later
    far from here ("mat2 must be a matrix")."""
    inside = {id(m) for _, inner in nested_shards(module) for m in inner.modules()}
    for name, m in module.named_modules():
        if id(m) in inside and m is not module:
            continue
        if isinstance(m, FullyShard) and m is not module:
            continue   # a nested FullyShard: its own group, left alone (nested_shards)
        if isinstance(m, FullyShard) or getattr(m, "_labkit_fully_sharded", False):
            where = f"its submodule {name!r}" if name else type(module).__name__
            raise ValueError(f"FullyShard applied twice: {where} is already inside a "
                             f"FullyShard; wrap each module once (units= picks the pieces)")


class FullyShard(nn.Module):
    """ZeRO-3 on any nn.Module inside any process group (`group=None`: the world).

    compute_dtype: run forward and backward in it (bf16/fp16); the shards stay in the
        parameters' dtype (fp32 masters), cast before each all-gather; floating inputs are cast.
    reshard_after_forward: free each unit's full weights after its forward (gather again for
        backward); False keeps them until its gradients are reduced.
    offload: the shards (and so the optimizer state the user makes for them) in host memory.
    units: predicate on modules choosing what is sharded (default `holds_parameters`); a unit
        owns the parameters of its subtree that no unit below it owns.
    prefetch: gather the next unit (in forward order; previous in backward) asynchronously.
    verify: None (default) checks a Hugging Face model (not labkit's own, not one holding
        FullyShards of its own) before sharding it: the same wrapping of a miniature of it,
        each rank its own rows of a batch, must give one device's logits and gradients
        (self_check.py; in float32, the compute_dtype left out: its rounding is a choice, not
        a fault). Cost, measured on 2 gloo ranks of a busy 2-core CPU (tests/test_self_check.py):
        0.15-0.2 s for a tiny Llama. True forces it, False skips it.
    """

    def __init__(self, module: nn.Module, group: GroupLike = None,
                 compute_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
                 offload: bool = False, units: Callable[[nn.Module], bool] | None = None, *,
                 prefetch: bool = True, verify: bool | None = None) -> None:
        _refuse_sharded_twice(module)
        if verify or (verify is None and is_hugging_face(module) and not nested_shards(module)):
            _verify(module, context().group(group), reshard_after_forward, offload, units,
                    prefetch)
        super().__init__()
        self.module = module
        for m in module.modules():   # marked: a second FullyShard over any of them is refused
            m._labkit_fully_sharded = True
        self._ctx = context()
        self.group = self._ctx.group(group)
        self.compute_dtype, self.offload = compute_dtype, offload
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        self._nested = nested_shards(module)   # sharded over their own groups: not ours
        self._units = _make_units(module, units or holds_parameters, self,
                                  skip={id(m) for _, inner in self._nested
                                        for m in inner.modules()})
        self._flats = [f for u in self._units for f in u.flats]
        self._order = [u for u in self._units if u.sharded and u.flats]  # forward order
        self._seen, self._inflight, self._pending, self._borrowed = [], {}, [], []
        self._entry_of_piece = {id(e.piece): e for u in self._units for e in u.entries}
        self._backward_started = False
        self._ctx.memory.watch(params=self._device_params, grads=self._device_grads)
        for unit in self._units:
            unit.module.register_forward_pre_hook(
                lambda m, a, u=unit: self._quietly(self._pre_forward, u))
            unit.module.register_forward_hook(
                lambda m, a, out, u=unit: self._quietly(self._post_forward, u, out))

    def forward(self, *args, **kwargs):
        if self.compute_dtype is not None:
            args, kwargs = _map_tensors((args, kwargs), lambda t: t.to(self.compute_dtype)
                                        if t.is_floating_point() else t)
        with _GatherOnUse(self):
            out = self.module(*args, **kwargs)
        for unit in self._borrowed:   # read directly by a forward, not needed until backward
            if unit.active == 0 and self.reshard_after_forward:
                self._free(unit)
        self._borrowed = []
        return out

    # inside any FullyShard's hooks (a nested one's too: its memory bookkeeping reads every
    # watched parameter) shards are touched as bookkeeping: no gather-on-use
    _in_hook = 0

    def _quietly(self, hook, *args):
        FullyShard._in_hook += 1
        try:
            return hook(*args)
        finally:
            FullyShard._in_hook -= 1

    def _borrow(self, entry):
        """The full parameter for `entry`'s shard that an op received: gather its unit now."""
        if not entry.unit.gathered:
            self._gather(entry.unit)
            self._borrowed.append(entry.unit)
        return entry.leaf

    # --- forward: gather, compute, free ------------------------------------------------------
    def _pre_forward(self, unit):
        if unit in self._order and unit not in self._seen:
            self._seen.append(unit)
        for u in unit.needs:   # itself, and the owners of tied weights it uses
            self._gather(u)
            u.active += 1
            u.swap_in()
        if self.prefetch and unit in self._order:
            self._prefetch(self._order.index(unit) + 1)

    def _post_forward(self, unit, out):
        # a parameter (or a view of one) returned must outlive the buffer freed below
        kept = copy_views_of(unit.needs, out) if self.reshard_after_forward else out
        for u in unit.needs:
            u.active -= 1
            if u.active == 0 and self.reshard_after_forward:
                self._free(u)
        if torch.is_grad_enabled():   # backward reaches `_pre_backward` before this unit's
            gather_before_backward(self, unit, kept)
        return None if kept is out else kept   # None: the module's own output, type and all

    def _pre_backward(self, unit):
        if not self._backward_started:   # like DDP: finish by itself when backward ends
            self._backward_started = True
            torch_compat.queue_callback(self.finish_gradient_synchronization)
        for u in unit.needs:
            self._gather(u)
        if self.prefetch and unit in self._order:
            self._prefetch(self._order.index(unit) - 1)

    # --- all-gather and free -----------------------------------------------------------------
    def _issue_gather(self, flat):
        """Start the all-gather of `flat`'s shard (cast to the compute dtype first)."""
        source = flat.shard.detach().to(flat.full.dtype)
        if self.offload:
            source = source.to(flat.full.device, non_blocking=True)
            self._pcie(source.nbytes, "offload: shard to device")
        if not flat.sharded:
            return source
        return self._ctx.comm.all_gather(source, group=self.group, async_op=True,
                                         tag=f"params {flat.name}")

    def _prefetch(self, index):
        unit = self._order[index] if 0 <= index < len(self._order) else None
        if unit is not None and not unit.gathered and unit not in self._inflight \
                and not any(f.issued for f in unit.flats):   # its backward is done already
            self._inflight[unit] = [self._issue_gather(f) for f in unit.flats]
            for flat, handle in zip(unit.flats, self._inflight[unit]):
                self._ctx.memory.add_buffer(f"prefetch {flat.name}", handle.result)

    def _gather(self, unit):
        """Make `unit`'s full weights present (wait for its prefetch, or gather now)."""
        if unit.gathered:
            return
        prefetched = self._inflight.pop(unit, None)
        for flat, source in zip(unit.flats, prefetched or map(self._issue_gather, unit.flats)):
            data = source.wait() if flat.sharded else source
            if flat.full is not flat.shard:
                flat.full.untyped_storage().resize_(flat.full.numel() * flat.full.element_size())
                flat.full.copy_(data)
                self._ctx.memory.exclude(flat.full)   # saved for backward: not activations
                self._ctx.memory.add_buffer(f"gathered {flat.name}", flat.full)
            if prefetched:   # the receive buffer goes once copied in
                self._ctx.memory.remove_buffer(f"prefetch {flat.name}")
        unit.gathered = True

    def _free(self, unit):
        unit.swap_out()
        if unit.gathered and (unit.sharded or unit.casts):   # else: `full` is the shard
            for flat in unit.flats:
                self._ctx.memory.include(flat.full)
                flat.full.untyped_storage().resize_(0)   # the parameter views stay valid
                self._ctx.memory.remove_buffer(f"gathered {flat.name}")
            unit.gathered = False

    # --- backward: reduce-scatter each flat as soon as all its gradients are in ---------------
    def _on_gradient(self, leaf):
        flat, e = leaf._labkit_slot
        if flat.bucket is None:   # zeros: padding and gradients that never come reduce 0
            self._new_bucket(flat)
        flat.view(e.slot, flat.bucket).copy_(leaf.grad)
        leaf.grad = None          # the full gradient lives only until its bucket is reduced
        flat.arrived.add(e.slot)
        if flat.complete:
            self._reduce(flat)

    def _new_bucket(self, flat):
        flat.bucket = torch.zeros_like(flat.full)
        self._ctx.memory.add_buffer(f"grad bucket {flat.name}", flat.bucket)

    def _reduce(self, flat):
        if flat.bucket is None:
            self._new_bucket(flat)
        reduce = self._ctx.comm.reduce_scatter if flat.sharded else self._ctx.comm.all_reduce
        self._pending.append((flat, reduce(flat.bucket, op="avg", group=self.group,
                                           async_op=True, tag=f"grads {flat.name}")))
        flat.issued = True
        unit = flat.unit
        # Free once every gradient is in; a unit with frozen weights waits for the end of
        # backward (a later backward op may still read them, e.g. y = (x * frozen) @ w).
        if unit.active == 0 and all(f.requires_grad and f.issued for f in unit.flats):
            self._free(unit)
        while len(self._pending) > IN_FLIGHT:
            self._land(*self._pending.pop(0))

    def _land(self, flat, handle):
        flat.reduced, flat.bucket = handle.wait(), None
        self._ctx.memory.remove_buffer(f"grad bucket {flat.name}")

    def finish_gradient_synchronization(self):
        """Reduce what backward did not complete, wait for every reduction, and leave each
        shard's averaged gradient in its `.grad` (same shape and dtype as the shard; added to
        a `.grad` already there). Runs by itself at the end of backward; calling again is free.
        """
        self._backward_started = False
        trainable = [f for f in reversed(self._flats) if f.requires_grad]
        if any(f.arrived or f.issued for f in trainable):
            for flat in trainable:   # the same order on every rank; zeros for what never came
                if not flat.issued:
                    self._reduce(flat)
            while self._pending:
                self._land(*self._pending.pop(0))
            for flat in trainable:
                grad = flat.reduced.to(flat.shard.dtype)
                if self.offload:
                    self._pcie(flat.reduced.nbytes, "offload: gradient shard to host")
                    grad = grad.to(flat.shard.device)
                for piece, view in zip(flat.pieces, flat.shard_views(grad)):
                    piece.grad = view if piece.grad is None else piece.grad.add_(view)
                flat.reduced, flat.issued = None, False
                flat.arrived.clear()
        for unit, sources in self._inflight.items():   # a prefetch nobody used still lands
            for flat, handle in zip(unit.flats, sources):
                handle.wait()
                self._ctx.memory.remove_buffer(f"prefetch {flat.name}")
        self._inflight = {}
        for unit in self._units:
            unit.active = 0
            self._free(unit)
        if self._seen:
            self._order, self._seen = self._seen, []

    def _pcie(self, nbytes, name):
        if self._ctx.clock.enabled:
            link = hardware.link(OFFLOAD_LINK)
            self._ctx.clock.advance(link.latency + nbytes / link.effective_bandwidth,
                                    kind="comm", name=f"{name} (PCIe, modelled)")

    # --- what the memory tracker counts, and the full weights ----------------------------------
    def _device_params(self):   # none under offload: the shards are in host memory
        return [] if self.offload else [f.shard for f in self._flats]

    def _device_grads(self):
        held = [leaf.grad for f in self._flats for leaf in f.leaves]
        held += [f.reduced for f in self._flats]
        return held + ([] if self.offload else [p.grad for f in self._flats for p in f.pieces])

    def host_bytes(self):
        """Bytes of the shards and their gradients in host memory (offload), measured."""
        grads = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                 for f in self._flats for p in f.pieces if p.grad is not None}
        return sum(f.shard.nbytes for f in self._flats) + sum(grads.values()) \
            if self.offload else 0

    def compute_parameters(self):
        """The full parameters modules compute with (views of the gathered buffers, one per
        original parameter): a hook meant for a whole parameter's gradient goes on these."""
        return [leaf for f in self._flats for leaf in f.leaves]

    @property
    def unit_numels(self):
        """Parameters per sharded flat buffer (a unit's trainable or frozen ones), unpadded."""
        return [f.numel for f in self._flats if f.sharded]

    @property
    def padded_numel(self):
        return sum(f.padded for f in self._flats if f.sharded)

    def full_state_dict(self):
        """{original name: the full parameter} gathered from every rank (off the record)."""
        return self._gathered(grads=False)

    def full_gradients(self):
        """{original name: the full averaged gradient} gathered from every rank (off the
        record): one device's `.grad`, zeros where none came (the self-check compares them)."""
        return self._gathered(grads=True)

    @torch.no_grad()
    def _gathered(self, grads):
        full = {}
        with self._ctx.off_the_record():
            for flat in self._flats:
                data = (self._shard_gradient(flat) if grads else flat.shard).to(flat.full.device)
                if flat.sharded:
                    data = self._ctx.comm.all_gather(data, group=self.group)
                for e in flat.entries:
                    full[e.piece] = flat.view(e.slot, data).clone()
        nested = {f"{prefix}.module.{name}": tensor   # each gathered over its own group
                  for prefix, inner in self._nested
                  for name, tensor in inner._gathered(grads).items()}
        return {name: nested[name] if name in nested else full[p]
                for name, p in self.module.named_parameters()}

    @staticmethod
    def _shard_gradient(flat):
        """This rank's shard of `flat`'s gradient, from its pieces' `.grad`."""
        shard = torch.zeros_like(flat.shard)
        for piece, view in zip(flat.pieces, flat.shard_views(shard)):
            if piece.grad is not None:
                view.copy_(piece.grad.reshape(view.shape))
        return shard

    def extra_repr(self):
        return (f"group={list(self.group.ranks)}, units={len(self._units)}, "
                f"compute_dtype={self.compute_dtype}, offload={self.offload}")


def _verify(module, group, reshard_after_forward, offload, units, prefetch):
    """The self-check (self_check.py): the same FullyShard (the same units, by name) over a
    miniature of `module`, each rank its own rows of the batch, against one device."""
    picked = None
    if units is not None:
        picked = {name for name, m in module.named_modules() if units(m)}

    def apply(mini):
        names = {id(m): name for name, m in mini.named_modules()}
        pick = None if picked is None else (lambda m: names.get(id(m)) in picked)
        return FullyShard(mini, group, None, reshard_after_forward, offload, pick,
                          prefetch=prefetch, verify=False)
    check_against_one_device(module, apply, group, what="FullyShard", batch=BATCH * group.size,
                             forward=batch_share_forward(
                                 lambda m: isinstance(m, FullyShard), group),
                             gradients=lambda sharded: sharded.full_gradients())

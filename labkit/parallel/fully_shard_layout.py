"""FullyShard's layout: units, their flat buffers and shards, and gathering on use.

A unit (`_Unit`) is a module whose parameters are sharded together; its parameters of one dtype
and requires_grad are packed into one flat buffer padded to a multiple of N (`_UnitFlat`, a
flat.py `FlatBuffer`), rank r keeping elements [r*S, (r+1)*S). `_make_units` assigns each
parameter to the nearest unit above its first holder (tied weights once). `_GatherOnUse` makes
every parameter a forward reads gathered, even one read without calling its module
(nn.MultiheadAttention's out_proj.weight). The idea and the byte counts: `fully_shard.py`.
"""
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .flat import FlatBuffer


class _Entry:
    """One original parameter: its slot in its flat buffer's layout, where modules hold it."""

    def __init__(self, param, unit):
        self.param, self.unit, self.slot = param, unit, None
        self.uses = []   # (module, attribute name)


class _UnitFlat(FlatBuffer):
    """A unit's parameters of one dtype and requires_grad: a FlatBuffer padded to a multiple
    of N that holds the layout only (meta tensors: each parameter's `slot`). `shard`: this
    rank's part of the buffer (what the optimizer steps; `pieces` are its views, one
    nn.Parameter per original parameter). `full`: the gathered buffer in the compute dtype, its
    storage freed between uses; `leaves` (views of it) are what modules compute with.
    `arrived`: the slots whose gradient is in this step's `bucket`.
    """

    def __init__(self, unit, entries, owner):
        group, first = owner.group, entries[0].param
        self.size = group.size if unit.sharded else 1
        self.rank = group.rank if unit.sharded else 0
        super().__init__([e.param.detach().to("meta") for e in entries], pad_to=self.size)
        self.unit, self.entries, self.sharded = unit, entries, unit.sharded
        self.requires_grad = first.requires_grad
        self.name = unit.name + ("" if self.requires_grad else " (frozen)")
        for e, slot in zip(entries, self.tensors):
            e.slot = slot
        whole = self.pack([e.param.detach() for e in entries], torch.zeros(
            self.padded, dtype=first.dtype, device=first.device))
        host = torch.device("cpu") if owner.offload else first.device
        self.shard = self.part(self.rank, self.size, whole).clone().to(host)   # fp32 masters
        if host != first.device:
            self.shard = self.shard.pin_memory()
        dtype = owner.compute_dtype or first.dtype
        unit.casts = unit.casts or dtype != first.dtype or owner.offload
        # replicated in the same dtype and place, `full` is the shard: nothing to gather
        self.full = whole.to(dtype) if self.sharded or unit.casts else self.shard
        self.pieces = [nn.Parameter(v, requires_grad=self.requires_grad)
                       for v in self.shard_views(self.shard)]
        self.leaves = []
        for e, piece in zip(entries, self.pieces):
            leaf = nn.Parameter(torch.empty(0, dtype=dtype, device=self.full.device),
                                requires_grad=self.requires_grad)
            # `.data =` keeps the leaf's own version counter: refilling `full` in place
            # later does not look, to autograd, like a change of a tensor saved for backward
            leaf.data = self.view(e.slot, self.full)
            leaf._labkit_slot = (self, e)
            if self.requires_grad:
                leaf.register_post_accumulate_grad_hook(owner._on_gradient)
            e.piece, e.leaf, e.param = piece, leaf, None   # the full original tensor goes
            self.leaves.append(leaf)
        if self.full is not self.shard:
            self.full.untyped_storage().resize_(0)
        self.bucket = self.reduced = None
        self.issued = False

    def shard_views(self, shard):
        """Each original parameter's part of `shard` (1-D; whole-shaped when replicated)."""
        if not self.sharded:
            return self.views(shard)
        return self.part_views(self.rank, self.size, shard)


class _Unit:
    def __init__(self, name, module, sharded):
        self.name, self.module, self.sharded = name, module, sharded
        self.entries, self.flats, self.needs = [], [], [self]
        self.active, self.gathered, self.casts = 0, False, False

    def swap_in(self):    # modules compute with the full weights...
        for e in self.entries:
            for module, attr in e.uses:
                module._parameters[attr] = e.leaf

    def swap_out(self):   # ...and show the shards otherwise
        for e in self.entries:
            for module, attr in e.uses:
                module._parameters[attr] = e.piece


def _make_units(root, pick, owner, skip=()):
    """Units in pre-order; a parameter belongs to the nearest unit above its first holder,
    or to the replicated pseudo-unit (hooked on the root) when no unit is above it. `skip`:
    ids of modules a nested FullyShard owns (sharded over its own group)."""
    replicated = _Unit("replicated", root, sharded=False)
    units, entry_of, region = [replicated], {}, {}
    for name, module in root.named_modules():
        if id(module) in skip:
            continue
        unit = region.get(module, replicated)
        if pick(module):
            unit = _Unit(name or "root", module, sharded=True)
            units.append(unit)
        for child in module.children():
            region.setdefault(child, unit)
        for attr, p in module.named_parameters(recurse=False):
            if p not in entry_of:
                entry_of[p] = _Entry(p, unit)
                unit.entries.append(entry_of[p])
            entry_of[p].uses.append((module, attr))
            if entry_of[p].unit not in unit.needs:   # a tied weight another unit owns
                unit.needs.append(entry_of[p].unit)
    for unit in units:
        kinds = {}
        for e in unit.entries:
            kinds.setdefault((e.param.requires_grad, e.param.dtype), []).append(e)
        for entries in kinds.values():
            unit.flats.append(_UnitFlat(unit, entries, owner))
        unit.swap_out()
    return [u for u in units if u.flats or len(u.needs) > 1]


class _GatherOnUse(TorchFunctionMode):
    """While the wrapped module runs: a shard reaching an op (a forward that reads a child's
    parameter directly) becomes its gathered full parameter, and the op's outputs gather that
    unit again before their backward (which reads the full parameter)."""

    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.owner._in_hook or getattr(getattr(func, "__self__", None), "__name__", "") \
                in ("grad", "_grad"):   # bookkeeping (the shard's own .grad), not compute
            return func(*args, **kwargs)
        used = []

        def full(t):
            entry = self.owner._entry_of_piece.get(id(t))
            if entry is None:
                return t
            used.append(entry.unit)
            return self.owner._borrow(entry)

        args, kwargs = _map_tensors((args, kwargs), full)
        out = func(*args, **kwargs)
        if used and torch.is_grad_enabled():
            units = list(dict.fromkeys(used))
            out = copy_views_of(units, out)
            for unit in units:
                gather_before_backward(self.owner, unit, out)
        return out


def copy_views_of(units, value):
    """`value` with each tensor that is a view of `units`' gathered buffers copied. Such a view
    (`conv.weight.squeeze(1)` read by a parent; a parameter a module returns, as GPT-NeoX-
    Japanese's attention returns its dense_bias) outlives the buffer, which is freed after the
    forward: a later op reading it, or saving it for a backward that runs before the unit is
    gathered again, would find no storage. The copy holds its bytes until then."""
    held = {f.full.untyped_storage().data_ptr() for u in units for f in u.flats}
    aliases = [t for t in _each_tensor(value) if t.untyped_storage().data_ptr() in held]
    if not aliases:
        return value
    return _map_tensors(value, lambda t: t.clone() if t.untyped_storage().data_ptr() in held
                        else t)


def gather_before_backward(owner, unit, value):
    """Have `unit`'s weights gathered again as soon as backward reaches any tensor of `value`
    (a hook on each, as PyTorch's fully_shard does). A hook adds no autograd node: a forward
    that then modifies such a tensor in place (Falcon's `mlp_output += attention_output`)
    stays legal, which the output of an identity autograd.Function (a view) would not be."""
    for t in _each_tensor(value):
        if t.requires_grad:
            t.register_hook(lambda _grad: owner._pre_backward(unit))


def _each_tensor(value):
    """The tensors in nested tuples, lists and dicts (ModelOutput included), in order."""
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _each_tensor(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _each_tensor(v)
    elif isinstance(value, torch.Tensor):
        yield value


def _map_tensors(value, fn):
    """`fn` on every tensor in nested tuples, lists and dicts (a module's inputs), each
    container rebuilt as its own type where it can be (a ModelOutput stays one)."""
    if isinstance(value, (tuple, list)):
        mapped = [_map_tensors(v, fn) for v in value]
        return type(value)(mapped) if type(value) in (tuple, list) else _rebuilt(value, mapped)
    if isinstance(value, dict):
        mapped = {k: _map_tensors(v, fn) for k, v in value.items()}
        return mapped if type(value) is dict else _rebuilt(value, mapped)
    return fn(value) if isinstance(value, torch.Tensor) else value


def _rebuilt(value, mapped):
    """A tuple/list/dict subclass (namedtuple, ModelOutput) with `mapped` as its items."""
    try:
        return type(value)(*mapped) if isinstance(mapped, list) else type(value)(**mapped)
    except TypeError:
        return type(value)(mapped)

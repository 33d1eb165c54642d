"""Bytes on this rank by category (params, grads, optimizer, activations, buffers) and the peak.

Measured from the tensors that exist, not from formulas: each category is a function returning
tensors, counted by unique storage (two views of one buffer count once). Activations are what
autograd saves for backward, seen through `torch.autograd.graph.saved_tensors_hooks`. On a GPU
the CUDA allocator's own peak is reported beside ours.

The peak is checked whenever autograd saves a tensor (forward) and whenever backward takes one
back, which is often (about once per op), so that check is kept cheap: the gradients' bytes are
recounted only when they can have changed (gradients change in backward, not between two saves
of one forward; a backward node takes all its saved tensors back before it computes), and a
tensor's storage size is remembered while the tensor and its data pointer stay the same.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from . import torch_compat

TensorSource = Callable[[], Iterable[torch.Tensor]]   # a category's source: returns its tensors

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


def storage_bytes(tensors, exclude=()):
    """Bytes of the distinct storages behind `tensors` (skipping storages in `exclude`)."""
    seen, total = set(exclude), 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer):
    """The per-parameter state tensors (Adam's moments, momentum); step counters are left out:
    they are one scalar per parameter tensor, not per parameter."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                yield value


class _Saved:
    """A tensor autograd keeps for backward; when autograd drops it, the tracker hears."""
    __slots__ = ("tensor", "tracker", "key")

    def __init__(self, tensor, tracker, key):
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self):
        self.tracker._release(self.key)


class _Sizes:
    """Storage bytes of tensors, remembered per tensor while its data pointer is unchanged
    (asking a tensor for its storage costs more than the rest of the count)."""
    LIMIT = 20_000   # forget everything past this many tensors (dead ones pile up)

    def __init__(self):
        self.known = {}   # id(tensor) -> (weak ref, data pointer, storage pointer, bytes)

    def total(self, tensors, exclude=()):
        """What `storage_bytes(tensors, exclude)` returns."""
        known, seen, total = self.known, set(exclude), 0
        if len(known) > self.LIMIT:
            known.clear()
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            entry = known.get(id(t))
            pointer = t.data_ptr()
            if entry is None or entry[1] != pointer or entry[0]() is not t:
                storage = t.untyped_storage()
                entry = known[id(t)] = (weakref.ref(t), pointer, storage.data_ptr(),
                                        storage.nbytes())
            key = entry[2]
            if key == 0 or key in seen:
                continue
            seen.add(key)
            total += entry[3]
        return total


class _ModelTensors:
    """`model.parameters()` and their `.grad`, from a list of the parameters kept between two
    samples (walking the module tree is most of the cost of a count; the tracker forgets the
    list at each sample, so a parameter added or replaced in a module is found at the next)."""

    def __init__(self, model):
        self.model, self.params_seen = model, None

    def forget(self):
        self.params_seen = None

    def params(self):
        if self.params_seen is None:
            modules = _modules_of(self.model)
            if modules is False:                # a module that lists itself differently
                return list(self.model.parameters())
            unique = {id(p): p for module in modules for p in module._parameters.values()
                      if p is not None}
            self.params_seen = list(unique.values())
        return self.params_seen

    def grads(self):
        return [p.grad for p in self.params()]


def _modules_of(model):
    """Every module under `model` once (what `named_modules` walks), or False when one of
    them overrides how modules or parameters are listed."""
    if not all(getattr(type(model), name) is getattr(nn.Module, name)
               for name in ("parameters", "named_parameters", "_named_members")):
        return False
    seen, out, stack = set(), [], [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        if type(module).named_modules is not nn.Module.named_modules:
            return False
        seen.add(id(module))
        out.append(module)
        stack.extend(m for m in module._modules.values() if m is not None)
    return out


class MemoryTracker:
    def __init__(self, ctx=None) -> None:   # ctx: the rank's Context (runtime.context)
        self.ctx = ctx
        self.sources = {c: (lambda: ()) for c in CATEGORIES if c != "activations"}
        self.buffers = {}          # name -> tensor: transient buffers (gathered weights, comm)
        self.saved = {}            # storage key -> [bytes, how many saved tensors use it]
        self.saved_bytes = 0       # activations saved for backward right now
        self.max_saved_bytes = 0   # the most saved at once
        self.peak = 0
        self.peak_phase = ""
        self.samples = []          # (phase, {category: bytes})
        self.sources["buffers"] = lambda: self.buffers.values()
        self._static = 0           # params + optimizer + buffers at the last sample
        self._exclude = set()
        self._sizes = _Sizes()
        self._models = []          # _ModelTensors of watched models (their module lists)
        self._grads = None         # gradient bytes when last counted ...
        self._grads_node = None    # ... inside this backward node (None: outside backward)
        self._grads_seen = None    # ... for these gradient tensors

    # --- what to count ----------------------------------------------------------------------
    def watch(self, model: nn.Module | None = None,
              optimizer: torch.optim.Optimizer | None = None, params: TensorSource | None = None,
              grads: TensorSource | None = None,
              optimizer_state: TensorSource | None = None) -> MemoryTracker:
        """Say where each category lives. Defaults: the model's parameters and their .grad,
        the optimizer's state. Pass functions returning tensors for sharded layouts."""
        if model is not None:
            tensors = _ModelTensors(model)
            self._models.append(tensors)
            params, grads = params or tensors.params, grads or tensors.grads
        if optimizer is not None:
            optimizer_state = optimizer_state or (lambda: optimizer_state_tensors(optimizer))
        for name, fn in (("params", params), ("grads", grads), ("optimizer", optimizer_state)):
            if fn is not None:
                self.sources[name] = fn
        self._forget_grads()
        return self

    def add_buffer(self, name: str, tensor: torch.Tensor) -> None:
        """A transient tensor that is neither a parameter nor an activation (counted in peak)."""
        self.buffers[name] = tensor
        self.sample(f"+{name}")

    def remove_buffer(self, name: str) -> None:
        self.buffers.pop(name, None)
        self.sample(f"-{name}")

    def exclude(self, tensor: torch.Tensor) -> None:
        """Do not count `tensor`'s storage as an activation when autograd saves it (e.g. a
        weight gathered after tracking started: it is counted as a parameter or buffer)."""
        self._exclude.add(tensor.untyped_storage().data_ptr())

    def include(self, tensor: torch.Tensor) -> None:
        """Undo `exclude` (the storage may be reused for something else later)."""
        self._exclude.discard(tensor.untyped_storage().data_ptr())

    # --- activations ---------------------------------------------------------------------------
    @contextmanager
    def track_activations(self) -> Iterator[MemoryTracker]:
        """Count what autograd saves for backward (run forward *and* backward inside)."""
        self._exclude = {t.untyped_storage().data_ptr() for t in self.sources["params"]()}
        self._exclude |= {t.untyped_storage().data_ptr() for t in self.buffers.values()}
        self.sample("before forward")
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._forget_grads()   # and hold no backward node past here

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._exclude:
            return tensor
        entry = self.saved.get(key)
        if entry is None:
            entry = self.saved[key] = [storage.nbytes(), 0]
            self.saved_bytes += entry[0]
            if self.saved_bytes > self.max_saved_bytes:
                self.max_saved_bytes = self.saved_bytes
            self._update_peak("forward")
        entry[1] += 1
        return _Saved(tensor, self, key)

    def _unpack(self, box):
        if isinstance(box, _Saved):
            self._update_peak("backward")
            return box.tensor
        return box

    def _release(self, key):
        entry = self.saved.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.saved_bytes -= entry[0]
            del self.saved[key]

    # --- snapshots and the peak ------------------------------------------------------------------
    def snapshot(self) -> dict[str, int]:
        """Bytes by category right now."""
        out = {c: self._sizes.total(self.sources[c]()) for c in CATEGORIES
               if c != "activations"}
        out["activations"] = self.saved_bytes
        return out

    def sample(self, phase: str = "") -> dict[str, int]:
        """Record a snapshot (call at the phase boundaries of a step) and update the peak."""
        for model in self._models:
            model.forget()
        snap = self.snapshot()
        self._forget_grads()
        self._grads = snap["grads"]
        self._static = snap["params"] + snap["optimizer"] + snap["buffers"]
        total = self._static + snap["grads"] + snap["activations"]
        self.samples.append((phase, snap))
        if total > self.peak:
            self.peak, self.peak_phase = total, phase
        return snap

    def _forget_grads(self):
        self._grads = self._grads_node = self._grads_seen = None

    def _update_peak(self, phase):
        node = torch_compat.current_autograd_node()   # None outside backward
        if self._grads is None or node is not self._grads_node:
            grads = list(self.sources["grads"]())
            # The same tensors at the same addresses (ids and data pointers, so that no
            # tensor is kept alive here): the same bytes, no need to count them again.
            seen = (list(map(id, grads)), [g.data_ptr() for g in grads if g is not None])
            if self._grads is None or seen != self._grads_seen:
                self._grads = self._sizes.total(grads)
            self._grads_node, self._grads_seen = node, seen
        total = self._static + self._grads + self.saved_bytes
        if total > self.peak:
            self.peak, self.peak_phase = total, phase

    def reset_peak(self) -> None:
        self.peak, self.max_saved_bytes = 0, self.saved_bytes
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def report(self) -> dict:
        """The run report's memory entry: steady state now, most activations, peak (bytes)."""
        snap = self.sample("report")
        out = dict(params=snap["params"], grads=snap["grads"], optimizer=snap["optimizer"],
                   activations=self.max_saved_bytes, buffers=snap["buffers"], peak=self.peak,
                   peak_phase=self.peak_phase)
        if self.ctx is not None and self.ctx.device.type == "cuda":
            out["peak_allocator"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return out


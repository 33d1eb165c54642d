"""Bytes on this rank by category (params, grads, optimizer, activations, buffers) and the peak.

Measured from the tensors that exist, not from formulas: each category is a function returning
tensors, counted by unique storage (two views of one buffer count once). Activations are what
autograd saves for backward, seen through `torch.autograd.graph.saved_tensors_hooks`. On a GPU
the CUDA allocator's own peak is reported beside ours.
"""
import weakref
from contextlib import contextmanager

import torch

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
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


class MemoryTracker:
    def __init__(self, ctx=None):
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

    # --- what to count ----------------------------------------------------------------------
    def watch(self, model=None, optimizer=None, params=None, grads=None, optimizer_state=None):
        """Say where each category lives. Defaults: the model's parameters and their .grad,
        the optimizer's state. Pass functions returning tensors for sharded layouts."""
        if model is not None:
            params = params or (lambda: list(model.parameters()))
            grads = grads or (lambda: [p.grad for p in model.parameters()])
        if optimizer is not None:
            optimizer_state = optimizer_state or (lambda: optimizer_state_tensors(optimizer))
        for name, fn in (("params", params), ("grads", grads), ("optimizer", optimizer_state)):
            if fn is not None:
                self.sources[name] = fn
        return self

    def add_buffer(self, name, tensor):
        """A transient tensor that is neither a parameter nor an activation (counted in peak)."""
        self.buffers[name] = tensor
        self.sample(f"+{name}")

    def remove_buffer(self, name):
        self.buffers.pop(name, None)
        self.sample(f"-{name}")

    def exclude(self, tensor):
        """Do not count `tensor`'s storage as an activation when autograd saves it (e.g. a
        weight gathered after tracking started: it is counted as a parameter or buffer)."""
        self._exclude.add(tensor.untyped_storage().data_ptr())

    def include(self, tensor):
        """Undo `exclude` (the storage may be reused for something else later)."""
        self._exclude.discard(tensor.untyped_storage().data_ptr())

    # --- activations ---------------------------------------------------------------------------
    @contextmanager
    def track_activations(self):
        """Count what autograd saves for backward (run forward *and* backward inside)."""
        self._exclude = {t.untyped_storage().data_ptr() for t in self.sources["params"]()}
        self._exclude |= {t.untyped_storage().data_ptr() for t in self.buffers.values()}
        self.sample("before forward")
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

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
        box = _Saved(tensor)
        weakref.finalize(box, self._release, key)
        return box

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
    def snapshot(self):
        """Bytes by category right now."""
        out = {c: storage_bytes(self.sources[c]()) for c in CATEGORIES if c != "activations"}
        out["activations"] = self.saved_bytes
        return out

    def sample(self, phase=""):
        """Record a snapshot (call at the phase boundaries of a step) and update the peak."""
        snap = self.snapshot()
        self._static = snap["params"] + snap["optimizer"] + snap["buffers"]
        total = self._static + snap["grads"] + snap["activations"]
        self.samples.append((phase, snap))
        if total > self.peak:
            self.peak, self.peak_phase = total, phase
        return snap

    def _update_peak(self, phase):
        total = self._static + storage_bytes(self.sources["grads"]()) + self.saved_bytes
        if total > self.peak:
            self.peak, self.peak_phase = total, phase

    def reset_peak(self):
        self.peak, self.max_saved_bytes = 0, self.saved_bytes
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def report(self):
        """The run report's memory entry: steady state now, most activations, peak (bytes)."""
        snap = self.sample("report")
        out = dict(params=snap["params"], grads=snap["grads"], optimizer=snap["optimizer"],
                   activations=self.max_saved_bytes, buffers=snap["buffers"], peak=self.peak,
                   peak_phase=self.peak_phase)
        if self.ctx is not None and self.ctx.device.type == "cuda":
            out["peak_allocator"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return out

"""Counting the FLOPs a compute region runs, as PyTorch's FlopCounterMode counts them.

The clock turns FLOPs into modelled seconds, so every op run inside `ctx.clock.compute(...)` is
seen here: a TorchDispatchMode gets each op, runs it, and adds the FLOPs of those that have a
formula in `torch.utils.flop_counter.flop_registry` (mm, addmm, bmm, baddbmm, convolutions,
attention kernels; everything else counts 0), decomposing the others first when they can be,
as FlopCounterMode does: the totals are the same (tests/test_runtime.py checks them against it).
One addition: torch's formulas cover the GPU attention kernels but not the CPU's
(`_scaled_dot_product_flash_attention_for_cpu` and its backward), which FlopCounterMode counts
as 0; here they count what torch counts for the GPU kernels (2 matmuls forward, 5 backward).

What costs is that every op makes a round trip through Python (a few microseconds), so:
- no per-module bookkeeping (FlopCounterMode tracks the module tree with hooks), ops looked up
  by id, a formula's answer remembered for the shapes it saw;
- the step of one of torch.optim's own optimizers (SGD, Adam, AdamW, ...; no closure, no step
  hooks) runs outside the counter: their updates are elementwise, which no formula counts, so
  the count is the same without the round trip of each of their many small ops.
The private torch names this needs are looked up in runtime/torch_compat.py; without them the
count is FlopCounterMode's own (the same totals, slower).
"""
import torch
from torch.utils.flop_counter import (FlopCounterMode, flop_registry, sdpa_backward_flop_count,
                                      sdpa_flop_count, shape_wrapper)

from . import torch_compat

# Ops are looked up by id (an OpOverload hashes in Python, slowly; ops live as long as the process).
_PLAIN = {}      # id(op) -> its kernel: an op with no FLOP formula and no decomposition
_FORMULAS = {}   # id(op) -> its FLOP formula
_COUNTS = {}     # (op, shapes and plain arguments) -> the FLOPs its formula answered
_MAX_COUNTS = 50_000


def _cpu_attention(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _cpu_formulas():
    """The CPU attention kernels' formulas (on shapes), where this torch has those kernels."""
    aten = torch.ops.aten
    names = {"_scaled_dot_product_flash_attention_for_cpu": _cpu_attention,
             "_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_attention_backward}
    return {getattr(aten, n): f for n, f in names.items() if hasattr(aten, n)}


_CPU_SHAPE_FORMULAS = _cpu_formulas()   # FlopCounterMode's custom_mapping wraps them itself
_CPU_FORMULAS = {op: shape_wrapper(f) for op, f in _CPU_SHAPE_FORMULAS.items()}


class _FlopCounter(torch_compat.dispatch_mode_class() or object):
    """FlopCounterMode's count, without its per-module bookkeeping.

    Every op that reaches the dispatcher passes through here (that is what costs); ops with a
    formula in `torch.utils.flop_counter.flop_registry` add their FLOPs, ops without one are
    decomposed first when they can be, exactly as FlopCounterMode does, so the totals are the
    same. A formula sees only shapes and plain arguments, so its answer is remembered for them.
    Higher-order operators (torch.cond, flex attention) are handed to FlopCounterMode.
    """
    supports_higher_order_operators = True
    _ignored = None

    @classmethod
    def _should_skip_dynamo(cls):
        return False    # no torch.compile guard around each call: this runs on every op

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        run = _PLAIN.get(id(func))
        if run is not None:
            return run(*args, **kwargs) if kwargs else run(*args)
        kwargs = kwargs or {}
        formula = _FORMULAS.get(id(func))
        if formula is None:
            if torch_compat.is_higher_order_op(func):
                with FlopCounterMode(display=False) as counter:
                    out = func(*args, **kwargs)
                self.flops += counter.get_total_flops()
                return out
            if func in _ignored_ops():   # FlopCounterMode leaves these to tensor subclasses
                return NotImplemented
            formula = (flop_registry.get(func._overloadpacket)
                           or _CPU_FORMULAS.get(func._overloadpacket))
            if formula is None:
                decomposes = (func is not torch.ops.prim.device.default
                              and torch_compat.has_composite_implicit(func))
                if decomposes is not False:   # True, or None: this torch cannot tell, try
                    with self:
                        out = func.decompose(*args, **kwargs)
                    if out is not NotImplemented:
                        return out
                if decomposes is not True:
                    _PLAIN[id(func)] = func._op
                return func(*args, **kwargs)
            _FORMULAS[id(func)] = formula
        out = func(*args, **kwargs)
        self.flops += _count(func, formula, args, kwargs, out)
        return out


def _count(func, formula, args, kwargs, out):
    """`formula(*args, **kwargs, out_val=out)`, as FlopCounterMode calls it, remembered for the
    shapes and plain arguments it saw (a formula wrapped by flop_counter's shape_wrapper sees
    nothing else); nested arguments or a formula that wants tensors are counted every time."""
    key = _shapes_key(func, formula, args, kwargs, out)
    flops = _COUNTS.get(key) if key is not None else None
    if flops is None:
        flops = formula(*args, **kwargs, out_val=out)
        if key is not None:
            if len(_COUNTS) > _MAX_COUNTS:
                _COUNTS.clear()
            _COUNTS[key] = flops
    return flops


def _shapes_key(func, formula, args, kwargs, out):
    if getattr(formula, "__wrapped__", None) is None:   # registered with get_raw=True
        return None
    key = [id(func)]
    for a in (*args, *kwargs.values(), out):
        if isinstance(a, torch.Tensor):
            key.append(a.shape)
        elif isinstance(a, (int, float, bool, str, type(None), torch.dtype)):
            key.append(a)
        elif isinstance(a, (list, tuple)) and all(
                isinstance(x, (int, float, bool, type(None))) for x in a):
            key.append(tuple(a))
        elif type(a) in (list, tuple) and all(isinstance(x, torch.Tensor) for x in a):
            key.append(tuple(x.shape for x in a))   # e.g. the tuple convolution_backward returns
        else:
            return None
    key.append(tuple(kwargs))
    return tuple(key)


def _ignored_ops():
    if _FlopCounter._ignored is None:
        aten, prim = torch.ops.aten, torch.ops.prim
        _FlopCounter._ignored = {
            aten.sym_is_contiguous.default, aten.is_contiguous.default,
            aten.is_contiguous.memory_format, aten.is_strides_like_format.default,
            aten.is_non_overlapping_and_dense.default, aten.size.default,
            aten.sym_size.default, aten.stride.default, aten.sym_stride.default,
            aten.storage_offset.default, aten.sym_storage_offset.default, aten.numel.default,
            aten.sym_numel.default, aten.dim.default, prim.layout.default}
    return _FlopCounter._ignored


# --- regions: start and stop a counter; optimizer steps outside it ------------------------------
_active = None      # the counter of the compute region open now (one per process)
_suspended = None   # that counter while an elementwise optimizer steps outside it
_hooks = None       # torch.optim's global step hooks, installed on first use
_optimizer_classes = set()
ELEMENTWISE_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam",
                          "RAdam", "RMSprop", "Rprop", "ASGD")


class _PublicCounter:
    """The fallback where this torch has no TorchDispatchMode for labkit: the public
    FlopCounterMode (with the CPU attention formulas), read as `.flops` like _FlopCounter."""

    def __init__(self):
        self.mode = FlopCounterMode(display=False, custom_mapping=_CPU_SHAPE_FORMULAS)

    @property
    def flops(self):
        return self.mode.get_total_flops()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def start_counting():
    """A counter for a compute region, counting from now."""
    global _active
    _install_optimizer_hooks()
    public = torch_compat.dispatch_mode_class() is None
    counter = _PublicCounter() if public else _FlopCounter()
    counter.__enter__()
    _active = counter
    return counter


def stop_counting(counter, exc=(None, None, None)):
    global _active, _suspended
    _active = None
    if _suspended is counter:   # an optimizer step raised: the counter is already out
        _suspended = None
        return
    counter.__exit__(*exc)


def _install_optimizer_hooks():
    global _hooks, _optimizer_classes
    if _hooks is not None:
        return
    from torch.optim import optimizer
    _optimizer_classes = {getattr(torch.optim, name) for name in ELEMENTWISE_OPTIMIZERS
                          if hasattr(torch.optim, name)}
    _hooks = (optimizer.register_optimizer_step_pre_hook(_before_step),
              optimizer.register_optimizer_step_post_hook(_after_step))


def _before_step(optimizer, args, kwargs):
    """Take the counter off while one of torch.optim's own optimizers steps, when nothing else
    runs in that step: no closure (it would run forward and backward), no step hooks."""
    global _suspended
    counter = _active
    if (counter is None or type(optimizer) not in _optimizer_classes or len(args) > 1 or kwargs
            or torch_compat.current_dispatch_mode() is not counter
            or not _only_our_hooks(optimizer)):
        return None
    counter.__exit__(None, None, None)
    _suspended = counter
    return None


def _after_step(optimizer, args, kwargs):
    global _suspended
    counter, _suspended = _suspended, None
    if counter is not None:
        counter.__enter__()


def _only_our_hooks(optimizer):
    hooks = torch_compat.optimizer_global_hooks()
    if hooks is None:
        return False
    pre, post = hooks
    return (len(pre) == 1 and len(post) == 1
            and not getattr(optimizer, "_optimizer_step_pre_hooks", True)
            and not getattr(optimizer, "_optimizer_step_post_hooks", True))

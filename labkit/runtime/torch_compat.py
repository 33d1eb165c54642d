"""The one place labkit touches PyTorch's private API: each use behind a guard with a fallback.

Why: a learner arrives with the torch their hub has. labkit needs a few things torch has only
under private names, which a torch release may rename or drop; each is looked up here, once,
by name, and where it is missing labkit takes the public route (same answer, slower) or, where
there is none, says in one line what is lost. So labkit declares a range of torch versions (the
ones its tests ran on: pyproject.toml) instead of one exact version, and a torch outside that
range still imports and runs, with the warnings below.

guard                         private API                         without it
dispatch_mode_class()         torch.utils._python_dispatch        FLOPs counted by the public
                              .TorchDispatchMode                  FlopCounterMode (same count,
                                                                  slower: per-module hooks)
current_dispatch_mode()       ..._get_current_dispatch_mode       optimizer steps are counted
                                                                  inside the region (same count)
is_higher_order_op(op)        torch._ops.HigherOrderOperator      told apart by having no ATen
                                                                  overload packet
has_composite_implicit(op)    torch._C.DispatchKey, torch._C      None: "try op.decompose()"
                              ._dispatch_has_kernel_for_...        (same count)
current_autograd_node()       torch._C._current_autograd_node     a new token every call: the
                                                                  peak check recounts (same peak)
queue_callback(fn)            Variable._execution_engine          warns: gradient sync must be
                              .queue_callback                     finished by hand after backward
pipelining_backward()         torch.distributed.pipelining        (None, None): B by autograd.grad,
                              ._backward                          W by a second walk (same grads)
pipeline_actions(...)         a torch schedule's private order    None: torch's order is not read
optimizer_global_hooks()      torch.optim.optimizer._global_...   None: optimizer steps counted
                                                                  inside the region (same count)

Not guarded, because nothing breaks: runtime/processes.py names torch._dynamo as a module for
the forkserver to preload (it skips one it cannot import), and runtime/comm.py takes the older
public collective names where the newer ones are missing.

Each name is looked up once, when this module is imported (the ones in hot paths), or when
asked for; tests/test_torch_compat.py checks that a name torch lacks is looked up as None, and
with each name taken away, that its fallback gives the right answer.
"""
import importlib
import itertools
import warnings

import torch


def _lookup(module, *names):
    """`module.names[0].names[1]...`, or None when the module or any name is missing."""
    try:
        value = importlib.import_module(module)
    except ImportError:
        return None
    for name in names:
        value = getattr(value, name, None)
        if value is None:
            return None
    return value


def _say_once(key, message):
    if key not in _SAID:
        _SAID.add(key)
        warnings.warn(f"labkit on torch {torch.__version__}: {message}", RuntimeWarning,
                      stacklevel=3)


_SAID = set()

# --- FLOP counting (runtime/flops.py) -----------------------------------------------------------
_DISPATCH_MODE = _lookup("torch.utils._python_dispatch", "TorchDispatchMode")
_CURRENT_MODE = _lookup("torch.utils._python_dispatch", "_get_current_dispatch_mode")
_HIGHER_ORDER = _lookup("torch._ops", "HigherOrderOperator")
_COMPOSITE_KEY = _lookup("torch._C", "DispatchKey", "CompositeImplicitAutograd")
_HAS_KERNEL = _lookup("torch._C", "_dispatch_has_kernel_for_dispatch_key")


def dispatch_mode_class():
    """torch's TorchDispatchMode (the base of labkit's fast FLOP counter), or None."""
    if _DISPATCH_MODE is None:
        _say_once("dispatch", "no TorchDispatchMode; FLOPs are counted by the public "
                              "FlopCounterMode instead (the same count, slower)")
    return _DISPATCH_MODE


def current_dispatch_mode():
    """The innermost dispatch mode now, or None when this torch cannot tell."""
    return _CURRENT_MODE() if _CURRENT_MODE is not None else None


def is_higher_order_op(func):
    """Whether `func`, met in __torch_dispatch__, is a higher-order operator (torch.cond, flex
    attention) rather than an ATen op. Without torch's class: an ATen OpOverload carries its
    overload packet, a higher-order operator does not."""
    if _HIGHER_ORDER is not None:
        return isinstance(func, _HIGHER_ORDER)
    return not hasattr(func, "_overloadpacket")


def has_composite_implicit(func):
    """Whether `func` has a CompositeImplicitAutograd kernel (so FlopCounterMode decomposes it);
    None when this torch cannot tell: then the caller tries `func.decompose`, which answers
    NotImplemented for an op that has none."""
    if _COMPOSITE_KEY is None or _HAS_KERNEL is None:
        return None
    return _COMPOSITE_KEY in func.py_kernels or _HAS_KERNEL(func.name(), _COMPOSITE_KEY)


def optimizer_global_hooks():
    """torch.optim's global step (pre, post) hooks, or None when this torch keeps them
    elsewhere (then labkit cannot tell that only its own hooks run in a step)."""
    pre = _lookup("torch.optim.optimizer", "_global_optimizer_pre_hooks")
    post = _lookup("torch.optim.optimizer", "_global_optimizer_post_hooks")
    return None if pre is None or post is None else (pre, post)


# --- memory (runtime/memory.py) ------------------------------------------------------------------
_CURRENT_NODE = _lookup("torch._C", "_current_autograd_node")
_TOKENS = itertools.count()


def current_autograd_node():
    """The autograd node running now (None outside backward). Without torch's: a new token at
    every call, i.e. "maybe another node", so a caller that skips work while the node stays the
    same never skips (the same answer, more work)."""
    if _CURRENT_NODE is not None:
        return _CURRENT_NODE()
    return next(_TOKENS)


# --- the end of backward (parallel/data_parallel.py, parallel/fully_shard.py) -------------------
_ENGINE = _lookup("torch.autograd", "Variable", "_execution_engine")


def queue_callback(fn):
    """Run `fn` when the autograd engine finishes the backward running now (as DDP and FSDP do).
    Returns whether it was queued; without torch's engine callback it is not, and the warning
    says so: gradient-syncing wrappers then finish only when
    `finish_gradient_synchronization()` is called after backward."""
    queue = getattr(_ENGINE, "queue_callback", None)
    if queue is None:
        _say_once("callback", "no autograd end-of-backward callback; call "
                              "finish_gradient_synchronization() after each backward yourself")
        return False
    queue(fn)
    return True


# --- pipelining (parallel/zero_bubble.py) -------------------------------------------------------

def pipelining_backward():
    """torch's split backward (stage_backward_input, stage_backward_weight), or (None, None)."""
    split = (_lookup("torch.distributed.pipelining._backward", "stage_backward_input"),
             _lookup("torch.distributed.pipelining._backward", "stage_backward_weight"))
    return split if None not in split else (None, None)


def pipeline_actions(kind, stages, microbatches):
    """torch's order for the V schedule class `kind` (two stages per rank): per rank its
    actions, computed as each rank does at construction but with no stages or process group
    (the private `_calculate_single_rank_operations` on an unconstructed instance); None when
    this torch computes it otherwise."""
    if not hasattr(kind, "_calculate_single_rank_operations"):
        return None
    schedule = object.__new__(kind)              # no stages, no group: the order only
    schedule.pp_group_size, schedule._n_microbatches = stages, microbatches
    schedule.num_stages = schedule._num_stages = 2 * stages
    try:
        return [[a for a in schedule._calculate_single_rank_operations(rank) if a is not None]
                for rank in range(stages)]
    except AttributeError:   # it reads a private field this function does not set
        return None

"""Selective activation recompute: keep every activation but the attention core's, and run the
core again in backward (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2).

The idea. Per layer and micro-batch a transformer keeps sbh (34 + 5 a s / h) bytes for backward
(16-bit values, dropout; Korthikanti Table 2; s tokens, b sequences, h hidden, a heads): 34 sbh
of inputs to its linear layers, norms and masks, and 5 a s^2 b of the attention core
softmax(Q K^T / sqrt(d)) V: its scores, softmax, dropout mask and output. That second part grows
with s^2 yet costs few FLOPs to rebuild (the core's 4 b s^2 h of the layer's 24 b s h^2 +
4 b s^2 h forward), so recomputing the core alone keeps

    34 sbh per layer  (sbh (10 + 24/t) under TP t; 34 sbh / t with sequence parallelism),

where full recompute keeps only the layer's input, 2 sbh, and runs its whole forward again
(`PipelineSchedule(recompute=True)`, Megatron-LM's `--recompute-granularity full`; this is
`--recompute-granularity selective`). theory/recompute.py prices both for the planner.

How. While a given attention layer runs (its hooks enter a ModuleScopedMode, scoped_mode.py,
the switch ContextParallel's router uses too: nothing is patched), each call of its core,
labkit's overridable `models.causal_attention` or F.scaled_dot_product_attention, runs as
torch.utils.checkpoint.checkpoint(core, q, k, v, use_reentrant=False): autograd keeps q, k and v
(the checkpoint's inputs, saved through the saved-tensor hooks that labkit's memory tracker
counts), none of the core's own saved tensors; backward runs the core again first.

Composes with TP: each rank's core holds its own heads and sends nothing, so no TP collective
runs again (as in Megatron-LM). PP: inside a stage's forward; FSDP: the core has no weights.
CP: give the ContextParallel wrapper as the layer, so that this mode sits under the wrapper's
router (entered later, the router sees a call first) and the call goes to the CP core. A core
that attends with SDPA over gathered keys (all-gather, Ulysses) has that SDPA checkpointed after
its collectives, which do not repeat. The ring core computes each block inside its own autograd
Function, which keeps only q, k, v, its output and log-sum-exp (no s^2: it rebuilds each block's
scores in its backward, FlashAttention's trade): there is nothing for selective recompute to
drop, so it is left alone and no K/V hop repeats (the planner's cp_ring_bytes counts the extra
hops for fully recomputed layers only). Give the wrapper, not the layer inside it: under the
router this mode would checkpoint the routed call and rebuild it, in backward, without the ring.

    layers = [parent.attn for parent in model.blocks]           # or ContextParallel wrappers
    handle = checkpoint_attention_cores(layers, model_name="TinyGPT")
    loss = model(x, y); loss.backward()       # each core runs twice, its scores never kept
    handle.remove()

Full recompute of k of a stage's L_s layers (Megatron-LM's `--recompute-method block
--recompute-num-layers k`): `CheckpointedLayer(block)` keeps the block's input (2 sbh) and runs
its whole forward again in backward, its forward collectives (TP, the CP ring's hops, EP's
all-to-alls) with it, so a stage keeps (L_s - k) a_none + k a_full per micro-batch in flight
(theory/recompute.py); k = L_s is the pipeline's whole-stage recompute.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .scoped_mode import ModuleScopedMode

CORE_NAMES = ("causal_attention",)   # overridable cores found by name (labkit.models')


class _CheckpointCore(ModuleScopedMode):
    """While active, an attention-core call with gradients on runs under non-reentrant
    checkpoint; every other torch call runs as it is."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        core = func is F.scaled_dot_product_attention or \
            getattr(func, "__name__", None) in CORE_NAMES
        if core and torch.is_grad_enabled():
            self.calls += 1
            # this mode is off inside its own handler: `func` runs the core as it would
            # without it (any mode below still sees it), and so does the rebuild in backward
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)



class CheckpointedCores:
    """The hooks `checkpoint_attention_cores` placed; `calls`: cores checkpointed so far."""

    def __init__(self, mode, hooks):
        self._mode, self._hooks = mode, hooks

    @property
    def calls(self):
        return self._mode.calls

    def remove(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def checkpoint_attention_cores(layers: Iterable[nn.Module], model_name: str = "model",
                               require_core: bool = True) -> CheckpointedCores:
    """Selective recompute on each of `layers` (its attention modules; under context
    parallelism their ContextParallel wrappers): each core call they make while gradients are
    on is checkpointed (module docstring). No layer: a one-line ValueError naming
    `model_name`. require_core: a layer whose forward made no core call this mode can find
    (a hand-written softmax(QK^T)V keeps its scores) is refused in one line when it runs;
    a caller whose layers route their core elsewhere (a ContextParallel ring, which keeps no
    scores and refuses hand-written attention itself) passes False."""
    layers = list(layers)
    if not layers:
        raise ValueError(f"selective recompute: no attention layer found in the {model_name} "
                         "(no module named *Attention*); use full recompute")
    mode, hooks = _CheckpointCore(), []
    for layer in layers:
        hooks.append(layer.register_forward_pre_hook(mode.enter))
        hooks.append(layer.register_forward_hook(mode.exit, always_call=True))
        if require_core:
            hooks += _watch(layer, mode, f"{model_name}'s {type(layer).__name__}")
    return CheckpointedCores(mode, hooks)


def _watch(layer, mode, label):
    """Hooks that refuse a forward of `layer` (with gradients on) that made no core call."""
    before = []

    def start(*_):
        before.append(mode.calls)

    def check(*_):
        calls = before.pop()
        if torch.is_grad_enabled() and mode.calls == calls:
            raise ValueError(f"selective recompute: {label} ran without calling "
                             "scaled_dot_product_attention or causal_attention (a hand-written "
                             "attention core): its scores cannot be recomputed alone; use full "
                             "recompute")
    return [layer.register_forward_pre_hook(start), layer.register_forward_hook(check)]


class CheckpointedLayer(nn.Module):
    """`module` under torch.utils.checkpoint (non-reentrant) while gradients are on: autograd
    keeps its inputs, none of its own saved tensors, and backward runs its forward again."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module     # `.module`: flat.unwrapped_name gives the model's names

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.module(*args, **kwargs)
        # the whole forward again, as Megatron-LM's (and the planner's count): torch's early
        # stop would end the rebuild at the last saved tensor, skipping the layer's last
        # forward collective (the MLP's row-parallel all-reduce)
        with set_checkpoint_early_stop(False):
            return checkpoint(self.module, *args, use_reentrant=False, **kwargs)

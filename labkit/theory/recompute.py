"""Activation memory of one pipeline stage, with full recompute of k of its layers.

A stage of L_s layers keeps, per micro-batch in flight, what each layer saves for backward
(transformer.activation_bytes): a_none for a layer run normally, a_full (its input only) for a
layer recomputed in backward, so k recomputed layers keep (L_s - k) a_none + k a_full, plus the
working set of one layer being rebuilt (Megatron-LM `--recompute-granularity full
--recompute-method block --recompute-num-layers k`; Korthikanti et al. 2022, arXiv 2205.05198,
Appendix C); the rebuilt layer replaces its checkpoint while it runs. Selective recompute keeps
a_selective in every layer and rebuilds one layer's scores at a time. The first stage of 1F1B
holds min(m, pp) micro-batches; interleaving with v chunks holds min(m v, (v+1) pp - 1) chunks
of L_s / v layers (Megatron-LM's warm-up). The last stage keeps the fp32 logits of one
micro-batch as well. Recompute costs k / L_s of the stage's forward.
"""
from __future__ import annotations


def layers_in_flight(layers_per_stage, microbatches, pp, v):
    """Layer-activations of whole micro-batches the first stage holds at its peak."""
    if v == 1:
        return min(microbatches, pp) * layers_per_stage
    return min(microbatches * v, (v + 1) * pp - 1) * layers_per_stage / v


def stage_activation_bytes(kept_layer, recomputed_layer, working_set, logits, layers_per_stage,
                           recompute_layers, microbatches, pp, v, selective=False):
    """Peak activation bytes of the worst stage with `recompute_layers` of its layers recomputed.

    kept_layer / recomputed_layer: one layer's bytes for one micro-batch when it keeps its
    activations / only its input; working_set: a layer's activations when rebuilt whole (held
    once, while its backward runs; the checkpointed input is part of it); logits: the last
    stage's fp32 logits of one micro-batch. selective: every layer keeps kept_layer (no
    scores) and rebuilds its scores, working_set - kept_layer, once, during its backward."""
    share = recompute_layers / layers_per_stage
    per_layer = (1 - share) * kept_layer + share * recomputed_layer
    rebuilt = 0.0
    if selective:
        rebuilt = working_set - kept_layer
    elif recompute_layers:
        rebuilt = working_set - recomputed_layer
    first_stage = per_layer * layers_in_flight(layers_per_stage, microbatches, pp, v) + rebuilt
    last_stage = per_layer * layers_per_stage + rebuilt + logits
    return max(first_stage, last_stage) if pp > 1 else first_stage + logits


def least_recompute_layers(budget_bytes, layers_per_stage, **stage):
    """The fewest layers per stage to recompute so that the activations fit `budget_bytes`
    (0 when none need be, layers_per_stage when even full recompute does not fit). Memory falls
    as k grows (bytes kept per layer fall from a_none to a_full), so bisection finds it."""
    def fits(k):
        return stage_activation_bytes(layers_per_stage=layers_per_stage, recompute_layers=k,
                                      **stage) <= budget_bytes
    if fits(0):
        return 0
    low, high = 0, layers_per_stage      # fits(low) is False; answer in (low, high]
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def recompute_flops(forward_flops, attention_core_flops, recompute, recompute_layers,
                    layers_per_stage, flash):
    """FLOPs run again in backward for one micro-batch on one stage: the attention scores of
    every layer under selective recompute or FlashAttention (its backward rebuilds them), and
    the whole forward of the k fully recomputed layers."""
    core = attention_core_flops if (flash or recompute == "selective") else 0.0
    if recompute != "full":
        return core
    share = recompute_layers / layers_per_stage
    return share * forward_flops + (1 - share) * core

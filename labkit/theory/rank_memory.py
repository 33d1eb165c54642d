"""Bytes of labkit's own tiny runs: what one rank holds, and what the reference run saves.

The preflight (runs/preflight.py) compares these with the memory of this machine before any
rank starts. Every number is a lower bound applied to the tiny shape under the technique's
layout, so a run refused for it could never have fitted:

    per rank  = max(4Ψ, states(Ψ / shards, ZeRO) + activations(the rank's slice)) + overhead
    reference = states(Ψ) + activations(global batch)       (the single-device run)

4Ψ: every driver builds the whole fp32 model on every rank before it keeps its shard. States:
fp32 weights, grads and optimizer (ZeRO, arXiv 1910.02054); activations: what the tiny GPT
saves for backward (Korthikanti et al. 2022, arXiv 2205.05198, `tiny_gpt_activation_bytes`),
the MLP's Linear and GELU inputs. Only the standard library: shapes come in as numbers.
"""
from __future__ import annotations

from . import context_parallel as theory_cp
from .memory import model_state_bytes, tiny_gpt_activation_bytes


def mlp_activation_bytes(dims, batch):
    """fp32 bytes the MLP of widths `dims` saves for backward on `batch` examples: each Linear
    keeps its input, each GELU its input; the MSE loss keeps output and target."""
    elements = sum(dims[:-1]) + sum(dims[1:-1]) + 2 * dims[-1]
    return 4 * batch * elements


def run_bytes(technique, world_size, options, shape, *, gpt, optimizer, global_batch,
              overhead=0):
    """{"ranks", "per_rank", "reference", "why"}: a lower bound of a run's bytes (docstring).

    shape: (layers, seq, hidden, heads, vocab, parameters) of the model (the MLP's: layers,
    1, its widest layer, 1, 0, parameters); gpt: the tiny GPT (else the MLP); overhead: bytes
    of one rank's process (Python, torch, the backend) added to each rank.
    """
    o = options
    world = world_size or 1
    layers, seq, hidden, heads, vocab, n = shape
    shards, zero, batch, cp = 1, 0, global_batch, 1
    pipeline_stages, tp = 1, 1
    if technique == "hybrid":
        dp, tp, pp, cp = o.get("dp", 2), o.get("tp", 2), o.get("pp", 2), o.get("cp", 1)
        world, shards, zero, pipeline_stages = dp * tp * pp * cp, tp * pp, o.get("zero", 0), pp
        batch = global_batch / (dp * o.get("microbatches", 2))
    elif technique == "tp":
        shards, tp = world, world
    elif technique == "pipeline":
        shards = pipeline_stages = world
        batch = global_batch / (1 if o.get("schedule") == "naive"
                                else o.get("microbatches", 4))
    elif technique == "cp":
        cp = world
    elif technique == "zero":
        zero, batch = min(o.get("stage", 1), 3), global_batch / world
    elif technique in ("dp", "moe"):
        batch = global_batch / world
    states = _states(n / shards, optimizer, zero, world if technique == "zero" else
                     o.get("dp", world) if technique == "hybrid" else 1)
    activations = _activations(gpt, layers / pipeline_stages, seq, batch, hidden, heads, vocab,
                               tp, cp, o.get("method", "ring"))
    per_rank = max(4 * n, states + activations) + overhead
    reference = _states(n, optimizer, 0, 1) + _activations(
        gpt, layers, seq, global_batch, hidden, heads, vocab, 1, 1)
    why = (f"the whole model, {n:.3g} parameters, is built on every rank" if 4 * n >=
           states + activations else "model states and activations of its share")
    return dict(ranks=world, per_rank=per_rank, reference=reference, why=why)


def _states(params, optimizer, zero_stage, dp):
    out = model_state_bytes(params, mixed_precision=False, optimizer=optimizer,
                            zero_stage=zero_stage, world_size=dp)
    return out["total"]


def _activations(gpt, layers, seq, batch, hidden, heads, vocab, tp, cp, cp_method="ring"):
    """Bytes one rank saves for backward: its layers, its sequence slice, its heads (CP: what
    `cp_method`'s attention keeps)."""
    if not gpt:
        return 4 * batch * hidden * 2 * layers
    if cp > 1:   # the attention term of theory/; the ring also makes one block's scores at a time
        head_dim = hidden // heads
        attention = theory_cp.attention_saved_bytes(batch, heads, seq, head_dim, cp,
                                                     dtype_bytes=4, method=cp_method)
        block = 4 * batch * heads * (seq / cp) ** 2   # one block's scores, made at a time
        return layers * (16 * seq / cp * batch * hidden * 4 + attention) + block
    return tiny_gpt_activation_bytes(layers=layers, seq=seq, batch=batch, hidden=hidden / tp,
                                     heads=heads / tp, vocab=vocab / tp)

"""One transformer layer by the numbers: parameters, FLOPs and activation bytes, for GPT and Llama.

The planner (planner.py) multiplies these by layers, micro-batches and pipeline depth. Two
families, as in data/models.csv:
- GPT (Radford et al. 2019; Narayanan et al. 2021's runs): fused QKV with biases, 4h GELU MLP,
  LayerNorm, dropout, learned positions, tied embeddings.
- Llama (Llama 3, arXiv 2407.21783; Mixtral, arXiv 2401.04088): grouped-query attention
  (kv_heads < heads), SwiGLU MLP with three matrices, RMSNorm, no dropout, no biases; MoE layers
  have `experts` SwiGLU MLPs of which `top_k` run per token, and a router.

FLOPs per token (Narayanan et al. 2021, arXiv 2104.04473; PaLM's MFU convention): a matmul
with P weights costs 2P forward and 4P backward; attention scores and values add 4*s*h forward
per layer (no causal halving; model_flops_per_token(causal=True) halves them, the planner's MFU
numerator). The input embedding is a lookup: no FLOPs.

Activation bytes per layer and micro-batch (16-bit values, 2 bytes each; s sequence, b micro-
batch, h hidden, a heads, t tensor-parallel size). GPT, Korthikanti et al. 2022 (arXiv
2205.05198): sbh(34 + 5as/h), with TP sbh(10 + 24/t + 5as/(ht)), with SP too sbh/t(34 + 5as/h).
Llama, derived the same way without dropout: kept whole on every TP rank (divided by t under
sequence parallelism) are the inputs of the two norms and of the QKV and MLP matmuls, 8sbh;
split by TP are Q, K, V (2sb(h + 2kv)), the attention output (2sbh), the softmax (2as^2b) and
the SwiGLU gate, up and down-projection inputs (6sbf), kv = kv_heads * head_dim, f the ffn size.
Selective recompute drops the as^2 term (recomputes the softmax, as FlashAttention does); full
recompute keeps only the layer input (2sbh, /t with SP) and rebuilds one layer at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

from .catalog import ModelShape

BYTES_16BIT = 2


@dataclass(frozen=True)
class LayerCounts:
    """Per-layer weights, split into what TP shards and what it does not."""
    attention: int      # weights of the attention matmuls (TP-sharded)
    mlp_total: int      # weights of all MLPs/experts of the layer
    mlp_active: int     # weights of the MLPs a token runs through (top_k experts)
    router: int
    norms: int          # norm weights and biases that TP replicates


def is_gpt(m: ModelShape) -> bool:
    return m.arch == "gpt2" or m.arch == "gpt"


def layer_counts(m: ModelShape) -> LayerCounts:
    h, f = m.hidden, m.ffn
    if is_gpt(m):
        # a GPT with experts (labkit's MoE GPT): `experts` GELU MLPs, top_k run, a bias-free
        # router (h x experts); the catalog's GPTs have one MLP
        mlp, experts = 2 * h * f + f + h, max(1, m.experts)
        return LayerCounts(attention=4 * h * h + 4 * h, mlp_total=mlp * experts,
                           mlp_active=mlp * min(m.top_k, experts),
                           router=h * experts if experts > 1 else 0, norms=4 * h)
    kv = m.kv_heads * m.head_dim
    experts = max(1, m.experts)
    router = h * experts if experts > 1 else 0
    return LayerCounts(attention=2 * h * h + 2 * h * kv, mlp_total=3 * h * f * experts,
                       mlp_active=3 * h * f * min(m.top_k, experts), router=router, norms=2 * h)


def embedding_params(m: ModelShape) -> int:
    """Input embedding (+ learned positions for GPT): held by the first pipeline stage."""
    return m.vocab * m.hidden + (m.max_seq * m.hidden if is_gpt(m) else 0)


def head_params(m: ModelShape) -> int:
    """Output projection (+ final norm): held by the last stage (a copy there when tied)."""
    return m.vocab * m.hidden + m.hidden


def model_flops_per_token(m: ModelShape, seq: int, causal: bool = False) -> float:
    """Training FLOPs per token without recompute: 6 N_matmul + 12 L h s (Narayanan et al.
    2021 and PaLM, the convention published runs report in). causal=True counts the scores a
    causal model needs, 6 L h s (the upper triangle is masked: FlashAttention's benchmark
    convention, Dao 2023): the planner's MFU numerator, so that MFU <= 1 at any length."""
    c = layer_counts(m)
    attention = 12 * m.hidden * seq * (0.5 if causal else 1.0)
    per_layer = 6 * (c.attention + c.mlp_active + c.router) + attention
    return m.layers * per_layer + 6 * m.vocab * m.hidden


def layer_forward_flops_per_token(m: ModelShape, seq: int) -> float:
    """One layer's forward FLOPs per token: 2 per matmul weight + 4 s h for attention."""
    c = layer_counts(m)
    return 2 * (c.attention + c.mlp_active + c.router) + 4 * m.hidden * seq


def attention_core_flops_per_token(m: ModelShape, seq: int) -> float:
    """Forward FLOPs of scores and values (what selective recompute runs again): 4 s h."""
    return 4 * m.hidden * seq


def head_flops_per_token(m: ModelShape) -> float:
    """Forward + backward of the output projection (never recomputed): 6 V h."""
    return 6 * m.vocab * m.hidden


def activation_bytes(m: ModelShape, seq: int, micro_batch: int, tp: int = 1,
                     sequence_parallel: bool = False, recompute: str = "none",
                     cp: int = 1, flash: bool = False, dropout: bool = None,
                     value_bytes: int = BYTES_16BIT) -> float:
    """Bytes one layer keeps for backward for one micro-batch on one GPU (see module doc).

    With context parallelism each rank holds s/cp of the sequence; its queries still meet every
    key, so the softmax term is a*(s/cp)*s*b. recompute: "none", "selective" or "full".
    flash: FlashAttention (Dao et al. 2022, arXiv 2205.14135) never stores the softmax (it
    recomputes it in backward), so the a s^2 term is gone, as under selective recompute.
    dropout (default: GPT yes, Llama no) adds Korthikanti's 1-byte masks and the attention
    dropout's output; value_bytes is 2 for 16-bit activations, 4 for fp32 runs.
    """
    s_local, b, h, a = seq / cp, micro_batch, m.hidden, m.heads
    sbh = s_local * b * h
    softmax = 0.0 if recompute == "selective" or flash else a * s_local * seq * b
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return value_bytes * sbh / sp
    dropout = is_gpt(m) if dropout is None else dropout
    if is_gpt(m):   # values: 4 sbh replicated; Q, K, V, attention out, 2 x 4h MLP: 12 sbh split
        replicated, split = value_bytes * 4 * sbh, value_bytes * (12 * sbh + softmax)
    else:           # Llama: GQA keys and values, SwiGLU's gate, up and down-projection inputs
        kv = m.kv_heads * m.head_dim
        f = m.ffn * (min(m.top_k, m.experts) if m.experts > 1 else 1)
        replicated = value_bytes * 4 * sbh
        split = value_bytes * (s_local * b * (h + 2 * kv) + sbh + 3 * s_local * b * f + softmax)
    if dropout:     # two 1-byte masks on the residual branches; the attention dropout's mask
        replicated += 2 * sbh                          # and output beside the softmax
        split += (1 + value_bytes) * softmax
    return replicated / sp + split / tp


def full_layer_activation_bytes(m: ModelShape, seq: int, micro_batch: int, tp: int = 1,
                                sequence_parallel: bool = False, cp: int = 1,
                                flash: bool = False, dropout: bool = None,
                                value_bytes: int = BYTES_16BIT) -> float:
    """The working set a fully recomputed layer rebuilds during its backward."""
    return activation_bytes(m, seq, micro_batch, tp, sequence_parallel, "none", cp, flash,
                            dropout, value_bytes)


def logits_bytes(m: ModelShape, seq: int, micro_batch: int, tp: int = 1, cp: int = 1) -> float:
    """fp32 logits the loss keeps on the last stage: 4 s b V / t (vocab-parallel head)."""
    return 4 * seq / cp * micro_batch * m.vocab / tp

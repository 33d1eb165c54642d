"""Bytes of a model's weights at a serving precision: the one place every lesson, the CLI's
`memory` and the serving planner take them from.

The layers' Linear matrices are stored at `weights` precision, each with its scales (one bf16
scale per group of weights: int4 in groups of 128 as GPTQ/AWQ, Frantar et al. 2022, arXiv
2210.17323, Lin et al. 2023, arXiv 2306.00978; int8 one per output channel, as LLM.int8(),
Dettmers et al. 2022, arXiv 2208.07339; fp8 one per tensor); the embeddings, the head and the
norms stay in bf16 (the quantisers leave them so). Weight-only formats compute in bf16.
So int4 Llama 3 70B is 0.5 B x its matrices + scales + bf16 embeddings, not 0.5 B x all of it.
"""
from __future__ import annotations

from .plan_inputs import parse_model

BYTES = {"bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
WEIGHTS = tuple(BYTES)
SCALE_BYTES = 2                              # a bf16 scale per quantisation group
SCALE_GROUP = {"bf16": None, "fp8": None, "int8": "channel", "int4": 128}
MATRICES_PER_LAYER = 7                       # q, k, v, o, gate, up, down: fp8's per-tensor scales


def layer_param_split(model) -> dict:
    """Parameters: `matrices` (the layers' Linear weights: quantised), `experts` (the part of
    them in experts), `other` (embeddings, head, norms, routers: kept in bf16)."""
    m = parse_model(model)
    h, L = m.hidden, m.layers
    attention = m._attention_params() if m.arch != "gpt2" else 4 * h * h
    mlp_one = (3 if m.arch != "gpt2" else 2) * h * m.ffn
    experts = L * m.experts * mlp_one if m.experts > 1 else 0
    matrices = L * (attention + mlp_one * m.experts)
    return dict(matrices=matrices, experts=experts, other=m.param_count() - matrices,
                total=m.param_count())


def weight_bytes(model, weights="bf16") -> dict:
    """Bytes of the weights at a precision: {matrices, scales, other, total}."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    m = parse_model(model)
    s = layer_param_split(m)
    group = SCALE_GROUP[weights]
    if group is None:
        scales = 0 if weights == "bf16" else m.layers * MATRICES_PER_LAYER * SCALE_BYTES
    else:
        size = m.hidden if group == "channel" else group
        scales = s["matrices"] / size * SCALE_BYTES
    matrices = s["matrices"] * BYTES[weights]
    other = s["other"] * 2
    return dict(matrices=matrices, scales=scales, other=other, total=matrices + scales + other)

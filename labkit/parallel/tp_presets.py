"""Tensor-parallel plans for Hugging Face model families, kept as data.

Like torchtitan (its `parallelize_llama` plan) and transformers itself (`base_model_tp_plan`
in each model's configuration file), a family's plan is a dict {module name glob: style} that
one can read, print and change; `parallelize(model)` without a plan takes the preset of
`model.config.model_type`, and a plan passed in replaces it. Megatron's layout (Shoeybi et al.
2019, arXiv 1909.08053): q, k, v (or the fused q|k|v) and the MLP's first layers colwise, the
attention output and the MLP's last layer rowwise, so each block costs 2 all-reduces forward;
the embedding and the output layer split by vocabulary (a tied pair shares one shard).
The names are those of transformers' modelling files (LlamaForCausalLM: `model.layers.N...`;
GPT2LMHeadModel: `transformer.h.N...`, Conv1D layers; GPTNeoXForCausalLM: per-head fused
`query_key_value`; its output layer is `lm_head` in transformers 5, `embed_out` in 4).
"""
from .tensor_parallel_plan import plan_for

_LLAMA = {   # also Mistral, Qwen2 and Qwen3: the same module names (modeling_llama.py)
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab",
}

PRESETS = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gpt2": {
        "transformer.wte": "vocab",
        "transformer.h.*.attn.c_attn": "colwise",     # fused q|k|v: split part by part
        "transformer.h.*.attn.c_proj": "rowwise",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
        "lm_head": "vocab",                           # tied to wte: one shard
    },
    "phi3": {
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn.qkv_proj": "colwise",   # q|k|v with GQA sizes: part by part
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_up_proj": "colwise",      # gate|up: half by half
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab",
    },
    "gpt_neox": {
        "gpt_neox.embed_in": "vocab",
        "gpt_neox.layers.*.attention.query_key_value": "colwise",   # q, k, v per head
        "gpt_neox.layers.*.attention.dense": "rowwise",
        "gpt_neox.layers.*.mlp.dense_h_to_4h": "colwise",
        "gpt_neox.layers.*.mlp.dense_4h_to_h": "rowwise",
        "lm_head": "vocab",     # transformers 5 (tied to embed_in when configured so)
        "embed_out": "vocab",   # its name in transformers 4
    },
}


def tp_plan_for(model):
    """A copy of the preset plan for `model.config.model_type` (to read, change and pass to
    `parallelize`); one-line ValueError for a model without one."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise ValueError(f"{type(model).__name__} has no config.model_type to find a preset "
                         "plan by: pass parallelize a plan {module name glob: style}")
    if model_type not in PRESETS:
        raise ValueError(f"no tensor-parallel preset for model_type {model_type!r} "
                         f"({type(model).__name__}); presets: {', '.join(PRESETS)}; pass "
                         "parallelize a plan {module name glob: style}")
    # only the names this model has: some were renamed between transformers versions (a layer
    # left out stays whole, which is right, only less split); none at all is a refusal
    plan = plan_for(model, PRESETS[model_type])
    if not plan:
        raise ValueError(f"the {model_type!r} preset names no module of {type(model).__name__} "
                         "(a base model without its head?): pass parallelize a plan")
    return plan

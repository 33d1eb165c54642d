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

A family without a preset gets transformers' own plan (`model.tp_plan`: the config's
`base_model_tp_plan` under the model's prefix, the input embedding and the head), each HF
style mapped to labkit's (`HF_STYLES`); a style labkit does not know (DeepSeek-V2's
`mla_kv_a_proj`: its rotary key slice is shared by all heads) is refused in one line. The
presets stay where they are better: Phi-3's fused q|k|v split part by part, not gathered.
"""
from .tensor_parallel_plan import _matches, plan_for

_LLAMA = {   # also Mistral and Qwen2: the same module names (modeling_llama.py)
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
    "qwen3": {**_LLAMA,   # per-head q/k RMSNorms: each rank's gradient covers its heads only
              "model.layers.*.self_attn.q_norm": "replicated_grad_sum",
              "model.layers.*.self_attn.k_norm": "replicated_grad_sum"},
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


# transformers' styles (transformers/distributed/tensor_parallel.py) -> labkit's; None: the
# module stays whole (no entry)
HF_STYLES = {
    "colwise": "colwise", "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather", "colwise_rep": "colwise_gather",
    "rowwise_split_input": "rowwise_split", "rowwise_rep": "rowwise_split",
    "embedding_rowwise": "vocab",
    "replicated_with_grad_allreduce": "replicated_grad_sum",
    "replicate": None,
}


def hf_plan(model):
    """transformers' own plan for `model`, in labkit's styles (module doc): {} if it has none;
    one-line ValueError for a style labkit does not know."""
    plan = getattr(model, "tp_plan", None)
    if not isinstance(plan, dict):   # transformers 4: the config's, under the base model
        config = getattr(model, "config", None)
        prefix = getattr(model, "base_model_prefix", "")
        base = getattr(config, "base_model_tp_plan", None) or {}
        plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v
                for k, v in base.items()}
    # the entries that name a module or a parameter of this model (qwen3_moe names a dense
    # MLP that sparse layers lack); a parameter's entry (attention sinks) is judged too
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
    plan = {k: v for k, v in plan.items() if any(_matches(k, n) for n in names)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_names = [n for n, m in model.named_modules() if head is not None and m is head]
    mapped = {}
    for name, style in plan.items():
        if style not in HF_STYLES:
            raise ValueError(f"transformers' plan for {type(model).__name__} gives {name} the "
                             f"style {style!r}, which labkit does not implement, so it cannot "
                             "split this model as transformers does; pass parallelize a plan "
                             "without that module")
        if HF_STYLES[style] is not None:   # the output layer: split by vocabulary (logits)
            is_head = any(_matches(name, n) for n in head_names)
            mapped[name] = "vocab" if is_head and style.startswith("colwise") else \
                HF_STYLES[style]
    return mapped


def tp_plan_for(model):
    """A copy of the preset plan for `model.config.model_type`, else transformers' own plan
    (`hf_plan`), to read, change and pass to `parallelize`; one-line ValueError for a model
    with neither."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise ValueError(f"{type(model).__name__} has no config.model_type to find a preset "
                         "plan by: pass parallelize a plan {module name glob: style}")
    if model_type not in PRESETS:
        plan = hf_plan(model)
        if plan:
            return plan
        raise ValueError(f"no tensor-parallel preset for model_type {model_type!r} "
                         f"({type(model).__name__}) and no plan in its config; presets: "
                         f"{', '.join(PRESETS)}; pass parallelize a plan "
                         "{module name glob: style}")
    # only the names this model has: some were renamed between transformers versions (a layer
    # left out stays whole, which is right, only less split); none at all is a refusal
    plan = plan_for(model, PRESETS[model_type])
    if not plan:
        raise ValueError(f"the {model_type!r} preset names no module of {type(model).__name__} "
                         "(a base model without its head?): pass parallelize a plan")
    return plan

"""A Hugging Face config as the planner's model shape, so the formulas read the learner's model.

`hf_shape(config)` reads a config's attributes (no transformers import: any object with them)
for the families the blocks take (Llama, Mistral, Qwen2/3, Phi-3, Mixtral, Qwen2-MoE, GPT-2)
and returns `plan_inputs.parse_model`'s shape string, e.g. 'layers=32,hidden=4096,heads=32,
ffn=14336,vocab=128256,kv_heads=8,tied=false'. It is what `plan --model` takes, so a learner
can plan their own model on a real cluster: `python -m labkit plan --model "$(...)"`.
A config it cannot read is refused in one line naming the missing attribute. Left out, as in
the catalog's shapes: Qwen2's q/k/v biases (h + 2 kv_heads head_dim per layer, under 0.01% of
a 7B model).
"""
from __future__ import annotations

from .plan_inputs import parse_model

# attribute names by meaning: Llama-style first, GPT-2's after
_NAMES = {"layers": ("num_hidden_layers", "n_layer"), "hidden": ("hidden_size", "n_embd"),
          "heads": ("num_attention_heads", "n_head"), "vocab": ("vocab_size",)}


def _first(config, names, what):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ValueError(f"{type(config).__name__} has no {what} ({' or '.join(names)}): not a "
                     "decoder config labkit can read")


def hf_shape(config) -> str:
    """The shape string of a Hugging Face decoder config (see the module docstring)."""
    fields = {k: _first(config, names, k) for k, names in _NAMES.items()}
    gpt2 = getattr(config, "model_type", "") == "gpt2"
    if gpt2:
        fields["ffn"] = int(getattr(config, "n_inner", None) or 4 * fields["hidden"])
        fields["arch"] = "gpt"
        fields["seq"] = int(getattr(config, "n_positions", 1024))   # learned positions
    else:
        fields["ffn"] = _first(config, ("moe_intermediate_size", "intermediate_size"), "ffn")
        fields["kv_heads"] = int(getattr(config, "num_key_value_heads", None)
                                 or fields["heads"])
        experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts",
                                                                        None)
        if experts and experts > 1:
            fields["experts"] = int(experts)
            fields["top_k"] = int(getattr(config, "num_experts_per_tok", 2))
    fields["tied"] = str(bool(getattr(config, "tie_word_embeddings", gpt2))).lower()
    text = ",".join(f"{k}={v}" for k, v in fields.items())
    parse_model(text)   # refuses in one line what the planner cannot take
    return text

"""Tiny Hugging Face causal LMs built from configs (random weights, never downloaded), and the
references the HF tests compare with: HF's own greedy `generate`, the KV cache's bytes by the
formula, single-device training in float32 and float64."""
import torch

VOCAB, HIDDEN, LAYERS = 128, 32, 2
NO_TOKENS = dict(bos_token_id=0, eos_token_id=None, pad_token_id=0)   # ids inside the vocab,
# no end-of-sequence: every generation runs its full length


def build(family, attn="sdpa", tied=False, heads=4, kv_heads=2, hidden=HIDDEN, seed=0):
    """A 2-layer model of `family` (llama, mistral, qwen2, phi3, gpt2, gpt_neox, and the
    families below; gemma2 and bloom need attn="eager"), seeded."""
    import transformers as hf
    common = dict(vocab_size=VOCAB, num_hidden_layers=LAYERS, attn_implementation=attn,
                  tie_word_embeddings=tied, **NO_TOKENS)
    llama_like = dict(hidden_size=hidden, intermediate_size=2 * hidden, max_position_embeddings=64,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, **common)
    configs = {
        "llama": lambda: hf.LlamaConfig(**llama_like),
        "mistral": lambda: hf.MistralConfig(sliding_window=None, **llama_like),
        "qwen2": lambda: hf.Qwen2Config(**llama_like),   # q, k, v with biases
        "phi3": lambda: hf.Phi3Config(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
                                      **llama_like),      # fused qkv_proj, gate_up_proj
        "gpt2": lambda: hf.GPT2Config(n_embd=hidden, n_head=heads, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      **common),
        "gpt_neox": lambda: hf.GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                             num_attention_heads=heads,
                                             max_position_embeddings=64, hidden_dropout=0.0,
                                             attention_dropout=0.0, **common),
        # more families (issue 39): per-head q/k norms, scaled embeddings, ALiBi, ...
        "qwen3": lambda: hf.Qwen3Config(head_dim=hidden // heads, **llama_like),
        "qwen3_moe": lambda: hf.Qwen3MoeConfig(head_dim=hidden // heads, num_experts=4,
                                               num_experts_per_tok=2,
                                               moe_intermediate_size=hidden, **llama_like),
        "gemma2": lambda: hf.Gemma2Config(head_dim=hidden // heads,
                                          query_pre_attn_scalar=hidden // heads, **llama_like),
        "gemma3": lambda: hf.Gemma3TextConfig(head_dim=hidden // heads,
                                              query_pre_attn_scalar=hidden // heads,
                                              **llama_like),
        "stablelm": lambda: hf.StableLmConfig(qk_layernorm=True, **llama_like),
        "olmo2": lambda: hf.Olmo2Config(**llama_like),
        "starcoder2": lambda: hf.Starcoder2Config(residual_dropout=0.0, embedding_dropout=0.0,
                                                  **llama_like),
        "phi": lambda: hf.PhiConfig(resid_pdrop=0.0, embd_pdrop=0.0, **llama_like),
        "bloom": lambda: hf.BloomConfig(hidden_size=hidden, n_head=heads, hidden_dropout=0.0,
                                        attention_dropout=0.0, **common),
        "falcon": lambda: hf.FalconConfig(hidden_size=hidden, num_attention_heads=heads,
                                          alibi=True, new_decoder_architecture=False,
                                          multi_query=False, hidden_dropout=0.0,
                                          attention_dropout=0.0, **common),
        "deepseek_v2": lambda: hf.DeepseekV2Config(   # MLA: q, kv low-rank; 1 dense + 1 MoE layer
            moe_intermediate_size=hidden, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
            **llama_like),
    }
    config = configs[family]()
    torch.manual_seed(seed)
    return hf.AutoModelForCausalLM.from_config(config).eval()


def perturbed(model):
    """Norm weights and biases start constant (1, 0): noise, so that a norm applied to the
    wrong head, or a gradient summed over the wrong ranks, shows (as the self-check does)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if bool((p == p.reshape(-1)[0]).all()):
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def prompt(batch=4, length=6, seed=1):
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_generate(model, ids, new_tokens):
    """HF's own greedy decoding: the tokens generate must reproduce."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[:, ids.shape[1]:]


def kv_bytes(model, batch, tokens, tp=1, dtype_bytes=4):
    """2 (k and v) x layers x batch x tokens x kv heads x head dim x bytes, from the config
    (the heads of one TP rank: / tp)."""
    c = model.config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return 2 * c.num_hidden_layers * batch * tokens * (kv_heads // tp) * head_dim * dtype_bytes


def batch(step, size=4, length=8):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (size, length), generator=g)


def build_falcon(parallel_attn=True, seed=0):
    """A 2-layer Falcon (the original architecture: one fused query_key_value, a LayerNorm per
    block and, with `parallel_attn`, attention and MLP side by side, summed in place by
    `mlp_output += attention_output`), dropout off, seeded."""
    import transformers as hf
    config = hf.FalconConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                             num_attention_heads=4, new_decoder_architecture=False,
                             multi_query=False, parallel_attn=parallel_attn, hidden_dropout=0.0,
                             attention_dropout=0.0, attn_implementation="sdpa", **NO_TOKENS)
    torch.manual_seed(seed)
    return hf.AutoModelForCausalLM.from_config(config).eval()

"""A Hugging Face config read as the planner's shape: the parameter count the formulas derive
equals the model transformers builds from the same config (on the meta device: no memory, no
download), and lesson 11's explorer draws it and refuses what TP cannot split."""
import pytest

transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from labkit.theory.hf_shape import hf_shape  # noqa: E402
from labkit.theory.plan_inputs import parse_model  # noqa: E402

CONFIGS = {
    "llama-gqa-untied": lambda: transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False),
    "mistral-tied": lambda: transformers.MistralConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gpt2": lambda: transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000,
                                            n_positions=256),
    "mixtral": lambda: transformers.MixtralConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_shape_counts_the_parameters_transformers_builds(name):
    config = CONFIGS[name]()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    built = sum(p.numel() for p in model.parameters())
    assert parse_model(hf_shape(config)).param_count() == built


def test_qwen2s_qkv_biases_are_the_one_difference():
    """Qwen2 adds biases to q, k and v: h + 2 kv_heads x head_dim per layer that the
    planner's shape does not count (documented in theory/hf_shape.py)."""
    config = transformers.Qwen2Config(vocab_size=1000, hidden_size=128, intermediate_size=384,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    with torch.device("meta"):
        built = sum(p.numel() for p in transformers.Qwen2ForCausalLM(config).parameters())
    biases = 2 * (128 + 2 * 2 * 32)
    assert built - parse_model(hf_shape(config)).param_count() == biases


def test_a_config_without_the_sizes_is_refused_in_one_line():
    import types
    with pytest.raises(ValueError, match="SimpleNamespace has no layers .*not a decoder"):
        hf_shape(types.SimpleNamespace(hidden_size=8, vocab_size=10))


def test_the_explorer_draws_and_says_where_tp_stops():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from labkit.viz.own_model_widgets import draw_own_model, own_model_bytes
    configs = {"m": CONFIGS["llama-gqa-untied"]()}
    shape = hf_shape(configs["m"])
    one, eight = (own_model_bytes(shape, "FullyShard (ZeRO-3)", n, 512) for n in (1, 8))
    assert eight["params"] == pytest.approx(one["params"] / 8)     # ZeRO-3 shards the weights
    assert eight["activations"] == one["activations"]               # and not the activations
    fig, ax = plt.subplots()
    text = draw_own_model(ax, configs, "m", "tensor parallel", 8, 512)
    assert "TP 4 does not divide the 8 query / 2 KV heads" in text
    assert len({p.get_x() for p in ax.patches}) == 2                # 1 and 2 GPUs drawn
    plt.close(fig)

"""`parallelize` on Hugging Face models (tiny, from configs, random weights): the presets as data
(`tp_plan_for`) and a plan of one's own; training steps on 2 ranks equal one device (Llama
with GQA, Qwen2 with q/k/v biases, GPT-2's Conv1D and fused c_attn with a tied head, GPT-NeoX's
per-head fused query_key_value, Phi-3's fused GQA qkv_proj and gate_up_proj, Qwen3's per-head
q/k norms with their gradients summed, Gemma3's scaled embedding under transformers' own plan,
OLMo2's gathered q/k/v, Bloom's MLP with its model's head count untouched, Falcon's
FalconLinear), judged by labkit.numerics against a float64 run, the replicated parameters
identical on every rank; torch's parallelize_module bit for bit; a bf16 forward; and one test
per refusal."""
import types

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import labkit  # noqa: E402
from labkit import numerics  # noqa: E402
from labkit.parallel import tensor_parallel as tp  # noqa: E402
from labkit.parallel.tensor_parallel_plan import resolve_plan  # noqa: E402
from labkit.parallel.tp_presets import PRESETS, tp_plan_for  # noqa: E402
import hf_tiny  # noqa: E402

STEPS = 2
MLP_ONLY = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}
BLOOM_MLP = {"transformer.word_embeddings": "vocab", "transformer.h.*.mlp.dense_h_to_4h": "colwise",
             "transformer.h.*.mlp.dense_4h_to_h": "rowwise", "lm_head": "vocab"}
TRAIN_CASES = {  # name -> (family, attn, tied, plan: None = the preset or transformers' own)
    "llama-gqa": ("llama", "sdpa", False, None),
    "llama-eager-tied": ("llama", "eager", True, None),
    "qwen2-bias": ("qwen2", "sdpa", False, None),
    "gpt2-conv1d-tied": ("gpt2", "eager", True, None),
    "gpt_neox-per-head": ("gpt_neox", "sdpa", False, None),
    "phi3-fused-gqa": ("phi3", "eager", False, None),   # qkv_proj (4|2|2 heads), gate_up_proj
    "llama-own-plan": ("llama", "sdpa", False, MLP_ONLY),
    "qwen3-qk-norms": ("qwen3", "sdpa", False, None),   # the preset: q/k norms grad-summed
    "gemma3-hf-plan-tied": ("gemma3", "sdpa", True, None),   # scaled embedding kept, split
    "olmo2-hf-plan": ("olmo2", "sdpa", False, None),   # q/k/v gathered, o_proj split input
    "bloom-mlp-vocab": ("bloom", "eager", False, BLOOM_MLP),   # BloomModel keeps its heads
    "falcon-mlp-vocab": ("falcon", "sdpa", False, BLOOM_MLP),   # FalconLinear: x W^T + b
}


def _train(model, opt):
    losses = []
    for step in range(STEPS):
        ids = hf_tiny.batch(step)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_on_ranks(ctx, cases):
    out = {}
    for name, (family, attn, tied, plan) in cases.items():
        runs = [hf_tiny.perturbed(hf_tiny.build(family, attn, tied).train()) for _ in range(3)]
        runs[1] = numerics.exact_copy(runs[1])
        tp.parallelize(runs[2], plan, verify=False)   # the split itself (self-check: its tests)
        losses = [_train(m, torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6,
                                              foreach=False)) for m in runs]
        with ctx.off_the_record():
            full = tp.gather_params(runs[2])
        named = [dict(m.named_parameters()) for m in runs[:2]]
        out[name] = dict(loss=numerics.compare_loss(losses[2], losses[0], losses[1]),
                         params=numerics.compare(full, *named),
                         split=sum(p.tp_split is not None for p in runs[2].parameters()),
                         replicated={n: p.detach() for n, p in runs[2].named_parameters()
                                     if p.tp_split is None},
                         heads=getattr(getattr(runs[2], "transformer", None), "num_heads", None))
    return out


@pytest.fixture(scope="module")
def trained():
    return labkit.launch(train_on_ranks, 2, TRAIN_CASES, timeout_s=300)


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_tp_training_equals_one_device(trained, name):
    for result in trained:
        r = result[name]
        assert r["loss"], (name, str(r["loss"]))
        assert r["params"], (name, str(r["params"]))
        assert r["split"] > 0


@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_replicated_parameters_stay_identical_on_every_rank(trained, name):
    """Qwen3's q/k norms: each rank's gradient covers its own heads; summed over the group, the
    ranks' copies step alike (without the sum they drift apart, 0.05 after 3 steps)."""
    first, second = (result[name]["replicated"] for result in trained)
    assert first.keys() == second.keys() and first
    different = [n for n in first if not torch.equal(first[n], second[n])]
    assert not different, different


def test_bloom_keeps_its_models_head_count_for_alibi(trained):
    for result in trained:   # BloomModel, the vocab split's parent, is no attention module
        assert result["bloom-mlp-vocab"]["heads"] == 4   # not halved: ALiBi's slopes use it


def against_torch(ctx):
    """The preset's attention and MLP entries through labkit and through torch's
    parallelize_module (DTensor), 2 AdamW steps each: losses and gathered parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    plan = {k: v for k, v in tp_plan_for(hf_tiny.build("llama")).items() if v != "vocab"}
    ours = tp.parallelize(hf_tiny.build("llama").train(), plan)
    theirs = hf_tiny.build("llama").train()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(theirs, init_device_mesh("cpu", (ctx.world_size,)),
                       {k: styles[v]() for k, v in plan.items()})
    losses = [_train(m, torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False))
              for m in (ours, theirs)]
    with ctx.off_the_record():
        mine = tp.gather_params(ours)
    full = {n: getattr(p, "full_tensor", p.detach)().detach() for n, p in theirs.named_parameters()}
    return losses, all(torch.equal(mine[n], full[n]) for n in full) and mine.keys() == full.keys()


def test_tp_training_is_torch_parallelize_module_bit_for_bit():
    import transformers
    if int(transformers.__version__.split(".")[0]) < 5:   # 4.x reshapes by num_heads
        pytest.skip("torch's parallelize_module leaves transformers 4's head counts whole")
    for (ours, theirs), same_params in labkit.launch(against_torch, 2, timeout_s=300):
        assert ours == theirs and same_params


def bf16_forward(ctx):
    model = tp.parallelize(hf_tiny.build("llama").to(torch.bfloat16))
    with torch.no_grad():
        return model(hf_tiny.batch(0)).logits


def test_tp_bf16_forward_within_bf16_rounding():
    model = hf_tiny.build("llama")
    ids = hf_tiny.batch(0)
    with torch.no_grad():
        single = model.to(torch.bfloat16)(ids).logits
        exact = numerics.exact_copy(model)(ids).logits
    for logits in labkit.launch(bf16_forward, 2, timeout_s=300):
        agreement = numerics.compare(logits, single, exact)
        assert agreement, str(agreement)


# ------------------------------------------------------------------------- plans as data

@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2",
                                    "gpt_neox"])
def test_the_preset_is_a_plan_that_names_every_projection(family):
    model = hf_tiny.build(family)
    plan = tp_plan_for(model)
    preset = PRESETS[model.config.model_type]
    assert plan.items() <= preset.items() and plan is not preset
    chosen = dict(resolve_plan(model, plan, 2))
    plan["extra"] = "colwise"    # a copy to change: the preset stays as it was
    assert "extra" not in preset
    projections = [n for n, m in model.named_modules()
                   if type(m).__name__ in ("Linear", "Conv1D")]   # every matmul is split
    assert set(projections) <= set(chosen), sorted(set(projections) - set(chosen))
    assert "rowwise" in chosen.values() and "vocab" in chosen.values()


# ------------------------------------------------------------------------------ refusals

def test_refuses_tp_degree_not_dividing_kv_heads():
    model = hf_tiny.build("llama", heads=4, kv_heads=2)
    with pytest.raises(ValueError, match=r"TP degree 4 does not divide "   # transformers 4
                                         r"(config\.)?num_key_value_heads=2"):  # on the module
        resolve_plan(model, tp_plan_for(model), 4)


def test_refuses_tp_degree_not_dividing_heads():
    model = hf_tiny.build("gpt2", heads=4)
    with pytest.raises(ValueError, match="TP degree 8 does not divide num_heads=4"):
        resolve_plan(model, tp_plan_for(model), 8)


def test_refuses_sequence_parallel_on_hf_llama():
    with pytest.raises(ValueError, match="sequence_parallel=True on LlamaForCausalLM: "
                                         "Hugging Face models build positions"):
        tp.parallelize(hf_tiny.build("llama"), sequence_parallel=True)


class FusedUnknown(nn.Module):
    """An attention whose q|k|v sit in one Linear under a name labkit does not know."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = 4, 8
        self.Wqkv = nn.Linear(32, 96)


def test_refuses_an_unknown_fused_layout():
    model = nn.Sequential(FusedUnknown())
    with pytest.raises(ValueError, match="0.Wqkv .* looks like a fused projection"):
        resolve_plan(model, {"0.Wqkv": "colwise"}, 2)


def test_refuses_a_gpt2_c_attn_that_is_not_q_k_v():
    model = hf_tiny.build("gpt2", hidden=48, heads=4)
    attn = model.transformer.h[0].attn
    attn.c_attn = type(attn.c_attn)(2 * 48, 48)    # k|v only, as in cross-attention
    with pytest.raises(ValueError, match="c_attn .* looks like a fused projection"):
        resolve_plan(model, tp_plan_for(model), 2)


def test_refuses_conv1d_as_vocab():
    model = hf_tiny.build("gpt2")
    with pytest.raises(ValueError, match="'vocab' applies to nn.Linear or nn.Embedding; "
                                         "transformer.h.0.mlp.c_fc is of type Conv1D"):
        resolve_plan(model, {"transformer.h.*.mlp.c_fc": "vocab"}, 2)


def test_refuses_a_model_without_a_preset():
    model = nn.Linear(4, 4)
    model.config = types.SimpleNamespace(model_type="t5")
    with pytest.raises(ValueError, match="no tensor-parallel preset for model_type 't5'"):
        tp_plan_for(model)
    with pytest.raises(ValueError, match="Linear has no config.model_type"):
        tp_plan_for(nn.Linear(4, 4))


def test_refuses_a_config_whose_head_dim_is_derived():
    """Falcon's config computes head_dim from hidden_size / heads: a per-rank copy with fewer
    heads would widen every head. Refused in one line, not an AttributeError from HF."""
    import transformers
    from labkit.parallel.tensor_parallel_plan import _local_config
    cfg = transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=4, new_decoder_architecture=False)
    with pytest.raises(ValueError, match="FalconConfig computes head_dim from hidden_size"):
        _local_config(cfg, 2)


# ------------------------------------------------- transformers' own plans, and what they miss

def test_transformers_own_plan_in_labkit_styles():
    """No preset for OLMo2 and Gemma3: transformers' plan, each style mapped (the head's
    gathered colwise is labkit's vocab split, the embedding's rowwise too)."""
    olmo2 = tp_plan_for(hf_tiny.build("olmo2"))
    assert olmo2["model.layers.*.self_attn.q_proj"] == "colwise_gather"
    assert olmo2["model.layers.*.self_attn.o_proj"] == "rowwise_split"
    assert olmo2["model.layers.*.mlp.down_proj"] == "rowwise"
    assert olmo2["lm_head"] == olmo2["model.embed_tokens"] == "vocab"
    gemma3 = tp_plan_for(hf_tiny.build("gemma3"))
    assert gemma3["model.layers.*.self_attn.k_norm"] == "replicated_grad_sum"
    assert "qwen3" in PRESETS and PRESETS["qwen3"]["model.layers.*.self_attn.q_norm"] == \
        "replicated_grad_sum"


def test_refuses_a_transformers_style_labkit_does_not_know():
    model = hf_tiny.build("deepseek_v2", kv_heads=4)
    with pytest.raises(ValueError, match=r"gives model\.layers\.\*\.self_attn\.kv_a_proj_with_mqa "
                                         "the style 'mla_kv_a_proj', which labkit does not"):
        tp_plan_for(model)


def test_refuses_per_head_norm_lists():
    """StableLM pairs its per-head q/k LayerNorms with the heads by position (zip): after a
    split rank 1 would normalise heads 2, 3 with norms 0, 1."""
    model = hf_tiny.build("stablelm")
    with pytest.raises(ValueError, match=r"q_layernorm\.norms is a list of 4 per-head modules"):
        resolve_plan(model, PRESETS["llama"], 2)


def test_refuses_alibi_attention_split_by_heads():
    model = hf_tiny.build("bloom", "eager")
    plan = {**BLOOM_MLP, "transformer.h.*.self_attention.query_key_value": "colwise"}
    with pytest.raises(ValueError, match="BloomForCausalLM uses ALiBi, whose per-head slopes"):
        resolve_plan(model, plan, 2)


class ScaledLinear(nn.Linear):
    """A Linear subclass whose forward is not nn.Linear's."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_refuses_a_linear_subclass_whose_forward_is_not_linears():
    model = hf_tiny.build("falcon")
    resolve_plan(model, {"transformer.h.*.mlp.dense_h_to_4h": "colwise"}, 2)   # x W^T + b
    mlp = model.transformer.h[0].mlp
    mlp.dense_h_to_4h = ScaledLinear(32, 128)
    with pytest.raises(ValueError, match=r"dense_h_to_4h is a ScaledLinear, an nn\.Linear "
                                         "subclass whose own forward is not nn.Linear's"):
        resolve_plan(model, {"transformer.h.*.mlp.dense_h_to_4h": "colwise"}, 2)

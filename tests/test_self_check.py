"""The self-check (labkit/parallel/self_check.py) through `parallelize(..., verify=...)`, on 2
ranks and tiny Hugging Face families: a plan that would train wrong is refused in one line
naming where it goes wrong (Qwen3 without the q/k norms' gradient sum: the norm; Gemma's
embedding split without its scale: the embedding's output), `verify=False` skips it, it runs
off the record and leaves the random state alone; and the invariant over families labkit has
no preset for: `parallelize(model)` either refuses in one line or splits the model so that its
logits and gradients equal one device (labkit.numerics, float64 reference). FullyShard,
fully_shard, ContextParallel and ExpertParallel check themselves the same way (a tiny Llama, a
Qwen2-MoE block): they pass off the record, and a fault through each one's own path (gradients
summed instead of averaged, dK/dV never sent home, a router ignoring norm_topk_prob) is refused
in one line."""
import time
from functools import partial

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import labkit  # noqa: E402
from labkit import numerics  # noqa: E402
from labkit.parallel import tensor_parallel as tp  # noqa: E402
from labkit.parallel.self_check import EXPERTS, check_against_one_device  # noqa: E402
from labkit.parallel.tp_presets import PRESETS  # noqa: E402
import hf_tiny  # noqa: E402

OLD_QWEN3_PRESET = PRESETS["llama"]   # before issue 39: no gradient sum for q_norm / k_norm
FAMILIES = {   # family -> attention implementation (transformers' plan unless labkit's preset)
    "qwen3": "sdpa", "qwen3_moe": "sdpa", "gemma2": "eager", "gemma3": "sdpa", "phi": "sdpa",
    "olmo2": "sdpa", "starcoder2": "sdpa", "stablelm": "sdpa", "bloom": "eager",
    "falcon": "sdpa", "deepseek_v2": "sdpa",
}


def _refusal(call):
    try:
        call()
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return None


def wrong_plans(ctx):
    out = {}
    qwen3 = hf_tiny.build("qwen3")
    out["qwen3-old-preset"] = _refusal(lambda: tp.parallelize(qwen3, OLD_QWEN3_PRESET))
    out["untouched"] = qwen3.model.layers[0].self_attn.q_proj.weight.shape[0]
    out["skipped"] = _refusal(lambda: tp.parallelize(hf_tiny.build("qwen3"), OLD_QWEN3_PRESET,
                                                     verify=False))
    # Gemma's scaled embedding split the way labkit did before: a plain VocabParallelEmbedding
    tp.split_embedding_in_place, kept = (lambda layer, group, **options:
                                         tp.VocabParallelEmbedding(layer, group, **options),
                                         tp.split_embedding_in_place)
    try:
        out["gemma3-scale-dropped"] = _refusal(lambda: tp.parallelize(hf_tiny.build("gemma3")))
    finally:
        tp.split_embedding_in_place = kept
    # the mechanism itself: cost, off the record, the caller's random state untouched
    ctx.comm.reset()
    state = torch.get_rng_state()
    report = check_against_one_device(
        hf_tiny.build("qwen3"), lambda mini: tp.parallelize(mini, verify=False),
        forward=lambda model, ids: model(ids), gradients=tp.gather_grads)
    out["report"], out["logged"] = report, len(ctx.comm.records)
    out["same_rng"] = torch.equal(state, torch.get_rng_state())
    return out


def both(ctx):   # one launch: the ranks' start (importing transformers) is most of the cost
    return dict(wrong_plans(ctx), families=split_or_refuse(ctx), blocks=other_blocks(ctx))


@pytest.fixture(scope="module")
def ranks():
    return labkit.launch(both, 2, timeout_s=300)


@pytest.fixture(scope="module")
def refused(ranks):
    return ranks


def test_the_old_qwen3_preset_is_refused_naming_the_norm(refused):
    for result in refused:
        message = result["qwen3-old-preset"]
        assert message.startswith("SelfCheckError: parallelize_module(plan) would train "
                                  "Qwen3ForCausalLM wrong") and "\n" not in message
        assert "the gradient of model.layers.1.self_attn.q_norm.weight is not one device's" \
            in message, message
        assert result["untouched"] == 32   # refused before the model was split


def test_verify_false_skips_the_check(refused):
    assert all(result["skipped"] is None for result in refused)


def test_gemmas_embedding_split_without_its_scale_is_refused(refused):
    for result in refused:
        assert "the output of model.embed_tokens is not one device's" in \
            result["gemma3-scale-dropped"], result["gemma3-scale-dropped"]


def test_the_check_costs_under_a_second_off_the_record(refused):
    for result in refused:
        report = result["report"]
        print(f"self-check: {report['seconds']:.2f} s, {report['checks']} checks, worst "
              f"{report['worst'][0]} at {report['worst'][1]:.2f} x the limit")
        assert report["worst"][1] <= 1.0 and report["checks"] > 20
        assert report["seconds"] < 5.0    # about 0.3 s on a shared 2-core CPU
        assert result["logged"] == 0 and result["same_rng"]


# ------------------------------------------- the invariant on families without labkit's preset

def split_or_refuse(ctx):
    out = {}
    for family, attn in FAMILIES.items():
        kwargs = dict(kv_heads=4) if family == "deepseek_v2" else {}
        runs = [hf_tiny.perturbed(hf_tiny.build(family, attn, **kwargs).train()) for _ in range(3)]
        for model in runs:   # CPU's grouped_mm has no float64: the reference's experts eager
            if any(getattr(model.config, a, None) for a in EXPERTS):
                model.set_experts_implementation("eager")
        runs[1] = numerics.exact_copy(runs[1])
        refusal = _refusal(lambda: tp.parallelize(runs[2]))
        if refusal:
            out[family] = refusal
            continue
        ids = hf_tiny.batch(0)
        logits = []
        for model in runs:
            output = model(input_ids=ids, labels=ids)
            output.loss.backward()
            logits.append(output.logits.detach())
        with ctx.off_the_record():
            grads = tp.gather_grads(runs[2])
        reference = [dict(m.named_parameters()) for m in runs[:2]]
        out[family] = dict(logits=numerics.compare(*logits), grads=numerics.compare(
            grads, *[{n: p.grad for n, p in r.items() if p.grad is not None}
                     for r in reference]))
    return out


@pytest.fixture(scope="module")
def families(ranks):
    return [result["families"] for result in ranks]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_is_split_equal_to_one_device_or_refused_in_one_line(families, family):
    for result in families:
        verdict = result[family]
        if isinstance(verdict, str):
            assert "\n" not in verdict and verdict.startswith("ValueError") or \
                verdict.startswith("SelfCheckError"), verdict
            print(f"{family}: refused: {verdict[:150]}")
        else:
            assert verdict["logits"] and verdict["grads"], (family, str(verdict["logits"]),
                                                            str(verdict["grads"]))
            print(f"{family}: equal: logits {verdict['logits']}")


def test_the_families_that_must_split_do(families):
    """transformers' own plans (and labkit's qwen3 preset) split these; refusing them would
    pass the invariant above for no good reason."""
    for result in families:
        split = {f for f, v in result.items() if not isinstance(v, str)}
        assert {"qwen3", "qwen3_moe", "gemma2", "gemma3", "phi", "olmo2",
                "starcoder2"} <= split, sorted(split)


# ------------------------------- FullyShard, ContextParallel, ExpertParallel check themselves

def qwen2_moe(norm_topk_prob):
    import transformers
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, intermediate_size=64,
        moe_intermediate_size=32, num_experts=4, shared_expert_intermediate_size=48,
        norm_topk_prob=norm_topk_prob))


def _checked(ctx, build):
    """(seconds, collectives logged, random state untouched) of building a block that checks
    itself; the refusal's text instead if it refuses."""
    ctx.comm.reset()
    state = torch.get_rng_state()
    start = time.perf_counter()
    try:
        build()
    except ValueError as error:
        return f"{type(error).__name__}: {error}"
    return dict(seconds=time.perf_counter() - start, logged=len(ctx.comm.records),
                same_rng=torch.equal(state, torch.get_rng_state()))


def _patched(owner, name, value, call):
    """call() with owner.name (owner[name] of a dict) replaced by value."""
    space = owner if isinstance(owner, dict) else vars(owner)
    kept = space.get(name, partial)   # partial: not there (an instance's method, its class's)
    space[name] = value
    try:
        return call()
    finally:
        if kept is partial:
            del space[name]
        else:
            space[name] = kept


def fsdp2_bottom_up(model):
    from labkit.parallel.fsdp2 import fully_shard
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def other_blocks(ctx):
    from labkit.parallel import context_parallelism as cp, moe
    from labkit.parallel.fully_shard import FullyShard
    out = {}
    llama, other, block = hf_tiny.build("llama"), hf_tiny.build("llama"), \
        qwen2_moe(True).model.layers[0].mlp
    out["FullyShard"] = _checked(ctx, lambda: FullyShard(llama))
    third = hf_tiny.build("llama")
    out["fully_shard"] = _checked(ctx, lambda: fsdp2_bottom_up(third))
    out["ContextParallel"] = _checked(ctx, lambda: cp.ContextParallel(other, layout="zigzag"))
    out["ExpertParallel"] = _checked(ctx, lambda: moe.ExpertParallel(block))
    # faults through each block's own path
    summed = partial(ctx.comm.reduce_scatter.__func__, ctx.comm, op="sum")
    out["FullyShard sums"] = _patched(ctx.comm, "reduce_scatter", lambda t, op, **kw: summed(
        t, **kw), lambda: _checked(ctx, lambda: FullyShard(hf_tiny.build("llama"))))
    out["fully_shard sums"] = _patched(ctx.comm, "reduce_scatter", lambda t, op, **kw: summed(
        t, **kw), lambda: _checked(ctx, lambda: fsdp2_bottom_up(hf_tiny.build("llama"))))
    ring = cp.CORES["ring"]   # dK, dV never travel home: forward right, k/v gradients lost
    out["ContextParallel drops dK"] = _patched(cp.CORES, "ring", lambda q, k, v, group, **kw:
                                               ring(q, k.detach(), v.detach(), group, **kw),
                                               lambda: _checked(ctx, lambda: cp.ContextParallel(
                                                   hf_tiny.build("llama"))))
    gates = moe.top_k_gates   # a router that ignores norm_topk_prob
    out["ExpertParallel unnormalised"] = _patched(
        moe, "top_k_gates", lambda logits, k, norm: gates(logits, k, False),
        lambda: _checked(ctx, lambda: moe.ExpertParallel(qwen2_moe(True).model.layers[0].mlp)))
    out["skipped"] = _patched(moe, "top_k_gates", lambda logits, k, norm: gates(logits, k, False),
                              lambda: _checked(ctx, lambda: moe.ExpertParallel(
                                  qwen2_moe(True).model.layers[0].mlp, verify=False)))
    return out


@pytest.fixture(scope="module")
def blocks(ranks):
    return [result["blocks"] for result in ranks]


@pytest.mark.parametrize("block", ["FullyShard", "fully_shard", "ContextParallel",
                                   "ExpertParallel"])
def test_a_block_checks_itself_off_the_record_and_passes(blocks, block):
    for result in blocks:
        verdict = result[block]
        assert isinstance(verdict, dict), verdict
        print(f"{block}: checked in {verdict['seconds']:.2f} s")
        assert verdict["logged"] == 0 and verdict["same_rng"]
        assert verdict["seconds"] < 5.0     # ~0.1-0.5 s on a shared 2-core CPU


@pytest.mark.parametrize("fault, refusal", [
    ("FullyShard sums", "FullyShard would train LlamaForCausalLM wrong: on a miniature of it "
     "over 2 ranks, the gradient of lm_head.weight is not one device's"),
    ("fully_shard sums", "fully_shard would train LlamaForCausalLM wrong: on a miniature of "
     "it over 2 ranks, the gradient of lm_head.weight is not one device's"),
    ("ContextParallel drops dK", "ContextParallel would train LlamaForCausalLM wrong: on a "
     "miniature of it over 2 ranks, the gradient of model.layers.1.self_attn.k_proj.weight"),
    ("ExpertParallel unnormalised", "ExpertParallel would train Qwen2MoeSparseMoeBlock wrong: "
     "on a miniature of it over 2 ranks, the output is not one device's")])
def test_a_fault_in_the_blocks_path_is_refused_in_one_line(blocks, fault, refusal):
    for result in blocks:
        message = result[fault]
        assert isinstance(message, str) and "\n" not in message, message
        assert message.startswith(f"SelfCheckError: {refusal}"), message


def test_verify_false_skips_the_blocks_check(blocks):
    assert all(isinstance(result["skipped"], dict) for result in blocks)

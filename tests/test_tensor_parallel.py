"""Tensor parallelism against the single-device tiny GPT: loss, logits, every gradient and the
gathered parameters; comm per block from the log against theory/; memory per rank against
the formulas; inference with a KV cache; the TP-degree check; the exercise's checker."""
import pytest
import torch

import labkit
from labkit import theory
from labkit.runs import reference
from labkit import tensor_parallel as tp
from labkit.theory import tensor_parallel as theory_tp

# SGD: the update is linear in the gradient, so float32 rounding stays ~1e-7 in the parameters
# (Adam turns the rounding noise of zero-gradient elements into ~lr steps: see the Adam test).
SGD = reference.RunConfig(steps=2, global_batch=8, optimizer="sgd")
CASES = [(1, False), (2, False), (4, False), (2, True), (4, True)]
_REFERENCES = {}


def reference_details(cfg):
    """The reference run, plus the logits and gradients of its last step (before the update)."""
    key = repr(cfg)
    if key not in _REFERENCES:
        model = reference.build_model(cfg)
        optimizer = reference.build_optimizer(model.parameters(), cfg)
        losses = []
        for step in range(cfg.steps):
            x, y = reference.batch(model, cfg, step)
            optimizer.zero_grad(set_to_none=True)
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
            if step == cfg.steps - 1:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                with torch.no_grad():
                    logits = model(x)
            optimizer.step()
        _REFERENCES[key] = dict(loss=losses, grads=grads, logits=logits,
                                params=reference.full_params(model))
    return _REFERENCES[key]


def block_log(comm_log, block, steps):
    """{(direction, op): (calls, bytes per call)} per step for one block, from the comm log."""
    out = {}
    for rec in comm_log:
        if not rec["tag"].startswith(f"block {block} "):
            continue
        key = ("backward" if " bwd" in rec["tag"] else "forward", rec["op"])
        calls, sizes = out.get(key, (0, set()))
        out[key] = (calls + 1, sizes | {rec["bytes"]})
    return {k: (calls / steps, sizes) for k, (calls, sizes) in out.items()}


def several_runs(ctx, jobs):
    """Several tp.train runs in one launch (a launch costs seconds here), fresh instruments each."""
    from labkit.runtime.clock import Clock
    from labkit.runtime.memory import MemoryTracker
    out = []
    for args in jobs:
        ctx.comm.reset()
        ctx.memory, ctx.clock = MemoryTracker(ctx), Clock(ctx, ctx.clock.cluster)
        out.append(tp.train(ctx, *args))
    return out


@pytest.fixture(scope="module")
def runs():
    """(n, sp) -> rank 0's result, for TP = 1, 2, 4 without and with SP; plus Adam on 2."""
    adam = reference.RunConfig(steps=2, global_batch=8)
    out = {}
    for n in (1, 2, 4):
        jobs = [(SGD, sp, True, True) for _, sp in [c for c in CASES if c[0] == n]]
        jobs += [(adam, True)] if n == 2 else []
        results = labkit.launch(several_runs, n, jobs)
        for job, result in zip(jobs, results[0]):
            out[(n, job[1]) if job[0] is SGD else "adam"] = result
        out[(n, "all ranks")] = results
    return out


@pytest.mark.parametrize("n,sp", CASES)
def test_matches_the_single_device_tiny_gpt(runs, n, sp):
    first, expected = runs[(n, sp)], reference_details(SGD)
    assert first["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert all(r[0]["loss"] == runs[(n, "all ranks")][0][0]["loss"]
               for r in runs[(n, "all ranks")])  # the same loss on every rank
    assert set(first["params"]) == set(expected["params"])   # the reference's names
    assert reference.max_param_diff(first["params"], expected["params"]) < 1e-5
    assert torch.allclose(first["logits"], expected["logits"], atol=1e-5)
    for name, grad in expected["grads"].items():
        assert torch.allclose(first["grads"][name], grad, atol=1e-6), name

    # communication: each block's collectives, then the whole run, equal theory/
    c = tp.gpt_config(SGD)
    measured = block_log(first["comm_log"], 0, SGD.steps)
    predicted = theory_tp.block_comm(SGD.global_batch, c.seq, c.hidden, n,
                                     sequence_parallel=sp, bytes_per_element=4)
    assert measured == {(r["direction"], r["op"]): (r["calls"], {r["bytes"]})
                        for r in predicted}
    for row in first["comm"]:
        want = tp.predict_comm(SGD, n, sp)[row["op"]]
        assert (row["calls"], row["bytes"]) == (want["calls"], want["bytes"])
        assert row["wire_bytes_per_rank"] == pytest.approx(want["wire_bytes_per_rank"])

    # memory per rank: model states exactly, activations within 15% of the TP formula
    mem, pred = first["memory"], tp.predict_memory(SGD, n, sp)
    assert mem["params"] == mem["grads"] == pred["params"]
    single = 4 * sum(p.numel() for p in expected["params"].values())
    assert mem["params"] <= 1.1 * single / n   # ~1/t (replicated LayerNorms, biases aside)
    assert mem["activations"] == pytest.approx(pred["activations"], rel=0.15)


def test_adam_state_shrinks_and_matches_except_the_redundant_key_bias(runs):
    # Adam divides by sqrt(v): an element whose gradient is near rounding noise (the key bias,
    # which softmax cancels, most of all) gets a ~lr step whose sign is noise. Any two
    # summation orders differ there; a wrong gradient would show as ~lr = 1e-2 differences.
    cfg = reference.RunConfig(steps=2, global_batch=8)
    expected = reference.train(cfg)
    h = tp.gpt_config(cfg).hidden
    worst = 0.0
    for name, p in runs["adam"]["params"].items():
        q = expected["params"][name]
        if name.endswith("attn.qkv.bias"):
            p, q = torch.cat([p[:h], p[2 * h:]]), torch.cat([q[:h], q[2 * h:]])
        worst = max(worst, (p - q).abs().max().item())
    assert worst < 5e-4
    pred = tp.predict_memory(cfg, 2, True)
    assert runs["adam"]["memory"]["optimizer"] == pred["optimizer"]  # 2 moments, local
    assert pred["optimizer"] < 0.55 * expected["memory"]["optimizer"]


def test_sequence_parallel_cuts_activations_as_korthikanti_says():
    cfg, c = SGD, tp.gpt_config(SGD)
    args = dict(layers=c.layers, seq=c.seq, batch=cfg.global_batch, hidden=c.hidden,
                heads=c.heads, vocab=c.vocab, ffn=c.ffn)
    single = theory.tiny_gpt_activation_bytes(
        layers=c.layers, seq=c.seq, batch=cfg.global_batch, hidden=c.hidden, heads=c.heads,
        vocab=c.vocab)
    assert theory_tp.tiny_gpt_activation_bytes(tp=1, **args) == single
    sp4 = theory_tp.tiny_gpt_activation_bytes(tp=4, sequence_parallel=True, **args)
    assert sp4 == pytest.approx(single / 4)  # everything sharded: exactly 1/t
    # Korthikanti's 16-bit formula has the same shape: 10 + 24/t without SP, 34/t with SP
    k1 = theory_tp.korthikanti_bytes_per_layer(c.seq, 8, c.hidden, c.heads, 1)
    assert theory_tp.korthikanti_bytes_per_layer(c.seq, 8, c.hidden, c.heads, 4, True) == \
        pytest.approx(k1 / 4)


def test_greedy_generation_with_a_kv_cache_equals_the_reference():
    cfg = reference.RunConfig()
    prompt = reference.batch(reference.build_model(cfg), cfg, 0)[0][:2, :6]

    def run(ctx):
        model = tp.TensorParallelGPT(ctx, ctx.world, reference.build_model(cfg))
        return tp.generate(ctx, model, prompt, 8)

    (tokens, cache_bytes), _ = labkit.launch(run, 2)
    assert torch.equal(tokens, tp.reference_generate(reference.build_model(cfg), prompt, 8))
    c = tp.gpt_config(cfg)  # k and v of this rank's heads for 6 + 7 positions, fp32
    assert cache_bytes == 2 * c.layers * 2 * (6 + 7) * c.hidden // 2 * 4


@pytest.mark.parametrize("overrides,sp,word", [
    (dict(heads=4, hidden=64), False, "heads=4"),
    (dict(ffn=90), False, "ffn=90"),
    (dict(vocab=130), False, "vocab=130"),
    (dict(seq=30), True, "seq=30"),
])
def test_a_tp_degree_that_does_not_divide_fails_before_any_rank_starts(overrides, sp, word):
    cfg = reference.RunConfig(model_kwargs=overrides)
    n = 3 if "heads" in overrides else 4
    with pytest.raises(ValueError, match=word):
        tp.report(n, cfg, sequence_parallel=sp)
    with pytest.raises(ValueError, match="--model gpt"):
        tp.check_tp_degree(reference.RunConfig(model="mlp"), 2)


def test_the_exercise_checker_says_what_is_wrong():
    import torch.nn.functional as F

    def no_all_reduce(ctx, x, w, bias, group):
        return F.linear(x, w, bias)

    def bias_before(ctx, x, w, bias, group):
        return ctx.comm.all_reduce(F.linear(x, w, bias), group=group)

    def concatenated(ctx, x, w, bias, group):
        return ctx.comm.all_gather(F.linear(x, w).detach().t(), group=group).t()

    assert "never added" in tp.check_row_parallel(no_all_reduce)
    assert "counted 2 times" in tp.check_row_parallel(bias_before)
    assert "concatenate" in tp.check_row_parallel(concatenated)
    assert tp.check_row_parallel(tp.row_parallel_forward).startswith("Correct")


def test_cli_report(capsys):
    import json
    from labkit import cli
    cli.main(["run", "tp", "--world-size", "2", "--sequence-parallel", "--steps", "2",
              "--optimizer", "sgd", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["technique"] == "tp" and report["config"]["sequence_parallel"] is True
    assert report["max_param_diff_vs_reference"] < 1e-5
    wire = sum(row["wire_bytes_per_rank"] for row in report["comm"])
    assert wire == pytest.approx(report["predicted_comm_bytes_per_rank"])


def test_modelled_step_time_and_inference_memory_for_llama_3_70b():
    table = theory_tp.step_time_table("llama-3-70b", (1, 2, 4, 8, 16), batch=1, seq=4096)
    assert list(table["link"]) == ["NVLink 4"] * 4 + ["InfiniBand NDR"]
    assert table.loc[8, "total"] < table.loc[1, "total"] / 4          # NVLink: faster
    assert table.loc[16, "total"] > table.loc[8, "total"]             # IB: slower than 8
    assert table["exposed_share"].is_monotonic_increasing
    inf = theory_tp.inference_table("llama-3-70b", (2, 4, 8), ("bf16", "int4"),
                                    batch=8, context=8192)
    bf16_tp2 = inf[(inf.tp == 2) & (inf.weights == "bf16")].iloc[0]
    params = theory.model("llama-3-70b").param_count()
    assert bf16_tp2.weights_gb == pytest.approx(params * 2 / 2 / 1e9)
    # KV cache: 2 (k, v) x 80 layers x 8 kv heads x 128 x 8192 x 8 x 2 bytes, split over 2
    assert bf16_tp2.kv_cache_gb == pytest.approx(2 * 80 * 8 * 128 * 8192 * 8 * 2 / 2 / 1e9)


def test_the_widget_panels_redraw_in_well_under_a_second():
    import time
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from labkit.viz import tp_widgets
    fig = plt.figure(figsize=(14, 4.4))
    tp_widgets.tp_panels(fig, tp=2)  # warm-up: first draw imports fonts
    start = time.perf_counter()
    summary = tp_widgets.tp_panels(fig, model="Llama 3 70B", tp=16, sequence_parallel=True,
                                   link="InfiniBand NDR", batch=2, seq=8192)
    fig.canvas.draw()
    assert time.perf_counter() - start < 1.0
    assert "TP=16 + SP over InfiniBand NDR" in summary and len(fig.axes) == 3
    plt.close(fig)

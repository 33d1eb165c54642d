"""Invariants of the training planner and the serving model over their whole option space,
drawn by hypothesis (fixed seed: derandomize=True; bounded examples; the file runs in well
under a minute). Each bound is an independent expression (catalog shapes, datasheet peaks),
never the planner's own code run twice:

- training: activations none >= selective >= full and step time the other way, on every
  stack; memory never below the model states; MFU <= HFU <= 1; the step is the sum of its
  exposed terms, each below it, and at least the matmul FLOPs at the dense peak; a faster GPU
  (peak), HBM or link never makes a plan's step slower; overlap never makes it slower than
  its parts in sequence; an illegal layout is refused in one line;
- serving: TPOT at least the dense weights a GPU reads per token / its HBM bandwidth; at batch 1
  replicas change nothing and EP never splits the request (TPOT never below the dense weights
  plus one expert per layer, never shorter with top_k = 1); output tokens/s never above the
  compute roofline; KV bytes as the formula; the decode step never shorter with more
  requests or a longer context; an impossible layout is refused in one line.
"""
import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from labkit.theory import hardware, overlap, planner, pricing, serving, weights
from labkit.theory.plan_inputs import divisors

SETTINGS = dict(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TRAIN_MODELS = ("llama-3-8b", "llama-3-70b", "mixtral-8x7b", "gpt2-small",
                "layers=6,hidden=512,heads=8,kv_heads=2,ffn=1536,vocab=32000",
                "layers=4,hidden=256,heads=4,ffn=1024,vocab=50257,arch=gpt")
SERVE_MODELS = ("llama-3-8b", "llama-3-70b", "mixtral-8x7b",
                "layers=8,hidden=1024,heads=16,kv_heads=4,ffn=2816,vocab=32000,experts=4,"
                "top_k=1")
GPUS = ("H100", "H200", "A100", "B200")


def one_line_refusal(call):
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert message and "\n" not in message, message


# ------------------------------------------------------------------------------ training

@st.composite
def training_points(draw):
    """A model, a cluster, a workload and one layout (legal or not) of it."""
    model = planner.parse_model(draw(st.sampled_from(TRAIN_MODELS)))
    gpus = draw(st.sampled_from((1, 2, 4, 8, 16, 64)))
    seq = draw(st.sampled_from((512, 2048, 8192, 32768, 131072)))
    tp, pp, cp = (draw(st.sampled_from(divisors(gpus))) for _ in range(3))
    dp = max(1, gpus // (tp * pp * cp))
    mbs = draw(st.sampled_from((1, 2, 4)))
    batch = dp * mbs * draw(st.sampled_from((1, 2, 8)))
    ep = draw(st.sampled_from([e for e in divisors(dp) if model.experts % e == 0]
                              if model.experts > 1 else [1]))
    cluster = dict(gpu=draw(st.sampled_from(GPUS)),
                   flash_attention=draw(st.booleans()), causal=draw(st.booleans()),
                   precision=draw(st.sampled_from(("bf16", "fp8", "fp32"))),
                   stack=draw(st.sampled_from(("megatron", "megatron-2021", "fsdp2",
                                               "deepspeed", "llama3"))))
    if cluster["precision"] == "fp8" and cluster["gpu"] == "A100":
        cluster["precision"] = "bf16"            # no fp8 tensor cores: refused elsewhere
    p = dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, v=1, micro_batch_size=mbs,
             zero_stage=draw(st.sampled_from((0, 1) if pp > 1 else (0, 1, 2, 3))),
             sequence_parallel=tp > 1 and draw(st.booleans()))
    return model, gpus, batch, seq, cluster, p


def evaluate(model, gpus, batch, seq, cluster, p, recompute):
    c = planner.make_cluster(cluster["gpu"], gpus, flash_attention=cluster["flash_attention"],
                             precision=cluster["precision"], stack=cluster["stack"],
                             causal=cluster["causal"])
    layers = planner.layers_per_stage(model, p["pp"])
    q = dict(p, recompute=recompute, recompute_layers=layers if recompute == "full" else 0)
    return c, planner.why_illegal(model, c, batch, seq, q), q


def matmul_flops_per_token(m):
    """6 x the matmul weights a token runs through, from the catalog's shapes (attention and
    the top_k experts' MLPs of every layer, the head): what any step must compute."""
    h, f = m.hidden, m.ffn
    mlp = (2 if m.arch in ("gpt2", "gpt") else 3) * h * f * min(m.top_k, max(m.experts, 1))
    return 6 * (m.layers * (m._attention_params() + mlp) + m.vocab * h)


@settings(max_examples=120, **SETTINGS)
@given(training_points())
def test_every_legal_plan_keeps_the_planners_invariants(point):
    model, gpus, batch, seq, cluster, p = point
    c, why, _ = evaluate(model, gpus, batch, seq, cluster, p, "none")
    if why:      # an illegal layout: the planner refuses it in one line, naming why
        fix = {k: v for k, v in p.items()}
        one_line_refusal(lambda: planner.plan(model, gpus, cluster["gpu"], global_batch=batch,
                                              seq=seq, fix=fix, top=1))
        return
    plans = {rc: planner.evaluate(model, c, batch, seq, evaluate(model, gpus, batch, seq,
                                                                  cluster, p, rc)[2])
             for rc in ("none", "selective", "full")}
    act = {rc: r["memory_bytes"]["activations"] for rc, r in plans.items()}
    step = {rc: r["step_s"] for rc, r in plans.items()}
    assert act["none"] >= act["selective"] >= act["full"] > 0
    assert step["none"] <= step["selective"] * (1 + 1e-12) <= step["full"] * (1 + 1e-12)
    peak = c.gpu.flops("fp8") if c.precision == "fp8" else c.gpu.bf16_flops
    floor = batch * seq * matmul_flops_per_token(model) / (gpus * peak)
    for r in plans.values():
        mem = r["memory_bytes"]
        assert mem["total"] >= mem["params"] + mem["grads"] + mem["optimizer"] > 0
        assert 0 < r["mfu"] <= r["hfu"] * (1 + 1e-12) and r["hfu"] <= 1
        terms = r["breakdown_s"]
        assert math.isclose(sum(terms.values()), r["step_s"], rel_tol=1e-9)
        assert all(0 <= t <= r["step_s"] for t in terms.values())
        assert r["step_s"] >= floor


@settings(max_examples=40, **SETTINGS)
@given(st.sampled_from(TRAIN_MODELS), st.sampled_from(("tp=3", "pp=100000", "cp=3",
                                                       "ep=2", "v=7,pp=2", "dp=5",
                                                       "zero_stage=3,pp=2", "recompute=half",
                                                       "tp=0", "micro_batch_size=-1")),
       st.sampled_from((0, -1, 8)), st.sampled_from((0, 8, 10**10)))
def test_a_bad_option_is_refused_in_one_line(model, fix, gpus_per_node, gpus):
    one_line_refusal(lambda: planner.plan(model, gpus, "H100", gpus_per_node=gpus_per_node,
                                          global_batch=16, seq=4096,
                                          fix=f"{fix},dp=1" if gpus == 8 else fix, top=1))


def faster(g, peak=1.0, hbm=1.0):
    """The GPU with its dense peaks (and measured MAMF, so the ceiling stays) x `peak` and its
    HBM bandwidth x `hbm`."""
    scale = lambda x: None if x is None else x * peak  # noqa: E731
    return dataclasses.replace(g, bf16_flops=g.bf16_flops * peak, fp8_flops=scale(g.fp8_flops),
                               fp32_flops=g.fp32_flops * peak,
                               mamf_bf16_flops=scale(g.mamf_bf16_flops),
                               mamf_fp8_flops=scale(g.mamf_fp8_flops),
                               memory_bw=g.memory_bw * hbm)


def quicker(link, by):
    """The link with its bandwidth x `by` and its latency / `by`."""
    return dataclasses.replace(link, bandwidth=link.bandwidth * by, latency=link.latency / by)


@settings(max_examples=60, **SETTINGS)
@given(training_points(), st.sampled_from(("none", "selective", "full")),
       st.sampled_from((1.5, 2.0, 4.0)))
def test_faster_hardware_and_overlap_never_make_a_step_slower(point, recompute, by):
    model, gpus, batch, seq, cluster, p = point
    c, why, q = evaluate(model, gpus, batch, seq, cluster, p, recompute)
    if why:
        return
    base = planner.evaluate(model, c, batch, seq, q)["step_s"]
    for other in (dataclasses.replace(c, gpu=faster(c.gpu, peak=by)),
                  dataclasses.replace(c, gpu=faster(c.gpu, hbm=by)),
                  dataclasses.replace(c, intra=quicker(c.intra, by),
                                      inter=quicker(c.inter, by))):
        assert planner.evaluate(model, other, batch, seq, q)["step_s"] <= base * (1 + 1e-12)
    # the same plan with nothing overlapped: every collective on the critical path
    sequential = overlap.Stack("sequential", False, False, False, False, cp_overlap=False)
    apart = planner.evaluate(model, dataclasses.replace(c, stack=sequential), batch, seq, q)
    assert base <= apart["step_s"] * (1 + 1e-12)


# ------------------------------------------------------------------------------- serving

@st.composite
def serving_points(draw):
    model = planner.parse_model(draw(st.sampled_from(SERVE_MODELS)))
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if model.heads % t == 0]))
    pp = draw(st.sampled_from((1, 2, 4)))
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if model.experts % e == 0]
                              if model.experts > 1 else [1]))
    return dict(model=model, gpu=draw(st.sampled_from(GPUS)), tp=tp, pp=pp, ep=ep,
                replicas=draw(st.sampled_from((1, 2, 8))),
                batch=draw(st.sampled_from((1, 3, 16, 256))),
                prompt_len=draw(st.sampled_from((16, 1024, 8192))),
                new_tokens=draw(st.sampled_from((1, 64, 512))),
                weights=draw(st.sampled_from(serving.WEIGHTS)),
                kv_dtype=draw(st.sampled_from(("bf16", "fp8"))))


def dense_bytes_per_gpu(m, weights, tp, pp):
    """Weights every token reads on a GPU whatever the routing: all but the experts' MLPs."""
    w = serving.weight_bytes(m, weights)
    experts = serving.layer_param_split(m)["experts"]
    per_matrix = (w["matrices"] + w["scales"]) / serving.layer_param_split(m)["matrices"]
    return (w["total"] - experts * per_matrix) / (tp * pp)


@settings(max_examples=120, **SETTINGS)
@given(serving_points())
def test_the_serving_model_keeps_its_invariants(point):
    kw = dict(point)
    m, g = kw["model"], hardware.gpu(kw["gpu"])
    t = serving.serving_time(**{**kw, "model": m})
    # a token reads at least the dense weights of its GPU (pp stages in turn)
    assert t["tpot_s"] >= kw["pp"] * dense_bytes_per_gpu(m, kw["weights"], kw["tp"],
                                                         kw["pp"]) / g.memory_bw
    # output tokens never beyond the compute roofline: 2 FLOPs per active weight per token
    gpus = kw["tp"] * kw["pp"] * kw["ep"] * kw["replicas"]
    assert t["tokens_per_s"] <= gpus * g.bf16_flops / (2 * m.active_param_count())
    assert t["ttft_s"] > 0 and t["tpot_s"] > 0
    # at batch 1 a replica serves the one request (the others idle): nothing changes
    one = dict(kw, batch=1, model=m)
    alone = serving.serving_time(**dict(one, replicas=1))
    spread = serving.serving_time(**dict(one, replicas=8))
    assert (spread["ttft_s"], spread["tpot_s"]) == (alone["ttft_s"], alone["tpot_s"])
    assert spread["tokens_per_s"] == pytest.approx(alone["tokens_per_s"])
    if kw["ep"] > 1:
        # EP at batch 1: the request is never split (its attention and cache stay whole on one
        # GPU); only the experts' weights are spread, so EP can shorten a memory-bound step by
        # reading fewer experts per GPU, never below the dense weights plus the expert a token
        # must read; with top_k = 1 that expert is read either way, so EP only adds all-to-alls
        no_ep = serving.serving_time(**dict(one, replicas=1, ep=1))
        with_ep = serving.serving_time(**dict(one, replicas=1))
        assert with_ep["memory_bytes"]["kv_cache"] == no_ep["memory_bytes"]["kv_cache"]
        if m.top_k == 1:
            assert with_ep["tpot_s"] >= no_ep["tpot_s"]
        one_expert = 3 * m.hidden * m.ffn * m.layers * weights.BYTES[kw["weights"]]
        assert with_ep["tpot_s"] >= (dense_bytes_per_gpu(m, kw["weights"], kw["tp"], 1)
                                     + one_expert / kw["tp"]) / g.memory_bw
        assert with_ep["ttft_s"] >= dense_bytes_per_gpu(m, kw["weights"], kw["tp"], 1) \
            / g.memory_bw


@settings(max_examples=60, **SETTINGS)
@given(st.sampled_from(SERVE_MODELS), st.integers(1, 64), st.integers(1, 1 << 17),
       st.sampled_from(("bf16", "fp8")), st.sampled_from((1, 2, 4, 8, 16)),
       st.sampled_from((1, 2, 4)))
def test_kv_cache_bytes_are_the_formula(model, batch, context, dtype, tp, pp):
    m = planner.parse_model(model)
    head_dim = m.hidden // m.heads
    value = {"bf16": 2, "fp8": 1}[dtype]
    # k and v for every layer and KV head; TP splits the heads (at most kv_heads ways), PP
    # the layers
    expected = 2 * m.layers * m.kv_heads * head_dim * value * batch * context \
        / (pp * min(tp, m.kv_heads))
    assert serving.kv_cache_bytes(m, batch, context, dtype, tp, pp) == pytest.approx(
        expected, rel=1e-12)


@settings(max_examples=40, **SETTINGS)
@given(st.sampled_from(SERVE_MODELS),
       st.sampled_from(("tp=3", "ep=3", "pp=100000", "tp=0", "dp=2", "replicas=x")),
       st.sampled_from((0, -3, 8)), st.sampled_from((0, 7, 8, 10**9 + 1)),
       st.sampled_from((0, 1)))
def test_an_impossible_serving_point_is_refused_in_one_line(model, fix, per_node, gpus,
                                                            batch):
    one_line_refusal(lambda: serving.plan_serving(model, gpus, "H100", fix=fix, batch=batch,
                                                  gpus_per_node=per_node))


@settings(max_examples=60, **SETTINGS)
@given(st.sampled_from(SERVE_MODELS), st.sampled_from(GPUS), st.integers(1, 512),
       st.integers(0, 1 << 16), st.integers(1, 64), st.integers(1, 4096))
def test_a_decode_step_is_monotone_in_batch_and_context(model, gpu, batch, context, more,
                                                        longer):
    """pricing.serving_pass, the price every serving caller takes: more requests, or a longer
    cache behind each, never make a decode step shorter."""
    m, g = planner.parse_model(model), hardware.gpu(gpu)
    step = lambda b, c: pricing.serving_pass(m, g, [(1, c)] * b)["total"]  # noqa: E731
    base = step(batch, context)
    assert step(batch + more, context) >= base * (1 - 1e-12)
    assert step(batch, context + longer) >= base * (1 - 1e-12)

"""Serving (lesson 09): generation with a KV cache on one device, then on ranks with the
training blocks (TP, PP, replicas, experts), each against the single-device greedy tokens; a
decoder the blocks were not written for; the theory against hand-derived numbers; the serving
planner and the CLI."""
import json
import math
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import models, numerics
from labkit.parallel import serving
from labkit.parallel.pipeline import PipelineStage, split_into_stages
from labkit.parallel.tensor_parallel import parallelize
from labkit.runs import serve
from labkit.theory import catalog, hardware, planner
from labkit.theory import time as ttime
from labkit.theory import serving as theory


def _prompt(batch=4, length=12, vocab=128, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ one device

def test_the_cache_gives_the_tokens_of_recomputing_everything():
    model = models.build("gpt", seq=40, layers=3).eval()
    prompt = _prompt()
    cache = serving.KVCache()
    fast = serving.generate(model, prompt, 16, cache)
    assert torch.equal(fast, serving.generate_without_cache(model, prompt, 16))
    c = model.cfg   # k and v, every layer, 12 + 15 positions (the last token is never fed)
    assert cache.nbytes() == 2 * c.layers * 4 * (12 + 15) * c.hidden * 4
    assert cache.length == 12 + 15


def test_prefill_is_the_training_forward_and_decode_matches_it():
    model = models.build("gpt", seq=24).eval()
    ids = _prompt(2, 20)
    with torch.no_grad():
        full = model(ids)
        exact = numerics.exact_copy(model)(ids)   # float64: what rounding is measured from
        cache = serving.KVCache()
        prefill = model(ids[:, :12], kv_cache=cache)
        steps = [model(ids[:, i:i + 1], kv_cache=cache) for i in range(12, 20)]
    # the same ops on fewer rows: bit for bit on some CPUs, not on all (a matmul's kernel may
    # block 12 rows differently from 20), so judged as every run is, by float32's own error
    assert numerics.compare(prefill, full[:, :12], exact[:, :12])
    assert numerics.compare(torch.cat(steps, dim=1), full[:, 12:], exact[:, 12:])


def test_moe_generation_with_the_cache():
    model = models.build_moe(0, moe=models.MoEConfig(experts=4, capacity_factor=4.0),
                             seq=32).eval()
    prompt = _prompt()
    assert torch.equal(serving.generate(model, prompt, 8),
                       serving.generate_without_cache(model, prompt, 8))


# ------------------------------------------------------------------------- layouts on ranks

TWO = [dict(tp=2), dict(pp=2), dict(replicas=2), dict(experts=4, ep=2)]
FOUR = [dict(tp=2, pp=2), dict(pp=4), dict(tp=2, replicas=2), dict(experts=4, ep=4)]


@pytest.mark.parametrize("layout", TWO + FOUR, ids=lambda d: ",".join(f"{k}{v}"
                                                                       for k, v in d.items()))
def test_every_layout_gives_the_single_device_tokens(layout):
    cfg = serve.ServeConfig(batch=8, prompt_len=10, new_tokens=6, **layout)
    report = serve.report(cfg=cfg)
    assert report["tokens_equal_reference"], report["tokens_differing"]
    assert report["kv_cache_bytes"] == report["predicted_kv_cache_bytes"]
    whole = sum(p.nbytes for p in serve.build(cfg).parameters())
    held = report["memory"][0]["params"]
    assert held < whole if (cfg.tp > 1 or cfg.pp > 1 or cfg.ep > 1) else held == whole
    # every rank holds a share (its heads, its layers, its requests): the shares add up
    assert sum(report["kv_cache_bytes"].values()) == report["reference_kv_cache_bytes"]
    ops = {row["op"]: row for row in report["comm"]}
    layers = cfg.gpt_config().layers
    if cfg.tp > 1 and cfg.pp == 1:   # 2 all-reduces per layer per forward (one per token)
        assert ops["all_reduce"]["calls_per_token"] == 2 * layers
        assert ops["all_reduce"]["bytes"] == 2 * layers * 4 * 64 * (
            cfg.batch // cfg.replicas) * (cfg.prompt_len + cfg.new_tokens - 1)
    if cfg.pp > 1:   # activations forward, the token back to the first stage
        assert set(ops) >= {"send", "recv"}
    if cfg.experts:  # dispatch and combine per MoE layer per forward
        assert ops["all_to_all"]["calls"] >= 2 * layers * cfg.new_tokens
    if layout == dict(replicas=2):
        assert report["comm"] == []     # replicas never talk while generating
    assert report["modelled_tpot_s"] > 0 and report["wall_tokens_per_s"] > 0


class ParallelBlock(nn.Module):
    """A GPT-J-style block the serving code was not written for: attention and MLP side by
    side on one norm, built from labkit's Attention (which takes the cache)."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mix = models.Attention(hidden, heads)
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x, kv_cache=None):
        h = self.norm(x)
        return x + self.mix(h, kv_cache=kv_cache) + self.down(F.silu(self.up(h)))


class Positions(nn.Module):
    def __init__(self, vocab=64, hidden=32, seq=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def forward(self, ids, kv_cache=None):
        return self.tok(ids) + self.pos(models.token_positions(ids, kv_cache))


def side_by_side_decoder():
    torch.manual_seed(3)
    return nn.Sequential(Positions(), ParallelBlock(), ParallelBlock(), ParallelBlock(),
                         nn.LayerNorm(32), nn.Linear(32, 64)).eval()


PLAN = {"*.mix.qkv": "colwise", "*.mix.proj": "rowwise", "*.up": "colwise", "*.down": "rowwise"}


def _own_decoder(ctx, layout):
    model, prompt = side_by_side_decoder(), _prompt(4, 8, vocab=64)
    if layout == "tp":
        parallelize(model, PLAN)
        return serving.generate(model, prompt, 10, return_logits=True)
    stages = split_into_stages(model, ctx.world_size, balance="layers")
    stage = PipelineStage(stages[ctx.rank], ctx.rank, ctx.world_size)
    return serving.PipelineGenerator(stage, 32, n_microbatches=2).generate(prompt, 10), None


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_a_decoder_it_was_not_written_for(layout):
    """TP and PP on an nn.Sequential of side-by-side blocks; logits within float32 rounding
    (the error of the split run vs float64 within a few times the one-device run's own)."""
    results = labkit.launch(_own_decoder, 2, layout, timeout_s=240)
    model, prompt = side_by_side_decoder(), _prompt(4, 8, vocab=64)
    tokens, logits = serving.generate(model, prompt, 10, return_logits=True)
    for got, got_logits in results:
        assert torch.equal(got, tokens)
        if got_logits is not None:
            exact = serving.generate(model.double(), prompt, 10, return_logits=True)[1]
            own = (logits.double() - exact).abs().max()
            split = (got_logits.double() - exact).abs().max()
            assert split <= 4 * own + 8 * torch.finfo(torch.float32).eps * exact.abs().max()


def _bad_pipeline(ctx):
    stage = PipelineStage(nn.Sequential(nn.Identity()), ctx.rank, 2)
    try:
        serving.PipelineGenerator(stage, 8, n_microbatches=3).generate(_prompt(4, 4), 2)
    except ValueError as error:
        return str(error)


def test_uneven_micro_batches_are_refused_in_one_line():
    assert "do not split into 3 equal micro-batches" in labkit.launch(_bad_pipeline, 2)[0]


# ---------------------------------------------------------------------------------- theory

def test_kv_bytes_per_token_is_gqa_aware():
    # Llama 3 70B: 80 layers x (k, v) x 8 KV heads x 128 x 2 bytes (bf16)
    assert theory.kv_bytes_per_token("llama-3-70b") == 80 * 2 * 8 * 128 * 2
    # GPT-2 small has no GQA: 12 heads of 64
    assert theory.kv_bytes_per_token("gpt2-small", "fp8") == 12 * 2 * 12 * 64 * 1
    # split by kv heads up to 8, replicated beyond
    one = theory.kv_cache_bytes("llama-3-70b", 4, 1000)
    assert theory.kv_cache_bytes("llama-3-70b", 4, 1000, tp=8) == one / 8
    assert theory.kv_cache_bytes("llama-3-70b", 4, 1000, tp=16) == one / 8


def test_four_bit_llama_3_70b_is_about_35_gb_and_scales_are_counted():
    w4 = theory.weight_bytes("llama-3-70b", "int4")
    n = catalog.model("llama-3-70b").param_count()
    embeddings = 2 * 128256 * 8192 + 80 * 2 * 8192 + 8192     # bf16: tables, norms
    assert w4["matrices"] == (n - embeddings) / 2
    assert w4["scales"] == (n - embeddings) / 128 * 2
    assert 34e9 < w4["matrices"] < 35e9 and 39e9 < w4["total"] < 40e9
    assert theory.weight_bytes("llama-3-70b", "bf16")["total"] == 2 * n


def test_the_knee_batch_of_decode():
    # Without a cache, intensity = 2 N b / (bytes of the weights): bf16 weights on an H100 turn
    # compute-bound at b = best GEMM FLOP/s / achievable bandwidth (dense, bytes per weight =
    # 2): H100's measured MAMF, 794.5 TFLOP/s, over 78% of its 3.35 TB/s (data/kernels.csv)
    ridge = 794.5e12 / (3.35e12 * 0.78)
    m = catalog.model("llama-3-70b")
    by_hand = ridge * theory.weight_bytes(m)["total"] / (2 * m.active_param_count())
    assert theory.knee_batch(m, "H100") == math.ceil(by_hand)
    # int4 weights are read 4x faster: the knee moves ~4x lower; a long context moves it up
    assert theory.knee_batch(m, "H100", "int4") < by_hand / 3
    assert theory.knee_batch(m, "H100", context=4096) > 2 * by_hand


def test_tpot_by_hand_one_gpu_tp_and_pp():
    m = catalog.model("llama-3-8b")
    g = hardware.gpu("H100")
    P, T = 512, 64
    one = theory.serving_time(m, gpu="H100", batch=1, prompt_len=P, new_tokens=T)
    # batch 1 decode is memory-bound: weights + the cache at context P + T/2 over the
    # sustained HBM bandwidth (78% of 3.35 TB/s), plus a launch of 5 us for each kernel: 11
    # per Llama layer (2 norms, QKV, RoPE, attention, output, 2 residual adds, gate/up,
    # SwiGLU, down) and 2 for the head (final norm, logits)
    read = theory.weight_bytes(m)["total"] + (P + T / 2 + 1) * theory.kv_bytes_per_token(m)
    bw, launches = g.memory_bw * 0.78, (32 * 11 + 2) * 5e-6
    assert one["tpot_s"] == pytest.approx(read / bw + launches, rel=1e-9)
    assert one["tpot_s"] > read / g.memory_bw       # slower than the datasheet roofline
    # TP=2: half the bytes per GPU, plus 2 all-reduces per layer of h bf16 values: the faster
    # of the one-shot (2 latencies of 2 us + bytes / NVLink 4's effective bandwidth) and the
    # ring (time.collective_time: NVLink 4's measured all_reduce curve)
    tp2 = theory.serving_time(m, gpu="H100", tp=2, batch=1, prompt_len=P, new_tokens=T)
    nbytes = m.hidden * 2
    one_shot = 2 * 2e-6 + nbytes / hardware.link("NVLink 4").effective_bandwidth
    all_reduce = min(one_shot, ttime.collective_time("all_reduce", nbytes, 2, "NVLink 4"))
    assert all_reduce == pytest.approx(one_shot, rel=0.01)   # a few KB: latency-bound either way
    assert tp2["tpot_s"] == pytest.approx(read / 2 / bw + launches + 2 * 32 * all_reduce,
                                          rel=1e-6)
    # PP=2: half the memory per GPU, but a token still passes every layer: no faster
    pp2 = theory.serving_time(m, gpu="H100", pp=2, batch=1, prompt_len=P, new_tokens=T)
    assert pp2["memory_bytes"]["weights"] == pytest.approx(one["memory_bytes"]["weights"] / 2)
    assert pp2["tpot_s"] >= one["tpot_s"]


def test_replicas_double_throughput_only_when_one_copy_is_saturated():
    def ratio(batch, prompt_len, new_tokens):
        kw = dict(gpu="H100", batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
        one = theory.serving_time("llama-3-8b", **kw)
        two = theory.serving_time("llama-3-8b", replicas=2, **kw)
        return two["tokens_per_s"] / one["tokens_per_s"], two["tpot_s"] / one["tpot_s"]
    # 16 requests, decode-heavy: one GPU batches them as cheaply as two (memory-bound)
    speed, tpot = ratio(16, 64, 256)
    assert speed < 1.1 and tpot > 0.9
    # far past the knee (compute-bound) or all prefill: a second copy nearly doubles the rate
    # (each copy still pays its kernel launches per step, which do not halve)
    assert 1.8 < ratio(1024, 64, 256)[0] <= 2.0
    assert ratio(16, 4096, 1)[0] == pytest.approx(2.0, rel=0.02)


# ---------------------------------------------------------------------------------- planner

def test_the_planner_rejects_what_does_not_fit_and_ranks_the_rest():
    out = theory.plan_serving("llama-3-70b", 8, "H100", prompt_len=4096, new_tokens=128,
                              batch=64)
    plans = out["plans"]
    fits = [p for p in plans if p["fits"]]
    assert fits and all(p["reason"] == "" for p in fits)
    speeds = [p["tokens_per_s_per_gpu"] for p in fits]
    assert speeds == sorted(speeds, reverse=True)
    one_gpu_bf16 = [p for p in plans if p["tp"] == 1 and p["pp"] == 1 and p["weights"] == "bf16"]
    assert one_gpu_bf16 and not one_gpu_bf16[0]["fits"]
    assert "GB per GPU" in one_gpu_bf16[0]["reason"] and "weights" in one_gpu_bf16[0]["reason"]
    keys = {"tp", "pp", "ep", "replicas", "weights", "kv_dtype", "batch_per_replica", "fits",
            "reason", "memory_bytes", "ttft_s", "tpot_s", "tokens_per_s",
            "tokens_per_s_per_gpu"}
    assert keys <= set(plans[0]) and set(plans[0]["memory_bytes"]) == {
        "weights", "kv_cache", "activations", "total"}


def test_max_tpot_and_fix():
    out = theory.plan_serving("llama-3-70b", 8, "H100", prompt_len=1024, batch=8,
                              max_tpot_ms=12, weights="bf16")
    for p in out["plans"]:
        if p["fits"] and not p["reason"]:
            assert p["tpot_s"] * 1e3 <= 12
    slow = [p for p in out["plans"] if p["reason"].startswith("TPOT")]
    assert slow
    fixed = theory.plan_serving("llama-3-70b", 8, "H100", fix="tp=4,pp=2", batch=8)
    assert {(p["tp"], p["pp"], p["replicas"]) for p in fixed["plans"]} == {(4, 2, 1)}
    with pytest.raises(ValueError, match="unknown field"):
        theory.plan_serving("llama-3-70b", 8, "H100", fix="dp=2")


def test_experts_spread_when_the_model_has_them():
    out = theory.plan_serving("mixtral-8x7b", 8, "H100", batch=64)
    assert any(p["ep"] > 1 and p["fits"] for p in out["plans"])
    assert all(p["ep"] == 1 for p in theory.plan_serving("llama-3-8b", 8, "H100",
                                                         batch=8)["plans"])


def test_the_405b_search_on_64_gpus_under_a_second():
    start = time.perf_counter()
    out = theory.plan_serving("llama-3.1-405b", 64, "H100", prompt_len=4096, batch=64)
    assert time.perf_counter() - start < 1.0 and out["plans"][0]["fits"]


# -------------------------------------------------------------------------------------- CLI

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True,
                          text=True, timeout=600)


def test_plan_serve_json_and_errors():
    done = _cli("plan", "--serve", "--model", "llama-3-70b", "--gpus", "8", "--gpu",
                "h100-sxm", "--context", "4096", "--batch", "64", "--weights", "fp8", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["plans"][0]["weights"] == "fp8" and out["workload"]["prompt_len"] == 4096
    bad = _cli("plan", "--serve", "--model", "llama-3-70b", "--gpus", "0")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_run_serve_json_and_errors():
    done = _cli("run", "serve", "--replicas", "2", "--batch", "4", "--prompt-len", "6",
                "--new-tokens", "3", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["tokens_equal_reference"] is True and out["world_size"] == 2
    for key in ("kv_cache_bytes", "predicted_kv_cache_bytes", "wall_tokens_per_s",
                "modelled_ttft_s", "modelled_tpot_s", "comm"):
        assert key in out
    bad = _cli("run", "serve", "--tp", "3")
    assert bad.returncode == 2 and "does not divide heads" in bad.stderr


# -------------------------------------------------------------------------------- exercises

def _no_all_reduce(ctx, x, shard, cache, group):
    from labkit.models import causal_attention
    q, k, v = F.linear(x, shard["w_qkv"], shard["b_qkv"]).chunk(3, dim=-1)
    if "k" in cache:
        k, v = torch.cat([cache["k"], k], 1), torch.cat([cache["v"], v], 1)
    cache["k"], cache["v"] = k, v
    out = causal_attention(q, k, v, q.shape[-1] // shard["head_dim"])
    return F.linear(out, shard["w_proj"]) + shard["b_proj"]


def test_the_tp_decode_checker_passes_the_answer_and_names_a_missing_all_reduce():
    from labkit.exercises import serving as exercise
    assert exercise.check_tp_decode_step(exercise.attention_decode_step, verbose=False)
    check = exercise.check_tp_decode_step(_no_all_reduce, verbose=False)
    assert not check and check.problem == "no all-reduce"


def test_the_number_checkers_name_the_usual_mistakes():
    from labkit.exercises import serving as exercise
    right = 80 * 2 * 8 * 128 * 8192 * 8 * 2
    assert exercise.check_kv_bytes(right, verbose=False)
    assert exercise.check_kv_bytes(right * 8, verbose=False).problem == "no GQA"
    assert exercise.check_kv_bytes(right / 2, verbose=False).problem == "forgot k or v"
    m = catalog.model("llama-3-8b")
    floor_ms = m.param_count() * 2 / 3.35e12 * 1e3     # H100 SXM: 3.35 TB/s
    assert exercise.check_tpot_floor(floor_ms, verbose=False)
    compute_ms = 2 * m.param_count() / 989e12 * 1e3
    assert exercise.check_tpot_floor(compute_ms, verbose=False).problem == \
        "compute, not memory"


# --------------------------------------------------------------------------------- explorer

def test_the_explorer_moves_its_bars_without_rebuilding():
    import matplotlib
    matplotlib.use("Agg")
    from labkit.viz import serving_widgets
    box = serving_widgets.serving_explorer()
    figure_axes = list(box.figure.axes)
    before = box.text.value
    controls = {w.description: w for row in box.children[:2] for w in row.children}
    controls["batch"].value = 256
    assert box.text.value != before and list(box.figure.axes) == figure_axes
    controls["model"].value = "Mixtral 8x7B"      # an MoE model: the EP bar appears
    ylabels = [t.get_text() for t in box.figure.axes[3].get_yticklabels()]
    assert "EP 8" in ylabels and list(box.figure.axes) == figure_axes
    results = serving_widgets.compare("Mixtral 8x7B", 8, "H100 SXM", 256, 2048, "bf16")
    tpots = {f"{t['tpot_s'] * 1e3:.1f} ms/token" for t in results.values() if t}
    assert any(text in box.text.value for text in tpots)    # the text quotes the model's TPOT

"""Serving systems, the rest: prefix sharing in the paged cache (copy-on-write, reference
counts), `run serve` with a draft model and with disaggregated prefill, and `plan --serve
--rate` (the stream scheduler modelled without a model, against the engine's own times)."""
import json
import subprocess
import sys
from functools import partial

import pytest
import torch

from labkit import models
from labkit.parallel import serving
from labkit.parallel.batching import Engine, Request
from labkit.parallel.paged_kv import PagedKVCache
from labkit.parallel.prefix_sharing import shared_prefix_generate
from labkit.theory import catalog, hardware, stream_sim
from labkit.theory import serving_stream as theory


def _ids(n, seed):
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ prefix sharing

def test_shared_blocks_are_counted_and_copied_on_write():
    cache = PagedKVCache(layers=1, kv_width=2, num_blocks=8, block_size=4)
    prompt = torch.arange(12.0).reshape(6, 2)
    assert cache.reserve("sys", 6)
    cache.write(0, "sys", 0, prompt, -prompt)
    cache.share("a", "sys", 6)
    cache.share("b", "sys", 6)
    assert cache.tables["a"] == cache.tables["b"] == cache.tables["sys"]
    assert cache.blocks_used == 2 and cache.refs[cache.tables["sys"][0]] == 3
    with pytest.raises(ValueError, match="shares"):
        cache.write(0, "a", 5, torch.ones(1, 2), torch.ones(1, 2))
    assert cache.reserve("a", 7)            # token 6 lands in the shared half-full block: copy
    assert cache.copies == 1 and cache.tables["a"][0] == cache.tables["sys"][0]
    assert cache.tables["a"][1] != cache.tables["sys"][1]
    cache.write(0, "a", 6, torch.full((1, 2), 99.0), torch.full((1, 2), 99.0))
    k, _ = cache.read(0, "a", 7)
    assert torch.equal(k[:6], prompt) and k[6, 0] == 99
    assert torch.equal(cache.read(0, "sys", 6)[0], prompt)     # the original is untouched
    assert torch.equal(cache.read(0, "b", 6)[0], prompt)
    cache.free("sys")
    cache.free("b")
    assert cache.blocks_used == 2           # a still holds the first block and its copy
    cache.free("a")
    assert cache.blocks_used == 0 and set(cache.refs.values()) == {0}
    with pytest.raises(ValueError, match="paged cache"):
        PagedKVCache.contiguous(1, 2, 8, 16).share("x", "y", 1)


@pytest.mark.parametrize("prefix_len,block_size", [(19, 4), (16, 8)])
def test_prefix_sharing_saves_the_blocks_the_formula_says_and_tokens_equal(prefix_len,
                                                                            block_size):
    model = models.build("gpt", seed=0, seq=48, layers=2).eval()
    prefix, suffixes = _ids(prefix_len, 1), [_ids(n, 10 + n) for n in (3, 7, 1, 5)]
    shared, s = shared_prefix_generate(model, prefix, suffixes, 6, block_size)
    alone, a = shared_prefix_generate(model, prefix, suffixes, 6, block_size, share=False)
    want = [serving.generate(model, torch.cat([prefix, x])[None], 6)[0].tolist()
            for x in suffixes]
    assert shared == alone == want
    # by hand: 4 requests stop holding 4 (or 2) full blocks each, the prefix is held once
    assert theory.prefix_saved_blocks(4, 19, 4) == 4 * 4 - 5
    assert theory.prefix_saved_blocks(4, 16, 8) == 4 * 2 - 2
    saved = a["peak_blocks"] - s["peak_blocks"]
    assert saved == theory.prefix_saved_blocks(4, prefix_len, block_size) > 0
    assert a["peak_bytes"] - s["peak_bytes"] == saved * block_size * 2 * 2 * 64 * 4
    assert s["copies"] == (4 if prefix_len % block_size else 0)
    assert a["prefill_tokens"] - s["prefill_tokens"] == 3 * prefix_len


# ------------------------------------------------------------------------------ plan --serve --rate

LLAMA_H100 = partial(theory.modelled_step_s, catalog.model("llama-3-8b"), hardware.gpu("H100"))


@pytest.mark.parametrize("policy,chunk,blocks", [("static", None, 64), ("continuous", None, 64),
                                                 ("continuous", 5, 64),
                                                 ("continuous", None, 10)])   # preempts
def test_the_simulated_scheduler_keeps_the_engines_times(policy, chunk, blocks):
    """The token-free replay gives every token the time the engine's modelled clock gave it
    (the engine computes the tokens with a real model; the schedule must not depend on them)."""
    model = models.build("gpt", seed=0, seq=48, layers=1).eval()
    rows = theory.poisson_stream(10, 300.0, (3, 20), (6, 14), seed=1)
    reqs = [Request(r["id"], _ids(r["prompt"], r["id"]), r["output"], r["arrival_s"])
            for r in rows]
    done = Engine(model, PagedKVCache(1, 64, blocks, 4), policy, max_num_seqs=4,
                  max_num_batched_tokens=chunk,
                  step_time=LLAMA_H100).run(reqs)
    sim = stream_sim.simulate(rows, LLAMA_H100, policy, 4, chunk, blocks, 4)
    assert [len(r.token_times) for r in sim] == [r.output for r in done]
    flat = [t for r in done for t in r.token_times]
    assert [t for r in sim for t in r.token_times] == pytest.approx(flat, rel=1e-12)
    assert [r.preemptions for r in sim] == [r.preemptions for r in done]
    if blocks == 10:
        assert sum(r.preemptions for r in sim) > 0


def test_plan_stream_orders_the_policies_and_refuses_what_does_not_fit():
    out = stream_sim.plan_stream("llama-3-8b", 2, "H100", rate=20, requests=120, ttft_ms=300,
                                 tpot_ms=40)
    static, continuous, chunked = out["policies"]
    assert out["modelled"] and chunked["chunk"] == stream_sim.CHUNK
    # static batching makes arrivals wait for a whole batch: TTFT and goodput both worse
    assert continuous["latency"]["ttft_s"]["p99"] < static["latency"]["ttft_s"]["p99"]
    assert continuous["goodput"]["requests_per_s"] > static["goodput"]["requests_per_s"]
    # chunks of 512 keep a long prompt from stalling the decodes: the worst gap shrinks
    assert chunked["latency"]["tbt_s"]["p99"] < continuous["latency"]["tbt_s"]["p99"]
    # a decode step reads the weights at least once: TPOT is above weights / HBM bandwidth
    floor = catalog.model("llama-3-8b").param_count() * 2 / hardware.gpu("H100").memory_bw
    assert all(p["latency"]["tpot_s"]["p50"] > floor for p in out["policies"])
    with pytest.raises(ValueError, match="do not fit --gpu-memory-utilization 0.9 of one"):
        stream_sim.plan_stream("llama-3-70b", 8, "H100", rate=5)


def test_cli_plan_serve_rate_json_and_table():
    base = [sys.executable, "-m", "labkit", "plan", "--serve", "--model", "llama-3-8b",
            "--gpus", "1", "--gpu", "H100", "--rate", "5", "--requests", "40",
            "--ttft-ms", "200", "--tpot-ms", "50"]
    out = subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["modelled"] and [p["policy"] for p in r["policies"]] == ["static", "continuous",
                                                                        "continuous"]
    assert all(0 <= p["goodput"]["fraction"] <= 1 for p in r["policies"])
    text = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "modelled" in text.stdout
    bad = subprocess.run(base + ["--fix", "tp=2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--rate" in bad.stderr and "\n" not in bad.stderr.strip()


# ------------------------------------------------------------------------------ run serve modes

def _run_serve(*args):
    out = subprocess.run([sys.executable, "-m", "labkit", "run", "serve", *args, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_cli_speculative_stream_gives_greedy_tokens_and_measures_acceptance():
    r = _run_serve("--requests", "4", "--layers", "3", "--draft-layers", "2", "--draft-len", "3",
                   "--replicas", "2")
    assert r["mode"] == "speculative" and r["world_size"] == 2 and len(r["requests"]) == 4
    assert r["tokens_differing"] == 0 and r["tokens_equal_reference"]
    examined = sum(q["examined"] for q in r["requests"])
    assert r["acceptance"] == sum(q["accepted"] for q in r["requests"]) / examined
    assert 0 < r["acceptance"] <= 1
    # each round checks k proposals in one target forward: more than one token per forward
    assert 1 < r["tokens_per_target_forward"] <= 3 + 1
    assert 1 <= r["tokens_per_round"] <= 3 + 1


def test_cli_disaggregated_stream_sends_the_formulas_kv_bytes():
    r = _run_serve("--requests", "5", "--layers", "2", "--prefill-ranks", "2")
    assert r["mode"] == "disaggregated" and r["world_size"] == 3      # 2 prefill, 1 decode
    assert r["tokens_differing"] == 0
    hidden, layers = 64, 2        # the stream's GPT: hidden 64 (runs/stream.py's default shape)
    for q in r["requests"]:      # keys and values, every layer, every prompt token, float32
        assert q["kv_bytes_sent"] == 2 * layers * hidden * q["prompt"] * 4
    assert r["kv_bytes_equal_formula"]


@pytest.mark.parametrize("args,says", [
    (["--requests", "4", "--draft-layers", "1", "--paged"], "--paged does not apply"),
    (["--requests", "4", "--draft-layers", "1", "--prefill-ranks", "1"], "one at a time"),
    (["--requests", "4", "--prefill-ranks", "0"], "--prefill-ranks must be a positive"),
    (["--requests", "4", "--prefill-ranks", "2", "--world-size", "2"], "runs on 3 ranks"),
    (["--requests", "4", "--prefill-ranks", "1", "--tp", "2"], "--tp does not apply"),
    (["--draft-layers", "1"], "give --requests N"),
    (["--requests", "4", "--draft-len", "2"], "give --draft-layers"),
    (["--requests", "4", "--draft-layers", "4"], "1 to 3 of the model's 4 blocks")])
def test_cli_serve_modes_refuse_in_one_line(capsys, args, says):
    from labkit import cli
    assert cli.main(["run", "serve", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1

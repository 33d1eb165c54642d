"""The serving metrics equal `vllm bench serve`'s on the same timestamps: a re-implementation of
vLLM's benchmarks/serve.py `calculate_metrics` written here from its published definitions
(numpy, from each request's send time and token times), against labkit.theory.serving_metrics
and against every metric `run serve --json` reports; DistServe's goodput over a rate sweep."""
import json
import subprocess
import sys

import numpy as np
import pytest

from labkit.theory import serving_metrics, serving_stream

PCTS = serving_metrics.PERCENTILES


def vllm_calculate_metrics(requests, dur_s, goodput_ms=None, percentiles=PCTS):
    """vLLM's calculate_metrics on requests [{prompt, arrival_s, token_times}] (each output a
    success; ttft, latency and itl as its request function records them)."""
    ttfts, tpots, all_tpots, itls, e2els, outs, total_input = [], [], [], [], [], [], 0
    for r in requests:
        t = np.asarray(r["token_times"], dtype=float)
        ttft, latency = t[0] - r["arrival_s"], t[-1] - r["arrival_s"]
        output_len = len(t)
        outs.append(output_len)
        total_input += r["prompt"]
        tpot = 0
        if output_len > 1:
            tpot = (latency - ttft) / (output_len - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)        # a one-token request counts 0 against the TPOT SLO
        itls += list(np.diff(t))
        ttfts.append(ttft)
        e2els.append(latency)
    good = None
    if goodput_ms:
        valid, slos = [], []
        for key, col in (("ttft", ttfts), ("tpot", all_tpots), ("e2el", e2els)):
            if key in goodput_ms:
                valid.append(col)
                slos.append(goodput_ms[key] / 1000)
        good = sum(all(s >= m for s, m in zip(slos, req)) for req in zip(*valid)) / dur_s
    out = dict(completed=len(requests), total_input_tokens=total_input,
               total_output_tokens=sum(outs), duration=dur_s,
               request_throughput=len(requests) / dur_s, request_goodput=good,
               output_throughput=sum(outs) / dur_s,
               total_token_throughput=(total_input + sum(outs)) / dur_s)
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out[f"mean_{name}_ms"] = np.mean(xs or 0) * 1000
        out[f"std_{name}_ms"] = np.std(xs or 0) * 1000
        out[f"median_{name}_ms"] = np.median(xs or 0) * 1000
        for p in percentiles:
            out[f"p{p}_{name}_ms"] = np.percentile(xs or 0, p) * 1000
    return out


def labkit_metrics(requests, ttft_ms=None, tpot_ms=None):
    records = [dict(r, **serving_stream.request_metrics(r["arrival_s"], r["token_times"],
                                                        len(r["token_times"])),
                    output=len(r["token_times"])) for r in requests]
    gaps = [b - a for r in requests for a, b in zip(r["token_times"], r["token_times"][1:])]
    return serving_stream.summarise(records, ttft_ms, tpot_ms, gaps)


def assert_same(got, want):
    assert set(got) == set(want)
    for key, value in want.items():
        if value is None:
            assert got[key] is None, key
        else:
            assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def _stream(outputs, seed=0):
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for i, n in enumerate(outputs):
        t += rng.exponential(0.05)
        first = t + rng.uniform(0.01, 0.2)
        times = list(first + np.cumsum(np.r_[0, rng.uniform(0.002, 0.03, n - 1)]))
        out.append(dict(id=i, prompt=int(rng.integers(3, 40)), arrival_s=t, token_times=times))
    return out


@pytest.mark.parametrize("outputs", [(5, 1, 9, 1, 3, 1, 7, 1), (1, 1, 1), (6,), (1,),
                                     tuple(range(1, 30))],
                         ids=["half-one-token", "all-one-token", "one-request",
                              "one-request-one-token", "many"])
def test_metrics_equal_vllm_on_the_same_timestamps(outputs):
    reqs = _stream(outputs)
    s = labkit_metrics(reqs, ttft_ms=120, tpot_ms=20)
    duration = max(r["token_times"][-1] for r in reqs)          # from the start, time 0
    assert s["duration_s"] == duration > reqs[0]["arrival_s"]
    assert_same(s["vllm"], vllm_calculate_metrics(reqs, duration, dict(ttft=120, tpot=20)))
    # no SLO given: vLLM counts no goodput; labkit says so (None), the rest unchanged
    plain = labkit_metrics(reqs)
    assert plain["request_goodput"] is None and plain["vllm"]["mean_ttft_ms"] == \
        s["vllm"]["mean_ttft_ms"]


def test_tpot_leaves_out_one_token_requests():
    """Two requests of 1 token and one of 3 (TPOT 10 ms): vLLM's TPOT is 10 ms, not a median
    of 0 (the one-token requests count 0 only against the SLO)."""
    reqs = [dict(prompt=4, arrival_s=0.0, token_times=[0.1]),
            dict(prompt=4, arrival_s=0.0, token_times=[0.2]),
            dict(prompt=4, arrival_s=0.0, token_times=[0.1, 0.11, 0.12])]
    s = labkit_metrics(reqs, tpot_ms=5)
    assert s["latency"]["tpot_s"]["median"] == pytest.approx(0.01)
    assert s["vllm"]["std_tpot_ms"] == pytest.approx(0)
    assert s["request_goodput"] == pytest.approx(2 / 0.2)     # the two one-token requests
    assert s["vllm"]["total_token_throughput"] == pytest.approx((12 + 5) / 0.2)


def test_run_serve_json_reports_vllm_metrics():
    out = subprocess.run([sys.executable, "-m", "labkit", "run", "serve", "--requests", "6",
                          "--rate", "300", "--layers", "1", "--stream-output-len", "1", "4",
                          "--time-model", "llama-3-8b", "--ttft-ms", "40", "--tpot-ms", "8",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    reqs = r["requests"]
    assert r["tokens_differing"] == 0 and len(reqs) == 6 and r["kv_blocks"]["used"] >= 1
    assert any(q["output"] == 1 for q in reqs) and any(q["output"] > 2 for q in reqs)
    duration = max(q["token_times"][-1] for q in reqs)
    want = vllm_calculate_metrics(reqs, duration, dict(ttft=40, tpot=8))
    assert_same(r["metrics"], want)
    assert r["duration_s"] == pytest.approx(duration)
    for key, name in (("requests_per_s", "request_throughput"),
                      ("throughput_tokens_per_s", "output_throughput"),
                      ("total_tokens_per_s", "total_token_throughput"),
                      ("request_goodput", "request_goodput")):
        assert r[key] == pytest.approx(want[name], rel=1e-12), key
    assert 0 <= r["slo"]["attainment"] <= 1
    for key, name in (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("itl_s", "itl"),
                      ("e2e_s", "e2el")):
        for stat, col in (("mean", "mean"), ("median", "median"), ("std", "std"),
                          ("p50", "p50"), ("p99", "p99")):
            assert r["latency"][key][stat] * 1e3 == pytest.approx(
                want[f"{col}_{name}_ms"], rel=1e-12, abs=1e-12), (key, stat)


def test_distserve_goodput_is_the_highest_rate_before_the_attainment_falls():
    sweep = [(1.0, 1.0), (2.0, 0.95), (4.0, 0.9), (8.0, 0.85), (16.0, 0.92)]
    assert serving_metrics.distserve_goodput(sweep) == 4.0
    assert serving_metrics.distserve_goodput(sweep, target=0.96) == 1.0
    assert serving_metrics.distserve_goodput([(1.0, 0.5)]) == 0.0
    recs = [dict(ttft_s=0.1, tpot_s=0.01, e2e_s=0.3), dict(ttft_s=0.3, tpot_s=0.0, e2e_s=0.3)]
    assert serving_metrics.slo_attainment(recs, ttft_ms=200, tpot_ms=20) == 0.5
    with pytest.raises(ValueError, match="target"):
        serving_metrics.distserve_goodput(sweep, target=0)


def test_a_stream_refuses_pipeline_stages_in_one_line():
    bad = subprocess.run([sys.executable, "-m", "labkit", "run", "serve", "--requests", "4",
                          "--pp", "2"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--pp" in bad.stderr

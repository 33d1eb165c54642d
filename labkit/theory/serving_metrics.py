"""What a serving benchmark reports, as `vllm bench serve` computes it (vLLM's
benchmarks/serve.py, `calculate_metrics`), and DistServe's goodput over a rate sweep.

Per request i, from the time it was sent a_i and the times its output tokens arrived
t_i1 <= ... <= t_iO (O_i output tokens):
    TTFT_i = t_i1 - a_i                         (queueing + prefill)
    E2EL_i = t_iO - a_i                         (vLLM's "e2el", end-to-end latency)
    TPOT_i = (E2EL_i - TTFT_i) / (O_i - 1)      only for O_i > 1: a one-token request enters
                                                no TPOT statistic (its TPOT counts as 0 only
                                                when judged against an SLO)
    ITL    = every t_i(k+1) - t_ik, of every request, pooled (inter-token latency; Sarathi-Serve
             calls the same gaps "time between tokens", TBT)
Each of TTFT, TPOT, ITL, E2EL is reported as mean, median, std (numpy's, ddof 0) and
percentiles (numpy's linear interpolation); an empty list reads 0, as vLLM's `np.mean(x or 0)`.
The duration D runs from the benchmark's start (time 0, when the first request may be sent),
not from the first arrival, to the last token: request_throughput = completed / D,
output_throughput = sum O_i / D, total_token_throughput = (sum P_i + sum O_i) / D, and
request_goodput = the requests meeting every SLO given (TTFT_i <= ttft, TPOT_i <= tpot,
E2EL_i <= e2el) / D: vLLM's per-run measure.

DistServe's goodput (Zhong et al. OSDI'24, arXiv 2401.09670) is another quantity: the highest
request rate a system sustains while at least a target share (90 %) of requests meet both SLOs,
read off a sweep of rates (`distserve_goodput`). Plain Python and numpy: no torch.
"""
import math

import numpy as np

PERCENTILES = (50, 90, 99)        # what `vllm bench serve --metric-percentiles` is often given
STATISTICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values, q):
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default);
    nan for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def request_metrics(arrival_s, token_times, output):
    """TTFT, TPOT and end-to-end seconds of one request from the times its tokens appeared;
    a one-token request's tpot_s is 0 (how vLLM judges it against a TPOT SLO)."""
    if len(token_times) != output:
        raise ValueError(f"a request of {output} output tokens has {len(token_times)} times")
    first, last = token_times[0], token_times[-1]
    tpot = (last - first) / (output - 1) if output > 1 else 0.0
    return dict(ttft_s=first - arrival_s, tpot_s=tpot, e2e_s=last - arrival_s)


def meets_slo(record, ttft_ms=None, tpot_ms=None, e2el_ms=None):
    """Whether one request (ttft_s, tpot_s, e2e_s) meets every SLO given, compared as vLLM does
    (limit / 1000 >= seconds)."""
    pairs = (("ttft_s", ttft_ms), ("tpot_s", tpot_ms), ("e2e_s", e2el_ms))
    return all(limit / 1000 >= record[key] for key, limit in pairs if limit is not None)


def _stats(values_s, name, percentiles):
    xs = np.asarray(values_s or 0, dtype=float)
    out = {f"mean_{name}_ms": float(np.mean(xs)) * 1000,
           f"median_{name}_ms": float(np.median(xs)) * 1000,
           f"std_{name}_ms": float(np.std(xs)) * 1000}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(xs, p)) * 1000
    return out


def calculate_metrics(records, itls, duration_s, ttft_ms=None, tpot_ms=None, e2el_ms=None,
                      percentiles=PERCENTILES):
    """vLLM's benchmark metrics, under vLLM's names, of finished requests `records` (each with
    output, ttft_s, tpot_s, e2e_s and, for the token totals, prompt) whose inter-token gaps are
    `itls` (seconds), over `duration_s` from the benchmark's start."""
    if not records:
        raise ValueError("no finished request to measure")
    if not duration_s > 0:
        raise ValueError(f"the benchmark's duration must be positive, got {duration_s!r}")
    outputs = [r["output"] for r in records]
    total_input = sum(r.get("prompt", 0) for r in records)
    good = sum(meets_slo(r, ttft_ms, tpot_ms, e2el_ms) for r in records)
    out = dict(completed=len(records), total_input_tokens=total_input,
               total_output_tokens=sum(outputs), duration=duration_s,
               request_throughput=len(records) / duration_s,
               request_goodput=good / duration_s if (ttft_ms, tpot_ms, e2el_ms) != (None,) * 3
               else None,
               output_throughput=sum(outputs) / duration_s,
               total_token_throughput=(total_input + sum(outputs)) / duration_s)
    columns = dict(ttft=[r["ttft_s"] for r in records],
                   tpot=[r["tpot_s"] for r in records if r["output"] > 1],
                   itl=list(itls), e2el=[r["e2e_s"] for r in records])
    for name in STATISTICS:
        out.update(_stats(columns[name], name, percentiles))
    return out


def summarise(records, ttft_ms=None, tpot_ms=None, gaps=(), start_s=0.0):
    """labkit's summary of finished requests (each a dict with arrival_s, output, ttft_s,
    tpot_s, e2e_s, optionally prompt), `gaps` the inter-token gaps of all of them, the
    benchmark started at `start_s`: latency{ttft_s, tpot_s, e2e_s, and with gaps itl_s (and
    tbt_s, the same gaps under Sarathi-Serve's name) -> {mean, median, std, p50, p99}} in
    seconds, duration_s, requests_per_s, throughput_tokens_per_s (output tokens),
    total_tokens_per_s, request_goodput (vLLM's, req/s, None without an SLO), goodput{
    requests_per_s, fraction, ttft_ms, tpot_ms} (the same count, with the share of requests
    meeting the SLOs) and vllm (calculate_metrics' flat dict, vLLM's names and units)."""
    duration = max(r["arrival_s"] + r["e2e_s"] for r in records) - start_s
    vllm = calculate_metrics(records, gaps, duration, ttft_ms, tpot_ms)
    names = dict(ttft_s="ttft", tpot_s="tpot", e2e_s="e2el")
    if gaps:
        names.update(itl_s="itl", tbt_s="itl")
    latency = {key: dict(mean=vllm[f"mean_{n}_ms"] / 1e3, median=vllm[f"median_{n}_ms"] / 1e3,
                         std=vllm[f"std_{n}_ms"] / 1e3, p50=vllm[f"p50_{n}_ms"] / 1e3,
                         p99=vllm[f"p99_{n}_ms"] / 1e3) for key, n in names.items()}
    ok = sum(meets_slo(r, ttft_ms, tpot_ms) for r in records)
    return dict(latency=latency, duration_s=duration,
                requests_per_s=vllm["request_throughput"],
                throughput_tokens_per_s=vllm["output_throughput"],
                total_tokens_per_s=vllm["total_token_throughput"],
                request_goodput=vllm["request_goodput"],
                goodput=dict(requests_per_s=ok / duration, fraction=ok / len(records),
                             ttft_ms=ttft_ms, tpot_ms=tpot_ms),
                vllm=vllm)


def slo_attainment(records, ttft_ms, tpot_ms):
    """The share of requests meeting both SLOs (DistServe's SLO attainment)."""
    return sum(meets_slo(r, ttft_ms, tpot_ms) for r in records) / len(records)


def distserve_goodput(sweep, target=0.9):
    """DistServe's goodput from a rate sweep [(rate, SLO attainment)]: the highest rate at
    which at least `target` of the requests meet both SLOs, read up the sweep until the first
    rate that falls short (a noisy pass above it does not count); 0.0 if the lowest falls
    short."""
    if not 0 < target <= 1:
        raise ValueError(f"target must be a share in (0, 1], got {target!r}")
    best = 0.0
    for rate, attained in sorted(sweep):
        if attained < target:
            break
        best = rate
    return best

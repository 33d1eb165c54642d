"""Request streams and what a serving system is judged by; the KV memory of contiguous and paged
caches; the prefill buffer chunking saves. Plain Python (no torch): the lesson, the driver and
the tests share these formulas.

A stream: requests with a prompt length P_i, an output length O_i and an arrival time a_i
(Poisson at rate r: gaps ~ Exp(r), seeded; or a trace file). Per request (as vLLM's benchmarks
and DistServe, Zhong et al. OSDI'24, arXiv 2401.09670, define them):
    TTFT_i = first token time - a_i          (queueing + prefill)
    TPOT_i = (finish_i - first_i) / (O_i - 1) (time per output token after the first)
    E2E_i  = finish_i - a_i
throughput = sum O_i / (last finish - the benchmark's start); vLLM's request_goodput = requests
per second that meet both SLOs; the whole list, as `vllm bench serve` reports it, and
DistServe's goodput (a rate) are in serving_metrics.py.

KV memory (Kwon et al. SOSP'23, "vLLM / PagedAttention", arXiv 2309.06180). One token's keys
and values cost kv = 2 x layers x kv_width x bytes. A contiguous cache reserves the maximum
length L_max per request (the output length is unknown at admission): wasted
(L_max - len_i) x kv. A paged cache hands out blocks of B tokens as the sequence grows: wasted
(ceil(len_i / B) x B - len_i) x kv < B x kv per request (internal fragmentation only).

Chunked prefill (Agrawal et al. OSDI'24, "Sarathi-Serve", arXiv 2403.02310): a prompt of P
tokens is cut into chunks of C that ride along with decode steps; a step then carries at most
C prefill tokens, so a decode step is never stalled by a whole prompt, and the transient
buffers a forward needs scale with C instead of P (modelled here: the widest per-layer
intermediate, the MLP's gate and up projections, 2 x ffn x tokens x bytes, plus the qkv rows).
"""
import csv
import json
import math
import random
from pathlib import Path

from . import pricing, serving as model_serving, serving_metrics


# ------------------------------------------------------------------------------ the stream

def poisson_stream(n, rate, prompt_len=(8, 32), output_len=(4, 16), seed=0):
    """n requests arriving as a Poisson process of `rate` per second (exponential gaps), the
    lengths uniform in the inclusive (low, high) ranges; the same seed, the same stream."""
    if n < 1:
        raise ValueError(f"--requests must be at least 1, got {n}")
    if not rate > 0:
        raise ValueError(f"--rate must be a positive number of requests per second, got {rate}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range ({lo}, {hi}) must satisfy 1 <= low <= high")
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(dict(id=i, prompt=rng.randint(*prompt_len), output=rng.randint(*output_len),
                        arrival_s=t))
    return out


def read_trace(path):
    """A stream from a CSV (columns arrival_s, prompt, output) or a JSON list of such dicts,
    sorted by arrival and numbered in that order."""
    path = Path(path)
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
    else:
        with path.open() as f:
            rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        missing = {"arrival_s", "prompt", "output"} - set(row)
        if missing:
            raise ValueError(f"trace {path.name}: a row lacks {sorted(missing)}")
        out.append(dict(prompt=int(row["prompt"]), output=int(row["output"]),
                        arrival_s=float(row["arrival_s"])))
    out.sort(key=lambda r: r["arrival_s"])
    return [dict(r, id=i) for i, r in enumerate(out)]


# ------------------------------------------------------------------------------ the metrics

def percentile(values, q):
    """The q-th percentile (0..100), numpy's linear interpolation (serving_metrics.percentile)."""
    return serving_metrics.percentile(values, q)


def request_metrics(arrival_s, token_times, output):
    """TTFT, TPOT and end-to-end seconds of one request (serving_metrics.request_metrics)."""
    return serving_metrics.request_metrics(arrival_s, token_times, output)


def summarise(records, ttft_ms=None, tpot_ms=None, gaps=(), start_s=0.0):
    """Latency percentiles, throughputs and vLLM's request_goodput of finished requests, as
    `vllm bench serve` computes them: serving_metrics.summarise."""
    return serving_metrics.summarise(records, ttft_ms, tpot_ms, gaps, start_s)


# ------------------------------------------------------------------------------ KV memory

def kv_bytes_per_token(layers, kv_width, bytes_per_value=4):
    """Keys and values of one token in every layer: 2 x layers x kv_width x bytes."""
    return 2 * layers * kv_width * bytes_per_value


def blocks_needed(tokens, block_size):
    return -(-tokens // block_size)


def paged_waste_tokens(lengths, block_size):
    """Token slots allocated but unused by a paged cache: the last block's tail per request."""
    return sum(blocks_needed(n, block_size) * block_size - n for n in lengths)


def contiguous_waste_tokens(lengths, max_len):
    """Token slots reserved but unused by a cache that reserves max_len per request."""
    return sum(max_len - n for n in lengths)


def prefix_saved_blocks(requests, prefix_len, block_size):
    """Blocks n requests sharing a P-token prefix hold fewer than if each held its own copy
    (vLLM's copy-on-write sharing, arXiv 2309.06180): each stops holding floor(P / B) full
    blocks, the prefix is kept once (ceil(P / B) blocks), and a partly filled last block is
    copied by each request that writes into it, so it saves nothing."""
    return requests * (prefix_len // block_size) - blocks_needed(prefix_len, block_size)


def requests_that_fit(budget_tokens, length, *, max_len=None, block_size=None):
    """How many requests of `length` tokens fit in `budget_tokens` token slots: contiguous
    (each reserves max_len) or paged (each takes ceil(length / B) blocks)."""
    if (max_len is None) == (block_size is None):
        raise ValueError("give exactly one of max_len (contiguous) or block_size (paged)")
    if block_size is not None:
        return (budget_tokens // block_size) // blocks_needed(length, block_size)
    return budget_tokens // max_len


# ------------------------------------------------------------------------------ chunked prefill

def prefill_buffer_bytes(tokens, hidden, ffn, kv_heads, heads, bytes_per_value=2, gated=True):
    """Modelled transient bytes of one layer's forward over `tokens` rows (weights and KV cache
    excluded): the MLP's intermediate (2 x ffn for a gated SwiGLU MLP, else ffn) plus the q, k,
    v rows (hidden x (1 + 2 kv_heads / heads)), x bytes. Attention scores are not held (a fused
    attention kernel streams them: FlashAttention, Dao et al. 2022)."""
    qkv = hidden * (1 + 2 * kv_heads / heads)
    return tokens * ((2 if gated else 1) * ffn + qkv) * bytes_per_value


def decode_stall_tokens(prompt_len, chunk=None):
    """Prefill tokens the running decodes wait behind in one step: the whole prompt without
    chunking, at most `chunk` with it (Sarathi-Serve's stall-free batching)."""
    return prompt_len if chunk is None else min(chunk, prompt_len)


# ------------------------------------------------------------------------------ a modelled step

def modelled_step_s(model, gpu, pieces, weights="bf16", kv_dtype="bf16", execution="graph"):
    """Modelled seconds of one ragged step of `model` (a catalog ModelShape) on one `gpu`
    (hardware.GPU): pieces = [(new tokens, tokens already cached)] of the requests in it.
    The same price as serving.serving_time's (lesson 09): pricing.serving_pass, kernel by
    kernel, max(compute, weights and KV bytes / sustained HBM bandwidth) + launches, or the
    host's enqueueing when it is slower (`execution="enqueue"`: pricing.step_total)."""
    return pricing.serving_pass(model, gpu, list(pieces), weights=weights,
                                kv_dtype=kv_dtype, execution=execution)["total"]


# ------------------------------------------------------------------------------ disaggregation

def kv_transfer_s(model, prompt_len, link, kv_dtype="bf16"):
    """Modelled seconds to send one request's prompt KV from the prefill GPU to the decode GPU
    (DistServe, arXiv 2401.09670): layers x 2 x kv_heads x head_dim x P x bytes over the link's
    effective bandwidth, plus its latency (alpha-beta)."""
    bytes_ = model_serving.kv_bytes_per_token(model, kv_dtype) * prompt_len
    return link.latency + bytes_ / link.effective_bandwidth

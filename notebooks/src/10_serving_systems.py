# ---
# jupyter:
#   jupytext:
#     formats: ipynb,src//py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · Serving systems: requests that come and go
#
# Lesson 09 served one batch: every request started together and stopped together. A real
# server (vLLM, SGLang, TensorRT-LLM) sees **requests that arrive one by one**, with prompts and
# answers of every length, and is judged per request, by the numbers `vllm bench serve` prints
# (labkit computes them as it does: `labkit.theory.serving_metrics`, tested against a
# re-implementation of vLLM's `calculate_metrics`):
# - **TTFT**, time to first token: waiting in the queue + the prefill of the prompt;
# - **TPOT**, time per output token after the first, (E2EL - TTFT) / (output - 1), over the
#   requests of more than one output token; and **ITL**, the inter-token latency: every gap
#   between two tokens of a request, pooled (Sarathi-Serve calls it the time between tokens; its
#   worst case a user sees as a stutter);
# - **E2EL**, the end-to-end latency; each as mean, median, std and p99 (the tails, not only
#   the average);
# - **throughput**: requests, output tokens and all tokens per second, over the benchmark's
#   duration from its start; vLLM's **request_goodput**: requests per second that meet both a
#   TTFT and a TPOT limit. DistServe (Zhong et al. OSDI'24) calls *goodput* something else: the
#   highest request rate at which 90% of requests meet both limits (section 3).
#
# Three ideas turn lesson 09's generator into such a server:
# 1. **continuous batching** (Orca, Yu et al. OSDI'22): the batch is re-formed at *every decode
#    step*; finished requests leave and waiting ones join, instead of waiting for the whole
#    batch to finish;
# 2. a **paged KV cache** (vLLM, Kwon et al. SOSP'23): the cache in fixed-size blocks handed out
#    as a sequence grows, a block table per request, instead of reserving the maximum length;
# 3. **a token budget per step with chunked prefill** (Sarathi-Serve, Agrawal et al. OSDI'24;
#    vLLM's `max_num_batched_tokens`): a step carries at most that many tokens, decodes
#    included, and a long prompt is cut into chunks that ride along with the decode steps, so
#    it never stalls the running requests.
#
# In `labkit`: `labkit.parallel.batching.Engine` (the scheduler and one ragged forward per
# step), `labkit.parallel.paged_kv.PagedKVCache`, the driver `labkit.runs.stream` (also
# `python -m labkit run serve --requests N --rate R --paged --max-num-batched-tokens C`), and
# the formulas in `labkit.theory.serving_stream`; `python -m labkit plan --serve --rate R
# --ttft-ms X --tpot-ms Y` models each policy for a real model on an H100. Every request's
# tokens are checked against the same request served alone on one device with lesson 09's
# `generate`.

# %%
import math

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Markdown, display

from labkit.exercises.serving_systems import (check_gather_blocks, check_requests_that_fit,
                                              check_wasted_bytes, show_solution)
from labkit.runs import stream
from labkit.runs.stream import StreamConfig, serve_locally
from labkit.theory import catalog, hardware
from labkit.theory import serving as model_serving
from labkit.theory import serving_stream as theory
from labkit.viz.stream_widgets import stream_explorer, stream_figure

pd.set_option("display.precision", 2)
torch.set_num_threads(1)   # tiny models: one thread beats two here
LLAMA = catalog.model("llama-3-8b")

# %% [markdown]
# ## 1 · A request stream
#
# Requests arrive as a Poisson process: the gaps between arrivals are exponential with mean
# 1/rate, drawn from a seed (the same seed, the same stream; `read_trace` reads a recorded one).
# Each has a prompt length and an output length.

# %%
requests = theory.poisson_stream(12, rate=100, prompt_len=(8, 32), output_len=(4, 16), seed=0)
pd.DataFrame(requests).set_index("id").T

# %% [markdown]
# ## 2 · Served on two CPU ranks, every token checked
#
# Two replicas (each rank serves the requests whose id is its own modulo 2), first with
# **static** batching (a batch is taken when the server is idle and runs until its last request
# is done), then with **continuous** batching. Latencies here are *measured* wall seconds on
# this machine's CPU ranks: a tiny model, so mostly Python overhead, and noisy.

# %%
measured = {policy: stream.report(StreamConfig(requests=12, rate=100, replicas=2,
                                               policy=policy, model_kwargs=dict(layers=2)))
            for policy in ("static", "continuous")}
pd.DataFrame({p: {"tokens differing from alone": r["tokens_differing"],
                  "TTFT p50 (ms)": r["latency"]["ttft_s"]["p50"] * 1e3,
                  "TTFT p99 (ms)": r["latency"]["ttft_s"]["p99"] * 1e3,
                  "E2E p99 (ms)": r["latency"]["e2e_s"]["p99"] * 1e3,
                  "output tokens/s": r["throughput_tokens_per_s"]}
              for p, r in measured.items()}).T.rename_axis("measured on 2 CPU ranks")

# %% [markdown]
# Every request got exactly the tokens it gets when served alone (`tokens differing` is 0),
# although in the continuous run it shared its steps with different neighbours at every token:
# attention runs per request against its own keys and values, and only the row-wise layers
# (Linear, LayerNorm, MLP) see the whole step's tokens at once. Its *logits* are not bit for bit
# those of the request alone, though: a matrix product over more rows may add in another
# order. The cell below measures the largest difference on a batch of three, and the narrowest
# margin between a request's best and second-best token.

# %%
from labkit.models import build
from labkit.parallel.paged_kv import batch_logits

gpt = build("gpt", seed=0, seq=48, layers=2).eval()
seqs = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
        for n in (9, 14, 5)]
together, alone_rows = batch_logits(gpt, seqs)     # next-token logits, batched and alone
margin = together.topk(2).values.diff(dim=-1).abs().min()
print(f"largest |logit alone - logit batched|: {(together - alone_rows).abs().max():.1e}; "
      f"narrowest top-1 margin: {margin:.2f}; same tokens: "
      f"{torch.equal(together.argmax(-1), alone_rows.argmax(-1))}")

# %% [markdown]
# Differences at the float32 rounding level cannot flip a token whose lead is that wide. On GPUs
# in bf16 the kernels pick their tiling by batch size, the differences are larger, and a close
# race between two tokens can go the other way: a request's text can then change with its
# neighbours. vLLM documents a batch-invariant mode (`VLLM_BATCH_INVARIANT=1`: kernels whose
# reduction order does not depend on the batch), at some speed; SGLang has a deterministic
# inference mode for the same reason.
#
# ## 3 · Static vs continuous on a modelled GPU
#
# Wall time on a shared CPU says little about a GPU server. The same engine can advance a
# *modelled* clock instead: each step takes the roofline time of Llama 3 8B on one H100
# (weights read once per step, plus the FLOPs of the step's tokens), while the tokens are still
# computed here by the tiny model. The scheduling decisions are then those the server would
# make on that GPU. vLLM's `request_goodput` counts the requests per second that meet both
# limits, here a TTFT of at most `TTFT_MS` and a TPOT of at most `TPOT_MS` (set in the cell);
# at most `max_num_seqs` = 8 requests run at once.

# %%
TTFT_MS, TPOT_MS = 200, 10          # the service's limits: first token, then each token
base = dict(requests=24, rate=400, prompt_len=(16, 64), output_len=(4, 40),
            model_kwargs=dict(layers=2), time_model="llama-3-8b", paged=True, block_size=16)
runs = {p: serve_locally(StreamConfig(policy=p, max_num_seqs=8, ttft_ms=TTFT_MS, tpot_ms=TPOT_MS,
                                      **base))[:2]
        for p in ("static", "continuous")}
table = pd.DataFrame({p: {"TTFT p50 (ms)": s["latency"]["ttft_s"]["p50"] * 1e3,
                          "TTFT p99 (ms)": s["latency"]["ttft_s"]["p99"] * 1e3,
                          "E2E p99 (ms)": s["latency"]["e2e_s"]["p99"] * 1e3,
                          "output tokens/s": s["throughput_tokens_per_s"],
                          "request_goodput (req/s)": s["request_goodput"],
                          "within both limits (%)": 100 * s["goodput"]["fraction"]}
                      for p, (_, s) in runs.items()}).T.rename_axis("modelled: Llama 3 8B, H100")
table

# %%
fig = stream_figure(runs, source="modelled (Llama 3 8B on one H100)")
fig.savefig("/tmp/10_static_vs_continuous.png", dpi=80)

# %%
s, c = table.loc["static"], table.loc["continuous"]
display(Markdown(
    f"Static batching keeps arrivals waiting until the whole batch is done: p99 TTFT "
    f"{s['TTFT p99 (ms)']:.0f} ms against {c['TTFT p99 (ms)']:.0f} ms with continuous "
    f"batching ({s['TTFT p99 (ms)'] / c['TTFT p99 (ms)']:.1f}×, modelled), and "
    f"{c['output tokens/s'] / s['output tokens/s']:.2f}× the throughput, because a slot freed "
    f"by a short answer is refilled at the next step instead of idling. Goodput (TTFT ≤ "
    f"{TTFT_MS} ms and TPOT ≤ {TPOT_MS} ms), vLLM's request_goodput: "
    f"{s['request_goodput (req/s)']:.1f} requests/s "
    f"static ({s['within both limits (%)']:.0f}% of them within both limits) against "
    f"{c['request_goodput (req/s)']:.1f} continuous ({c['within both limits (%)']:.0f}%)."))


def p99_between_last_two(n):
    """Where the p99 of n values lies (linear interpolation, numpy's rule) between the
    second-worst and the worst value: 0 at the second-worst, 1 at the worst."""
    position = (n - 1) * 0.99
    return position - math.floor(position) if n < 100 else float("nan")


served = len(measured["continuous"]["requests"])
display(Markdown(
    f"A p99 needs 100 requests to have a tail: over fewer, it is in effect the worst request. "
    f"With {served} requests (section 2) the p99 lies {p99_between_last_two(served):.0%} of "
    f"the way from the second-worst request to the worst, with {base['requests']} (here) "
    f"{p99_between_last_two(base['requests']):.0%}: these p99 columns read the slowest "
    f"request or two, so one unlucky request moves them."))

# %% [markdown]
# ### SLO attainment against rate: DistServe's goodput
#
# `request_goodput` is a property of one run at one rate. DistServe asks another question: how
# fast may requests arrive before fewer than 90% of them meet both limits? Its goodput is that
# rate, read off a sweep. The sweep below needs many long streams, so it runs the engine's
# scheduler without a model (`labkit.theory.stream_sim.simulate`: the same scheduling rule on
# token counts, each step timed as above; tested step for step against the engine): Llama 3 8B
# on one H100, 150 requests per rate, prompts of 128 to 1,024 tokens, answers of 32 to 256, at
# most 32 running; limits TTFT ≤ 1 s and TPOT ≤ 20 ms.

# %%
from functools import partial

from labkit.theory import serving_metrics, stream_sim

SWEEP_TTFT_MS, SWEEP_TPOT_MS, RATES = 1000, 20, list(range(1, 21))
h100_step = partial(theory.modelled_step_s, LLAMA, hardware.gpu("H100"))
settings = {"static": ("static", None), "continuous, no token budget": ("continuous", None),
            "continuous, max_num_batched_tokens 256": ("continuous", 256)}
attainment, misses = {}, {}
for name, (policy, budget) in settings.items():
    for rate in RATES:
        rows = theory.poisson_stream(150, rate, (128, 1024), (32, 256), seed=0)
        done = stream_sim.simulate(rows, h100_step, policy, 32, budget, 30_000, 16)
        records = [dict(arrival_s=r.arrival_s, output=r.output, **theory.request_metrics(
            r.arrival_s, r.token_times, r.output)) for r in done]
        attainment[name, rate] = serving_metrics.slo_attainment(records, SWEEP_TTFT_MS,
                                                                SWEEP_TPOT_MS)
        misses[name, rate] = (  # the share of requests over each limit
            sum(r["ttft_s"] * 1e3 > SWEEP_TTFT_MS for r in records) / len(records),
            sum(r["tpot_s"] * 1e3 > SWEEP_TPOT_MS for r in records) / len(records))
fig, ax = plt.subplots(figsize=(7, 4.4))
goodputs = {}
for name in settings:
    sweep = [(rate, attainment[name, rate]) for rate in RATES]
    goodputs[name] = serving_metrics.distserve_goodput(sweep)
    ax.plot(RATES, [100 * a for _, a in sweep], marker="o", ms=3,
            label=f"{name}: goodput {goodputs[name]:g} req/s")
ax.axhline(90, color="grey", ls="--", lw=1)
ax.set_xlabel("request rate (req/s)")
ax.set_ylabel("requests within both limits (%)")
ax.set_title(f"SLO attainment, TTFT ≤ {SWEEP_TTFT_MS} ms and TPOT ≤ {SWEEP_TPOT_MS} ms "
             "(modelled: Llama 3 8B, H100)", fontsize=9)
ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16))
fig.tight_layout()
fig.savefig("/tmp/10_slo_attainment.png", dpi=80)
print("DistServe's goodput (highest rate of the sweep before attainment falls below 90%): "
      + "; ".join(f"{k}: {v:g} req/s" for k, v in goodputs.items()))

# %%
top = RATES[-1]
display(Markdown(
    "At the lowest rate, requests within both limits: " + ", ".join(
        f"{k} {100 * attainment[k, RATES[0]]:.0f}%" for k in settings)
    + f". At {top} req/s, the share over the TTFT limit and over the TPOT limit: " + "; ".join(
        f"{k} {100 * misses[k, top][0]:.0f}% and {100 * misses[k, top][1]:.0f}%"
        for k in settings)
    + ". Static batching makes arrivals wait for a whole batch. With continuous batching the "
    "queue grows with the rate, so TTFT fails first"
    + (": no request of the sweep misses the TPOT limit" if all(
        misses[k, r][1] == 0 for k in settings for r in RATES) else ", then TPOT")
    + ". The token budget moves DistServe's goodput from "
    f"{goodputs['continuous, no token budget']:g} to "
    f"{goodputs['continuous, max_num_batched_tokens 256']:g} req/s here; its effect on the "
    "time between tokens is section 5's."))

# %% [markdown]
# ## 4 · A paged KV cache
#
# A cache that gives each request one contiguous region must reserve the **maximum length** at
# admission (the answer's length is unknown). The paged cache hands out blocks of B tokens as
# the sequence grows: at most B - 1 slots wasted per request. Below, both caches get the same
# bytes (384 token slots per rank), the batch limit is lifted, and the stream is served; what is
# measured is how many requests ran at once and what fraction of the reserved slots held
# nothing, averaged over the steps.

# %%
# seed 3: a stream whose mean final length is no multiple of 16 (at a multiple, blocks of 16
# and of 4 would waste the same in theory)
fit = dict(base, requests=24, rate=2000, max_num_seqs=64, kv_tokens=384, seed=3)
caches = {}
for name, kw in (("contiguous (max length)", dict(paged=False)),
                 ("paged, blocks of 16", dict(paged=True, block_size=16)),
                 ("paged, blocks of 4", dict(paged=True, block_size=4))):
    records, summary, engine = serve_locally(StreamConfig(**dict(fit, **kw)))
    caches[name] = {
        "peak requests running": max(st["batch"] for st in engine.steps),
        "reserved but unused (mean, %)": 100 * stream.kv_summary(engine.steps)[
            "wasted_fraction"],
        "TTFT p99 (ms, modelled)": summary["latency"]["ttft_s"]["p99"] * 1e3}
caches = pd.DataFrame(caches).T.rename_axis("same 384 token slots (measured)")
caches

# %%
seq = StreamConfig(**fit).gpt_config().seq
mean_len = round(sum(r["prompt"] + r["output"] for r in StreamConfig(**fit).stream()) / 24)
held = {b: theory.blocks_needed(mean_len, b) * b for b in (16, 4)}   # slots a request holds
display(Markdown(
    f"Theory for requests of the mean final length, {mean_len} tokens: the contiguous cache "
    f"reserves {seq} slots each (the model's maximum), so "
    f"{theory.requests_that_fit(384, mean_len, max_len=seq)} fit in 384 slots; in blocks of 16 "
    f"a request holds {held[16]} slots and {theory.requests_that_fit(384, mean_len, block_size=16)}"
    f" fit, in blocks of 4 it holds {held[4]} and "
    f"{theory.requests_that_fit(384, mean_len, block_size=4)} fit. Measured above: "
    f"{caches.iloc[0, 0]:.0f}, {caches.iloc[1, 0]:.0f} and {caches.iloc[2, 0]:.0f} at the peak "
    f"(requests are shorter while they grow, so more fit than at their final length; when the "
    f"blocks run out the newest request is preempted and recomputed later)."))

# %% [markdown]
# ### Sharing a system prompt: the paper's way
#
# Requests of one application often begin with the same system prompt. With blocks, they can
# share its keys and values. The PagedAttention paper (vLLM 2023, section 4.4) does it
# explicitly: the prompt is prefilled once, every request's block table points at its blocks,
# and each block counts the tables holding it (it returns to the pool at 0). A request about to
# write into a block others hold first copies it (**copy-on-write**), so nobody's keys change
# under anyone else. n requests sharing a P-token
# prefix in blocks of B hold n·⌊P/B⌋ − ⌈P/B⌉ blocks fewer. Measured below: 6 requests, a
# 30-token system prompt, blocks of 8, each request's tokens against it served alone.

# %%
from labkit.parallel.prefix_sharing import shared_prefix_generate
from labkit.parallel.serving import generate

gpt = build("gpt", seed=0, seq=48, layers=2).eval()
ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(0))
system, questions = ids[:30], [ids[30 + 5 * i:33 + 5 * i + i % 3] for i in range(6)]
alone = [generate(gpt, torch.cat([system, q])[None], 8)[0].tolist() for q in questions]
sharing = {}
for share in (False, True):
    tokens, st = shared_prefix_generate(gpt, system, questions, 8, block_size=8, share=share)
    sharing["shared prefix" if share else "each its own copy"] = {
        "peak blocks": st["peak_blocks"], "peak KV bytes": st["peak_bytes"],
        "prefill tokens": st["prefill_tokens"], "blocks copied on write": st["copies"],
        "tokens equal alone": tokens == alone}
sharing = pd.DataFrame(sharing).T.rename_axis("6 requests, 30-token prompt (measured)")
display(sharing)
print(f"blocks saved: measured {sharing.iloc[0, 0] - sharing.iloc[1, 0]}, formula "
      f"{theory.prefix_saved_blocks(6, 30, 8)} (6 x floor(30/8) - ceil(30/8))")

# %% [markdown]
# ### Automatic prefix caching: vLLM v1's way
#
# Today's vLLM finds shared prefixes by itself. Every *full* block is named by a chained hash,
# h_i = H(h_(i-1), its B token ids), so two blocks with one name hold the keys of one prefix.
# A new request first looks its prompt's blocks up, in order, and takes the longest run already
# cached: those tokens are hits and are not prefilled again. A finished request's blocks go back
# to the free queue but keep their names, so a later request can still hit them; a block is
# evicted only when the pool hands it out again, least recently freed first. (SGLang keeps the
# same prefixes in a radix tree, RadixAttention.) Below: 16 requests that all begin with one
# system prompt of 384 tokens, then 16 to 64 tokens of their own, served with and without
# prefix caching (`enable_prefix_caching`), blocks of 16, Llama 3 8B's time on an H100.

# %%
SYSTEM = 384
shared = dict(base, requests=16, rate=10, prompt_len=(SYSTEM + 16, SYSTEM + 64),
              output_len=(8, 24), max_num_seqs=8, shared_prefix=SYSTEM, block_size=16)
caching = {}
for on in (False, True):
    records, summary, engine = serve_locally(StreamConfig(enable_prefix_caching=on, **shared))
    stats = engine.cache.prefix_stats()
    caching["prefix caching" if on else "no prefix caching"] = {
        "hit rate (%, measured)": 100 * stats["hit_rate"],
        "prefill tokens saved (measured)": stats["prefill_tokens_saved"],
        "tokens computed (measured)": sum(st["tokens"] for st in engine.steps),
        "TTFT median (ms, modelled)": summary["latency"]["ttft_s"]["median"] * 1e3,
        "TTFT p99 (ms, modelled)": summary["latency"]["ttft_s"]["p99"] * 1e3}
caching = pd.DataFrame(caching).T.rename_axis("16 requests, one 384-token system prompt")
display(caching)
prompts_total = sum(r["prompt"] for r in StreamConfig(**shared).stream())
formula = 15 * (SYSTEM // 16) * 16 / prompts_total
print(f"hit rate if each request after the first finds the system prompt's "
      f"{SYSTEM // 16} full blocks cached: 15 x {SYSTEM // 16 * 16} / {prompts_total:,} prompt "
      f"tokens = {100 * formula:.1f}%; measured {caching.iloc[1, 0]:.1f}%")

# %%
off, on = caching.iloc[0], caching.iloc[1]
display(Markdown(
    f"The first request prefills the system prompt; the later ones find its blocks cached (one "
    f"arriving while the first is still prefilling would find fewer). Each hit is a prompt "
    f"token not computed again: {on['tokens computed (measured)']:,.0f} tokens computed "
    f"instead of {off['tokens computed (measured)']:,.0f}. The median TTFT falls from "
    f"{off['TTFT median (ms, modelled)']:.1f} to {on['TTFT median (ms, modelled)']:.1f} ms "
    f"(modelled), less than the tokens do: on an H100 a step of a few hundred tokens is still "
    f"mostly the read of the weights, which a hit does not save. The longer the shared prompt, "
    f"the more of the prefill's compute it removes."))

# %% [markdown]
# ## 5 · A token budget per step: chunked prefill
#
# When a long prompt joins, its whole prefill runs in one step, and every running request waits
# for it: their inter-token latency (ITL) jumps. vLLM bounds each step by a token budget,
# `max_num_batched_tokens`, that counts the step's decode tokens *and* its prompt tokens (as
# Sarathi-Serve's budget does): the decodes are scheduled first, one token each, and with
# chunked prefill (`enable_chunked_prefill`) a prompt is cut to what they leave of the budget,
# one chunk per step; without it a prompt waits until it fits a step whole. Prompts of 100 to
# 400 tokens here, modelled on Llama 3 8B on an H100; the cell below prints what a decode step
# of 8 requests costs there and what a 400-token prefill in the same step adds (the step takes
# the larger of its compute and its memory time, so the prefill's FLOPs first fill the time
# the weights take to read).

# %%
h100 = hardware.gpu("H100")
decodes = [(1, 250)] * 8                       # 8 requests decoding, 250 tokens cached each
alone_s = theory.modelled_step_s(LLAMA, h100, decodes)
with_prefill_s = theory.modelled_step_s(LLAMA, h100, decodes + [(400, 0)])
print(f"decode step of 8 (reads {LLAMA.param_count() * 2 / 1e9:.1f} GB of bf16 weights): "
      f"{alone_s * 1e3:.2f} ms; with a 400-token prefill in it: {with_prefill_s * 1e3:.2f} ms, "
      f"+{(with_prefill_s - alone_s) * 1e3:.2f} ms (modelled)")

# %%
long = dict(base, requests=16, rate=200, prompt_len=(100, 400), output_len=(16, 32),
            max_num_seqs=8)
budgets = {"no budget, whole prompts": dict(),
           "budget 512, whole prompts": dict(max_num_batched_tokens=512,
                                             enable_chunked_prefill=False),
           "budget 64, chunked": dict(max_num_batched_tokens=64),
           "budget 16, chunked": dict(max_num_batched_tokens=16)}
chunked = {k: serve_locally(StreamConfig(**kw, **long)) for k, kw in budgets.items()}
pd.DataFrame({k: {"most tokens in a step": max(st["tokens"] for st in e.steps),
                  "ITL p50 (ms)": s["latency"]["itl_s"]["p50"] * 1e3,
                  "ITL p99 (ms)": s["latency"]["itl_s"]["p99"] * 1e3,
                  "TPOT p99 (ms)": s["latency"]["tpot_s"]["p99"] * 1e3,
                  "TTFT p50 (ms)": s["latency"]["ttft_s"]["p50"] * 1e3}
              for k, (_, s, e) in chunked.items()}).T.rename_axis("modelled: Llama 3 8B, H100")

# %% [markdown]
# No step carries more tokens than its budget (the first column); without a budget a step
# carries whole prompts and the decodes beside them. Chunks trade TTFT (a prompt now takes several
# steps) for a flat ITL; budgets too small make every prompt queue for many steps, so
# Sarathi-Serve sizes the token budget to what a step can carry while still bound by memory
# bandwidth.
# They also shrink the transient buffers of a forward pass, which scale with the tokens of one
# step. For Llama 3 8B (bf16, gated MLP of 14,336), *modelled* per layer:

# %%
buffers = pd.DataFrame({f"{t} tokens in a step": {
    "transient buffer (MB, modelled)": theory.prefill_buffer_bytes(
        t, LLAMA.hidden, LLAMA.ffn, LLAMA.kv_heads, LLAMA.heads) / 1e6}
    for t in (32768, 8192, 512)}).T
buffers

# %% [markdown]
# ## 6 · Speculative decoding
#
# A decode step reads all the weights for one token per request. A cheap **draft** model can
# propose k tokens; the target then checks all k in *one* forward (k + 1 rows: still one read
# of the weights). Leviathan et al. (ICML'23) keep proposal x with probability
# min(1, p(x) / q(x)) (p the target's distribution, q the draft's) and, at the first rejection,
# draw the token from the normalised max(0, p - q) instead: every token is then distributed as
# the target alone would sample it (`labkit.parallel.speculative`; a chi-square test checks it
# in `tests/test_sampling.py`). Greedy decoding is the case where p and q are one-hot: a
# proposal is kept if it is the target's argmax, so the output is exactly the target's greedy
# output. What changes is how many tokens each target forward yields. Here, greedy, the draft
# is the target's own first block(s) and head (self-speculation), and three measures are
# printed: Leviathan et al.'s acceptance **alpha** (accepted / proposals the target judged, up
# to and including the first rejection), and vLLM's **acceptance_rate** (accepted / proposed)
# and **acceptance_length** (1 + accepted / rounds: the tokens a round yields).

# %%
from labkit import models
from labkit.parallel.serving import generate
from labkit.parallel.speculative import (early_exit_draft, expected_tokens_per_round,
                                         speculative_generate)

target = models.build("gpt", seed=0, seq=96, layers=4).eval()
prompt = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(0))
greedy = generate(target, prompt[None], 48)[0].tolist()
rows = {}
for layers in (1, 2):
    for k in (2, 4):
        tokens, st = speculative_generate(target, early_exit_draft(target, layers), prompt,
                                          48, k)
        rows[f"draft = first {layers} of 4 blocks, k = {k}"] = {
            "tokens equal greedy": tokens == greedy,
            "alpha (measured)": st["acceptance"],
            "acceptance_rate (vLLM)": st["acceptance_rate"],
            "acceptance_length (vLLM)": st["acceptance_length"],
            "tokens per round (measured)": (48 - 1) / st["rounds"],
            "tokens per round (formula, from the acceptance)": expected_tokens_per_round(
                st["acceptance"], k)}
pd.DataFrame(rows).T

# %% [markdown]
# alpha is the share of the proposals the target judged that it kept; acceptance_rate divides
# by all proposals, also those drafted after the first rejection and never judged, so it is
# lower. The formula assumes each proposal is kept independently with probability alpha; where
# the columns differ, the draft's misses come in runs. Whether it is faster depends on what a
# draft step costs against a target step: on a GPU the k + 1-row check costs about one decode
# step (memory-bound), so tokens per round is close to the speed-up when the draft is nearly
# free.

# %% [markdown]
# ## 7 · Prefill and decode on separate ranks
#
# Chunking shares one GPU between the two phases; **disaggregation** (DistServe, Splitwise)
# gives each its own GPUs: the prefill rank computes a prompt, sends its keys and values and its
# first token to the decode rank, which adds the request to its running batch. Below, on two
# CPU ranks: the tokens against each request alone, and the bytes sent, measured by the comm
# log, against layers x 2 x kv_heads x head_dim x prompt x 4 bytes (float32 here).

# %%
from labkit import launch
from labkit.parallel.disaggregated import disaggregated_generate
from labkit.theory import hardware


def prefill_then_decode(ctx, sizes, outputs):
    model = models.build("gpt", seed=0, seq=64, layers=2).eval()
    prompts = [torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
               for n in sizes]
    tokens = disaggregated_generate(model, prompts, outputs)
    sent = [r for r in ctx.comm.summary(by=("op", "tag")) if r["tag"] == "kv transfer"]
    return dict(tokens=tokens, sent=sum(r["bytes"] for r in sent if r["op"] == "send"))


sizes, outputs = (12, 30, 20), (8, 4, 10)
ranks = launch(prefill_then_decode, 2, sizes, outputs)
small = models.build("gpt", seed=0, seq=64, layers=2).eval()
alone = [generate(small, torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))
                  [None], o)[0].tolist() for n, o in zip(sizes, outputs)]
c = small.cfg
display(Markdown(
    f"Tokens equal to each request served alone: {ranks[1]['tokens'] == alone}. KV bytes sent "
    f"(measured): {ranks[0]['sent']:,}; formula: "
    f"{sum(c.layers * 2 * c.heads * (c.hidden // c.heads) * n * 4 for n in sizes):,}."))

# %% [markdown]
# For Llama 3 8B (bf16 cache, 8 KV heads of 128, 32 layers) the cell below prints the transfer
# per prompt token, then each prompt's transfer against the prefill it follows, on one H100
# (modelled):

# %%
per_token = model_serving.kv_bytes_per_token(LLAMA, "bf16")
print(f"KV per prompt token: 2 x {LLAMA.layers} x {LLAMA.kv_heads} x "
      f"{LLAMA.head_dim} x 2 B = {per_token:,.0f} B = {per_token / 1e3:.1f} KB "
      f"({per_token / 2 ** 10:.0f} KiB)")
pd.DataFrame({f"{p:,}-token prompt": {
    "prefill (ms, modelled)": theory.modelled_step_s(LLAMA, hardware.gpu("H100"),
                                                     [(p, 0)]) * 1e3,
    "KV over NVLink 4 (ms, modelled)": theory.kv_transfer_s(
        LLAMA, p, hardware.link("NVLink 4")) * 1e3,
    "KV over InfiniBand NDR (ms, modelled)": theory.kv_transfer_s(
        LLAMA, p, hardware.link("InfiniBand NDR")) * 1e3} for p in (512, 2048, 8192)}).T

# %% [markdown]
# ## 8 · Explore
#
# Policy, arrival rate, max_num_seqs and max_num_batched_tokens (with chunked prefill): the
# explorer serves a stream of 16 requests
# (prompts 16 to 256 tokens) on this process with the modelled clock and redraws each request's
# life and the latency percentiles. Try: static at 400 req/s; max_num_seqs 1 (no batching at
# all); no budget then a budget of 16 at a high rate.

# %%
def serve_stream(policy, rate, max_num_seqs, max_num_batched_tokens):
    cfg = StreamConfig(**dict(base, requests=16, rate=rate, prompt_len=(16, 256)),
                       policy=policy, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens)
    return serve_locally(cfg)[:2]


stream_explorer(serve_stream)

# %% [markdown]
# ### The KV pool from a memory fraction
#
# vLLM is not given token slots: `--gpu-memory-utilization` (default 0.9) is the share of the
# GPU's memory the engine may use. The weights and the activation peak of a profiling forward
# of `max_num_batched_tokens` tokens come off it; the rest is cut into KV blocks
# (`labkit.theory.stream_sim.kv_pool`, modelled; `plan --serve --rate` sizes its pool so, and
# `run serve --time-model` takes the flag too). Llama 3 8B on one H100, blocks of 16:

# %%
for fraction in (0.5, 0.9, 0.95):
    k = stream_sim.kv_pool("llama-3-8b", "H100", gpu_memory_utilization=fraction,
                           profile_tokens=8192, max_num_seqs=256)
    print(f"{fraction:.2f} x {k['memory_bytes'] / 1e9:.1f} GB = {k['budget_bytes'] / 1e9:5.1f} "
          f"GB - weights {k['weights_bytes'] / 1e9:.1f} - activations "
          f"{k['activation_bytes'] / 1e9:.2f} = KV {k['kv_bytes'] / 1e9:5.1f} GB: "
          f"{k['num_blocks']:,} blocks, {k['num_blocks'] * 16:,} tokens")

# %% [markdown]
# ## The same knobs in vLLM and SGLang
#
# | labkit (`run serve` flag) | vLLM (`vllm serve`) | SGLang (`launch_server`) |
# |---|---|---|
# | `--max-num-seqs` | `--max-num-seqs` | `--max-running-requests` |
# | `--max-num-batched-tokens` | `--max-num-batched-tokens` | `--chunked-prefill-size` |
# | `--[no-]enable-chunked-prefill` | the same | `--chunked-prefill-size -1`: off |
# | `--paged --block-size` | always paged; `--block-size` | always paged; `--page-size` |
# | `--num-gpu-blocks-override`, `--kv-tokens` | `--num-gpu-blocks-override` | none |
# | `--gpu-memory-utilization` | the same | `--mem-fraction-static` |
# | `--scheduling-policy fcfs\|priority` | the same | `--schedule-policy` (fcfs, lpm, ...) |
# | `--enable-prefix-caching` | the same (v1: on by default) | radix cache, on by default |
# | `--policy static` | none: always continuous | none: always continuous |
# | `--temperature`, `--top-p`, `--seed` | the same (`SamplingParams`) | `temperature`, `top_p` |
# | `--draft-len`, `--draft-layers` | `--speculative-config` | `--speculative-algorithm` and co. |
# | `--tp`, `--replicas` | `--tensor-parallel-size`, `--data-parallel-size` | `--tp`, `--dp` |
# | `--ttft-ms`, `--tpot-ms` | `vllm bench serve --goodput ttft:MS tpot:MS` | none |
#
# SGLang schedules prefill and decode batches separately unless told to mix them
# (`--enable-mixed-chunk`), so its prefill budget does not count the decodes as vLLM's does.
#
# ## Takeaways: which technique fixes which latency
#
# | technique | the latency it fixes | what it costs |
# |---|---|---|
# | continuous batching (Orca) | TTFT, E2E (no waiting for a batch) | a schedule per step |
# | paged KV cache (vLLM) | queueing: more requests fit in the bytes | block tables |
# | prefix caching (vLLM v1, SGLang) | TTFT: a common prompt prefilled once | hashes, an LRU |
# | token budget, chunked prefill (Sarathi-Serve) | p99 ITL, TPOT (no stall) | some TTFT |
# | speculative decoding | TPOT: several tokens per target forward | a draft model; its misses |
# | prefill/decode on separate GPUs | TPOT (no prefill in a decode step) | KV sent per request |
# | TP / replicas (lesson 09) | TPOT (1/t of the weights) / throughput | all-reduces / GPUs |
#
# - Continuous batching refills a slot the step after it frees; static batching leaves it empty
#   until the longest answer of its batch is done.
# - A paged cache wastes less than one block per request instead of max length - length, so
#   more requests run at once in the same memory, which is throughput and less queueing.
# - A token budget with chunked prefill bounds the tokens of a step, so a long prompt costs the
#   running requests a chunk's time, not the whole prompt's.
#
# Every technique here changes *when* a token is computed and *where* its keys and values live,
# never *what* it is: each request's tokens equal its tokens served alone (its logits differ at
# the rounding level, section 2; a seeded sampled request draws the same tokens batched as
# alone, and speculative sampling keeps the target's distribution).

# %% [markdown]
# ## Exercises
#
# Three exercises; each answer goes in its own cell, and the cell after it checks it and says
# what is wrong. A first wrong answer gets a hint; the code (or the formula) comes with the
# second, or at once with `show_solution(n)` for exercise n.
#
# **1 · Read through a block table.** Write `gather(pool, table, length, block_size)`: `pool`
# is (blocks, block_size, width): all requests' keys; `table` the list of this request's block
# ids in order; return its first `length` keys as a (length, width) tensor. The checker runs it
# on a pool where two requests grew a token at a time, so their blocks interleave.

# %% tags=["solution"]
def gather(pool, table, length, block_size):
    pos = torch.arange(length)
    return pool[torch.tensor(table)[pos // block_size], pos % block_size]


# %%
check_gather_blocks(gather);

# %% [markdown]
# **2 · Waste.** Llama 3 8B keeps 2 x 32 layers x 1,024 values per token (8 KV heads of 128),
# 2 bytes each. Four requests hold 37, 120, 301 and 64 tokens. How many bytes does a cache that
# reserved 512 tokens per request leave unused, and how many does a paged cache with blocks of
# 16 leave unused? Write both as expressions.

# %% tags=["solution"]
per_token = 2 * 32 * 1024 * 2
wasted_contiguous = sum(512 - n for n in (37, 120, 301, 64)) * per_token
wasted_paged = sum(-(-n // 16) * 16 - n for n in (37, 120, 301, 64)) * per_token

# %%
check_wasted_bytes(wasted_contiguous, wasted_paged);

# %% [markdown]
# **3 · How many fit.** A paged cache of 16,384 token slots in blocks of 16: how many requests
# of 300 tokens fit at once?

# %% tags=["solution"]
fit_paged = (16384 // 16) // -(-300 // 16)

# %%
check_requests_that_fit(fit_paged);

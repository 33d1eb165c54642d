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
# # 09 · Serving a model on many GPUs
#
# Training runs a batch forward and backward, again and again. Serving answers requests: it runs
# the model once on the prompt (**prefill**: all P prompt tokens at once, matrices of b·P rows,
# compute-bound like training) and then **once per new token** (**decode**: one row per request).
# A decode step multiplies every weight by a handful of rows, so the GPU spends its time reading
# the weights from memory, not computing: decode is **memory-bandwidth-bound** until many
# requests share each read.
#
# To avoid recomputing the whole sequence at every token, each attention layer keeps the keys
# and values of the tokens seen so far: the **KV cache**, 2 · layers · kv_heads · head_dim bytes
# per token and per request (× bytes per value). It grows with every token of every user, and is
# what limits how many requests fit beside the weights (Pope et al. 2022, "Efficiently Scaling
# Transformer Inference", arXiv 2211.05102).
#
# The layouts from training come back with new trade-offs:
# - **tensor parallelism** splits every layer: each GPU reads 1/t of the weights per token
#   (lower latency), at 2 all-reduces per layer per token, on the critical path;
# - **pipeline parallelism** splits the layers: 1/p of the memory per GPU, but a token still
#   passes every layer in turn, so the time per token does not fall; requests in micro-batches
#   keep all stages busy (throughput);
# - **replicas** (data parallelism) split the requests: more throughput, the same latency;
# - **expert parallelism** puts an MoE model's experts on different GPUs: all-to-all per layer
#   per token.
#
# In `labkit` generation is `labkit.parallel.serving`: `generate(model, prompt, new_tokens)` on
# any model that takes `kv_cache=` (labkit's GPT, or a decoder written with its `Attention`),
# and `PipelineGenerator` for pipeline stages. The training blocks do the splitting.

# %%
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Markdown, display

import labkit
from labkit import models
from labkit.exercises.serving import (check_kv_bytes, check_tp_decode_step, check_tpot_floor,
                                      show_solution)
from labkit.parallel import parallelize_module
from labkit.parallel.serving import KVCache, generate, generate_without_cache
from labkit.runs import serve
from labkit.theory import catalog, moe as tmoe, serving as theory
from labkit.viz.serving_widgets import (host_figure, roofline_figure, serving_explorer,
                                       serving_figure, tpot_terms)

pd.set_option("display.precision", 3)
torch.set_num_threads(1)   # tiny models: one thread beats two here

# %% [markdown]
# ## 1 · Generation with a KV cache, on one device
#
# `generate` runs the prompt once, then one token per step, each step feeding the token it just
# picked (greedy: the most likely one). `generate_without_cache` recomputes the whole sequence
# at every step. Both must give the same tokens; the cache only saves work.

# %%
gpt = models.build("gpt", seq=64, layers=4).eval()
prompt = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))

start = time.perf_counter()
cache = KVCache()
fast = generate(gpt, prompt, 32, cache)
with_cache_s = time.perf_counter() - start
start = time.perf_counter()
slow = generate_without_cache(gpt, prompt, 32)
without_cache_s = time.perf_counter() - start
print(f"same tokens: {torch.equal(fast, slow)}; 32 new tokens for 8 requests (measured): "
      f"{with_cache_s * 1e3:.0f} ms with the cache, {without_cache_s * 1e3:.0f} ms without")
print(f"the cache now holds {cache.length} positions per request: {cache.nbytes():,} bytes")

# %% [markdown]
# ## 2 · The same tokens on ranks: TP, PP, replicas, experts
#
# First in your own function: split the GPT by heads and MLP columns with `parallelize_module` (the
# training block, unchanged) and call the same `generate`. Each rank's attention now computes
# only its heads, so its cache holds only those heads' keys and values.

# %%
PLAN = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"}

def tp_generate(ctx):
    model = parallelize_module(models.build("gpt", seq=64, layers=4).eval(), None, PLAN)
    cache = KVCache()
    tokens = generate(model, prompt, 32, cache)
    return tokens, cache.nbytes(), ctx.comm.summary()

ranks = labkit.launch(tp_generate, 2)
print(f"TP on 2 ranks gives the single-device tokens: "
      f"{all(torch.equal(r[0], fast) for r in ranks)}; cache per rank "
      f"{ranks[0][1]:,} bytes (one device: {cache.nbytes():,}); rank 0 all-reduced "
      f"{ranks[0][2][0]['calls']} times for {32} tokens")

# %% [markdown]
# The driver `labkit.runs.serve` (also `python -m labkit run serve --tp 2 ...`) runs each layout
# on a mesh of ranks, compares the tokens of every request with one device, and reports the
# cache per rank (measured, beside the formula 2 · layers here · requests here · tokens ·
# width / tp · 4 bytes), the communication per generated token and the wall time here.
# Pipeline stages get the requests in as many micro-batches as stages; the MoE GPT spreads its
# 4 experts over the ranks (no token dropped in serving).

# %%
LAYOUTS = {"TP 2": dict(tp=2), "PP 2": dict(pp=2), "2 replicas": dict(replicas=2),
           "EP 2 (4 experts)": dict(experts=4, ep=2)}
reports = {name: serve.report(cfg=serve.ServeConfig(batch=8, prompt_len=16, new_tokens=8, **kw))
           for name, kw in LAYOUTS.items()}

def comm_text(report):
    return "; ".join(f"{row['op']} {row['calls_per_token']:.0f}× ({row['bytes_per_token']:,.0f} B)"
                     for row in report["comm"]) or "none"

pd.DataFrame({name: {
    "tokens equal one device": r["tokens_equal_reference"],
    "KV cache rank 0 (B, measured)": r["kv_cache_bytes"][0],
    "KV cache rank 0 (B, formula)": r["predicted_kv_cache_bytes"][0],
    "comm per token, rank 0 (measured)": comm_text(r),
    "tokens/s here (measured)": round(r["wall_tokens_per_s"]),
} for name, r in reports.items()}).T

# %% [markdown]
# Read the communication column: TP all-reduces twice per layer and token (after attention,
# after the MLP); the pipeline sends one activation per micro-batch across its boundary and
# gets the chosen token back; replicas never talk; experts cost two all-to-alls per MoE layer
# (dispatch and combine) and a small all-gather of the routing counts. The wall numbers are this
# CPU's, where every message is expensive; the next sections model a real GPU.

# %% [markdown]
# ## 3 · Measure the cache
#
# The cache grows by the same number of bytes at every token. Below: the tiny GPT's cache
# after each step (measured), and the formula: 2 (k and v) × layers × requests × positions ×
# hidden values, of 4 bytes each (fp32), in bytes.

# %%
cache, sizes = KVCache(), []
ids = prompt
with torch.no_grad():
    for _ in range(24):
        ids = gpt(ids, kv_cache=cache)[:, -1].argmax(-1, keepdim=True)
        sizes.append((cache.length, cache.nbytes()))
c = gpt.cfg
fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot([p for p, _ in sizes], [b / 1e3 for _, b in sizes], "o", label="measured")
ax.plot([p for p, _ in sizes], [2 * c.layers * 8 * p * c.hidden * 4 / 1e3 for p, _ in sizes],
        "-", label="formula 2·L·b·s·h values × 4 B")
ax.set_xlabel("positions cached per request")
ax.set_ylabel("KV cache (KB = 10³ bytes)")
ax.set_title("tiny GPT, 8 requests: the cache grows with every token (measured)")
ax.legend()
ax.grid(alpha=0.3)
fig.tight_layout()

# %% [markdown]
# For real models (bf16, modelled): the cache per token, and the cache of 32 users at an
# 8,192-token context beside the weights. Grouped-query attention (GQA: 8 KV heads shared by
# all query heads in Llama 3) is what keeps it small.

# %%
rows = []
for name in ("llama-3-8b", "llama-3-70b", "llama-3.1-405b", "mixtral-8x7b", "gpt2-small"):
    m = catalog.model(name)
    no_gqa = m.layers * 2 * m.heads * m.head_dim * 2
    rows.append({"model": m.display_name, "KV heads / heads": f"{m.kv_heads} / {m.heads}",
                 "KB per token": theory.kv_bytes_per_token(m) / 1e3,
                 "KB per token without GQA": no_gqa / 1e3,
                 "32 users x 8k tokens (GB)": theory.kv_cache_bytes(m, 32, 8192) / 1e9,
                 "bf16 weights (GB)": theory.weight_bytes(m)["total"] / 1e9})
pd.DataFrame(rows).set_index("model").round(1)

# %% [markdown]
# ## 4 · Prefill vs decode: the roofline knee
#
# A decode step of b requests does 2 · params · b FLOPs and reads every weight once (plus each
# request's cache). Its arithmetic intensity, FLOPs per byte read, is about b for bf16 weights.
# A GPU turns compute-bound where the intensity passes peak FLOP/s ÷ memory bandwidth (its
# ridge; here the best matmul's FLOP/s over the achievable HBM bandwidth): below that batch,
# adding requests is almost free. First measured on this CPU with the tiny GPT: how the time of one
# decode step and the tokens/s change with the batch (the ratios are printed below the table).

# %%
measured = []
with torch.no_grad():
    for b in (1, 4, 16, 64):
        cache = KVCache()
        ids = torch.randint(0, 128, (b, 16), generator=torch.Generator().manual_seed(2))
        ids = gpt(ids, kv_cache=cache)[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(16):
            ids = gpt(ids, kv_cache=cache)[:, -1:].argmax(-1)
        step = (time.perf_counter() - start) / 16
        measured.append({"batch": b, "ms per decode step (measured)": step * 1e3,
                         "tokens/s (measured)": b / step})
display(pd.DataFrame(measured).set_index("batch").round(2))
first, last = measured[0], measured[-1]
slower = last["ms per decode step (measured)"] / first["ms per decode step (measured)"]
print(f"batch {first['batch']} -> {last['batch']} ({last['batch'] // first['batch']}x the "
      f"requests): a decode step takes {slower:.1f}x as long, tokens/s grow "
      f"{last['tokens/s (measured)'] / first['tokens/s (measured)']:.1f}x (measured)")

# %% [markdown]
# The same on a GPU, modelled: Llama 3 70B's decode intensity against the ridges of three GPUs.
# Without a cache the line crosses the ridge at the knee batch; with a 4,096-token context each
# request also reads its own cache, which no other request shares, so the intensity levels off
# (at the value printed below the figure); whether that is above a GPU's ridge is printed too.

# %%
roofline_figure("Llama 3 70B")
plt.show()
knees = {g: theory.knee_batch("llama-3-70b", g) for g in ("H100", "A100")}
display(Markdown(f"Modelled knee batch of Llama 3 70B, bf16 weights, no cache: "
                 f"{knees['H100']} on an H100, {knees['A100']} on an A100 (its ridge is lower: "
                 f"less compute per byte of bandwidth). With int4 weights (a quarter of the "
                 f"bytes) the H100's knee falls to "
                 f"{theory.knee_batch('llama-3-70b', 'H100', 'int4')}."))
ceiling = theory.decode_intensity("llama-3-70b", 10**9, 4096)
for g in ("H100", "H200", "A100"):
    knee = theory.knee_batch("llama-3-70b", g, context=4096)
    print(f"{g}: ridge {theory.ridge_intensity(g):.0f} FLOP/B; with a 4,096-token cache the "
          f"intensity levels off at {ceiling:.0f} FLOP/B, so decode "
          + (f"turns compute-bound at batch {knee}" if knee != float("inf")
             else "stays memory-bound at any batch") + " (modelled)")

# %% [markdown]
# ## 5 · TP vs PP vs replicas: latency and throughput (modelled)
#
# `theory.serving.serving_time` models one layout: prefill and decode on the roofline of each
# GPU's share, kernel by kernel (`theory/kernels.py`: each GEMM's shape, a launch cost per
# kernel, a visible share of a batch-1 token beside reading the weights), TP's 2 all-reduces
# per layer and token (each the faster of the ring, 2(N−1) link
# latencies, and a one-shot all-reduce of two: `small_all_reduce_time`, with the nccl-tests
# numbers it is checked against), pipeline hops and micro-batches, the EP all-to-alls. A replica
# serves whole requests: at batch 1 the other replicas idle. TTFT is the time to the first
# token of the batch; TPOT the time per output token, averaged over the generated tokens.
# Llama 3 70B in bf16, 8 H100s, prompt 1,024, 256 new tokens:

# %%
def layouts_table(model, gpus, batch, weights="bf16", gpu="H100", prompt_len=1024):
    rows = {}
    for name, kw in {"1 GPU": {}, f"TP {gpus}": dict(tp=gpus), f"PP {gpus}": dict(pp=gpus),
                     f"{gpus} replicas": dict(replicas=gpus)}.items():
        t = theory.serving_time(model, gpu=gpu, batch=batch, prompt_len=prompt_len,
                                new_tokens=256, weights=weights, **kw)
        rows[name] = {"TTFT (ms)": t["ttft_s"] * 1e3, "TPOT (ms)": t["tpot_s"] * 1e3,
                      "tokens/s": t["tokens_per_s"], "GB per GPU": t["memory_bytes"]["total"] / 1e9}
    return pd.DataFrame(rows).T.round(1)

for batch in (1, 64):
    display(Markdown(f"**batch {batch}** (modelled)"), layouts_table("llama-3-70b", 8, batch))

# %% [markdown]
# PP divides memory, not latency: a token still passes every layer, one stage after the other,
# and hands off between stages. Each GPU of TP 8 reads 1/8 of the weights per token; a token
# through TP 4 × PP 2 reads 1/8 on each of its two stages in turn, with half the all-reduces per
# stage and two hand-offs. The terms of one token at batch 1 (modelled), every term that adds
# to TPOT: the step (the larger of its compute and its weight and cache reads), the kernel
# launches (at batch 1 a visible share), the all-reduces and the hand-offs:

# %%
for name, kw in {"TP 8": dict(tp=8), "TP 4 x PP 2": dict(tp=4, pp=2)}.items():
    t = theory.serving_time("llama-3-70b", gpu="H100", batch=1, prompt_len=1024,
                            new_tokens=256, **kw)
    terms = {k: v for k, v in tpot_terms(t).items() if v}
    print(f"{name:>12}: TPOT {t['tpot_s'] * 1e3:.2f} ms = "
          + " + ".join(f"{k} {v * 1e3:.3f}" for k, v in terms.items())
          + f" ms (sum {sum(terms.values()) * 1e3:.2f} ms, modelled)")

# %% [markdown]
# The same comparison drawn (what the explorer in section 8 redraws): TP gives the lowest time
# per token at the cost of its all-reduces; PP gives the memory split without the speed; the
# replicas of a 141 GB model do not fit an 80 GB GPU at all.

# %%
serving_figure("Llama 3 70B", gpus=8, gpu="H100 SXM", batch=16, context=2048, weights="bf16")
plt.show()

# %% [markdown]
# ### How far to trust the serving model
#
# Every number above is modelled, and `python -m labkit plan --serve` says under its table how
# far to trust it: the spread of the model's error over published serving runs it was never
# fitted to (`labkit/tables/published_serving.csv`: NVIDIA's TensorRT-LLM tables for Llama 2 7B
# and 70B in fp8 on H100s, static batches, each row with its source), each predicted by
# `serving_time` with the run's own settings. Those engines ran without CUDA graphs: the host
# enqueued every kernel, and the one number the serving model fits, the host's time per kernel
# (`pricing.ENQUEUE_S`), comes from other rows of the same tables (GPT-J 6B and Falcon 180B,
# `use=calibration`), never from these. A throughput row compares output tokens/s per GPU;
# a TTFT row compares 1 / TTFT, the rate of first tokens, so on both a positive error means the
# model promised more than was measured, and a real run is expected near modelled / (1 + error).
# The band keeps the central errors (the share printed below) so one outlier does not set it.
# The figure puts each run at (published, modelled): on the grey line the model is exact, the
# dashed lines are the band's edges. The line starting "measured" is the decode steps that
# `labkit calibrate` timed on one H200 (a 1B-shaped Llama), beside the band, not in it.

# %%
from labkit.theory import error_band
from labkit.viz.planner_widgets import error_band_figure

serving_band = error_band.serving_band()
print(f"the band keeps the central {error_band.COVERAGE:.0%} of the errors")
for kind in ("throughput", "TTFT"):
    part = [r for r in serving_band["rows"] if r["kind"] == kind]
    inside = sum(r["name"] not in serving_band["outside"] for r in part)
    print(f"{kind} rows: {inside} of {len(part)} inside the band, mean |error| "
          f"{sum(abs(r['error']) for r in part) / len(part):.1%}, signed "
          f"{sum(r['error'] for r in part) / len(part):+.1%} (modelled / published - 1)")
print("\n".join(error_band.format_band(serving_band)))
fig = error_band_figure(serving_band, group="kind", model="serving_time",
                        unit="rate (output tokens/s per GPU, or 1/TTFT in 1/s)")
plt.show()

# %% [markdown]
# The throughput rows fall on both sides of the line. The TTFT rows split by prompt: a long
# prompt's prefill is compute-bound, while a 128-token one does so little work per kernel that
# the GPU waits for the host to enqueue the next: the step takes the larger of the GPU's time
# and the host's (`pricing.step_total`). A stack that replays a CUDA graph (vLLM, SGLang, later
# TensorRT-LLM) enqueues a whole step at once and hides the host; `plan --serve
# --enforce-eager` (vLLM's flag) prices a stack that does not. The same request both ways:

# %%
for prompt in (128, 2048):
    graph, enqueue = (theory.serving_time("llama-3-8b", gpu="H100", batch=1, prompt_len=prompt,
                                          new_tokens=64, execution=e) for e in ("graph", "enqueue"))
    print(f"Llama 3 8B, one H100, prompt {prompt:>5,}: TTFT {graph['ttft_s'] * 1e3:5.1f} ms with "
          f"CUDA graphs, {enqueue['ttft_s'] * 1e3:5.1f} ms enqueued kernel by kernel; TPOT "
          f"{graph['tpot_s'] * 1e3:.2f} vs {enqueue['tpot_s'] * 1e3:.2f} ms (modelled)")

# %% [markdown]
# Drawn over prompt lengths, with the fp8 weights of the published rows (a smaller read, so the
# GPU finishes sooner and the host shows more): below a few hundred tokens the enqueued engine
# waits on its host at a floor of kernels × `ENQUEUE_S`, whatever the prompt; above it the two
# lines are one.

# %%
host_figure("llama-3-8b", gpu="H100")
plt.show()

# %% [markdown]
# Read `plan --serve`'s tokens/s as the range it prints under its table; a batch-1 token and a
# short prompt's first token depend on the stack's host as much as on the GPU.

# %% [markdown]
# ## 6 · Experts across GPUs
#
# Measured above: the MoE GPT on 2 ranks sent two all-to-alls per MoE layer and token. Each
# rank dispatches its requests' rows (one per token and choice, top-1 here) of hidden · 4 bytes
# and sends back the rows its experts received: as many on average, not exactly.

# %%
ep = reports["EP 2 (4 experts)"]
a2a = next(row for row in ep["comm"] if row["op"] == "all_to_all")
layers, hidden = serve.ServeConfig().gpt_config().layers, serve.ServeConfig().gpt_config().hidden
rows_per_step = 8 // 2 * (16 + 7) / 8          # requests here x positions fed per token, avg
print(f"all-to-all per generated token (measured, rank 0): {a2a['calls_per_token']:.0f} calls, "
      f"{a2a['bytes_per_token']:,.0f} B; formula 2 x {layers} layers x {rows_per_step:.1f} rows "
      f"x {hidden} x 4 B = {2 * layers * rows_per_step * hidden * 4:,.0f} B on average")

# %% [markdown]
# Mixtral 8x7B on 8 H100s (modelled): experts spread (EP 8) against tensor parallelism and
# replicas. With every GPU holding an eighth of the experts, a decode step reads far fewer
# weights per GPU than a replica does.

# %%
rows = {}
for name, kw in {"1 GPU": {}, "TP 8": dict(tp=8), "EP 8": dict(ep=8),
                 "8 replicas": dict(replicas=8), "TP 2 x EP 4": dict(tp=2, ep=4)}.items():
    t = theory.serving_time("mixtral-8x7b", gpu="H100", batch=64, prompt_len=1024,
                            new_tokens=256, **kw)
    rows[name] = {"TPOT (ms)": t["tpot_s"] * 1e3, "tokens/s per GPU": t["tokens_per_s_per_gpu"],
                  "GB per GPU": t["memory_bytes"]["total"] / 1e9,
                  "all-to-all share of TPOT": t["decode_breakdown_s"]["ep_comm"] / t["tpot_s"]}
pd.DataFrame(rows).T.round(2)

# %% [markdown]
# ## 7 · The source article's claims, computed
#
# **Claim 2: Stable Diffusion on a second node.** The article: one H100 node takes 2.6 s per
# batch; a second node processes 2 batches in 2.6 s, "effectively reducing the inference time to
# 1.3 seconds per batch". Two replicas double the *throughput*; each batch still takes 2.6 s
# (its *latency*). A diffusion model's batch is compute-bound, so a second copy is the way to
# more images per second; for an LLM in memory-bound decode the first copy could often batch the
# second one's requests almost for free:

# %%
sd = pd.DataFrame({f"{n} node(s)": {"latency per batch (s)": 2.6, "batches per 2.6 s": n,
                                     "time per batch, amortised (s)": 2.6 / n}
                   for n in (1, 2, 4)}).T
display(sd)
def replica_gain(batch, prompt_len, new_tokens):
    kw = dict(gpu="H100", batch=batch, prompt_len=prompt_len, new_tokens=new_tokens)
    return (theory.serving_time("llama-3-8b", replicas=2, **kw)["tokens_per_s"]
            / theory.serving_time("llama-3-8b", **kw)["tokens_per_s"])
display(Markdown(
    f"Llama 3 8B, 2 replicas against 1 GPU with the same requests (modelled): "
    f"{replica_gain(16, 64, 256):.2f}× the tokens/s for 16 chat requests (memory-bound decode: "
    f"one GPU batches them as cheaply), {replica_gain(16, 4096, 1):.2f}× for 16 long prompts "
    f"(compute-bound prefill, like a diffusion batch), {replica_gain(1024, 64, 256):.2f}× for "
    f"1,024 requests (past the knee)."))

# %% [markdown]
# **Claim 4: "about 40GB" for Llama 3 70B.** The weights alone, by precision, and with the cache
# of one 8,192-token request and the working buffers (modelled, `theory.serving`):

# %%
m70 = catalog.model("llama-3-70b")
rows = {}
for w in theory.WEIGHTS:
    wb = theory.weight_bytes(m70, w)
    mem = theory.memory_per_gpu(m70, batch_per_gpu=1, context=8192, weights=w)
    rows[w] = {"matrices (GB)": wb["matrices"] / 1e9, "scales (GB)": wb["scales"] / 1e9,
               "embeddings, norms in bf16 (GB)": wb["other"] / 1e9,
               "weights (GB)": wb["total"] / 1e9, "+ 1 request x 8k cache, buffers (GB)":
               mem["total"] / 1e9}
claim4 = pd.DataFrame(rows).T.round(1)
claim4

# %%
int4 = claim4.loc["int4"]
display(Markdown(
    f"\"About 40GB\" is true only for 4-bit weights: {int4['matrices (GB)']:.1f} GB of int4 "
    f"matrices, {int4['weights (GB)']:.1f} GB with their scales and the bf16 embeddings, "
    f"{int4['+ 1 request x 8k cache, buffers (GB)']:.1f} GB serving one request of 8,192 "
    f"tokens. In bf16 it is {claim4.loc['bf16', 'weights (GB)']:.0f} GB, and every further "
    f"user adds {theory.kv_cache_bytes(m70, 1, 8192) / 1e9:.1f} GB of cache at that context."))

# %% [markdown]
# **Claim 5: two GPUs of pipeline parallelism, "roughly 20GB per GPU at the cost of some
# execution speed".** The 4-bit model on A100 80GB GPUs, 1,024-token prompts, 256 new tokens
# (modelled): one GPU, a 2-stage pipeline, and TP 2 for comparison, for one request and for 32.

# %%
rows = {}
for name, kw in {"1 GPU": {}, "PP 2": dict(pp=2), "TP 2": dict(tp=2)}.items():
    for batch in (1, 32):
        t = theory.serving_time("llama-3-70b", gpu="A100 SXM 80GB", batch=batch,
                                prompt_len=1024, new_tokens=256, weights="int4", **kw)
        rows[f"{name}, batch {batch}"] = {"GB per GPU": t["memory_bytes"]["total"] / 1e9,
                                          "TPOT (ms)": t["tpot_s"] * 1e3,
                                          "TTFT (ms)": t["ttft_s"] * 1e3,
                                          "tokens/s": t["tokens_per_s"]}
claim5 = pd.DataFrame(rows).T.round(1)
claim5

# %%
display(Markdown(
    f"Memory per GPU halves: {claim5.loc['1 GPU, batch 1', 'GB per GPU']:.0f} → "
    f"{claim5.loc['PP 2, batch 1', 'GB per GPU']:.0f} GB (the \"roughly 20GB\"). The time per "
    f"token does not improve: {claim5.loc['1 GPU, batch 1', 'TPOT (ms)']:.1f} ms on one GPU, "
    f"{claim5.loc['PP 2, batch 1', 'TPOT (ms)']:.1f} ms through two stages, since a token passes "
    f"both in turn (the article's \"some execution speed\" is the hop between them). With 32 "
    f"requests in two micro-batches both stages work at once: "
    f"{claim5.loc['PP 2, batch 32', 'tokens/s']:.0f} tokens/s against "
    f"{claim5.loc['1 GPU, batch 32', 'tokens/s']:.0f}. TP 2 on the same two GPUs halves the "
    f"time per token instead ({claim5.loc['TP 2, batch 1', 'TPOT (ms)']:.1f} ms)."))

# %% [markdown]
# **Claim 8: 16 experts on 16 GPUs, "about eightfold".** Lesson 05 took this apart for one MoE
# layer. Here the whole model is served: Mixtral's shapes with 16 experts (top-1 and top-2), one
# expert per H100 (EP 16), against the same model on one GPU (as if it fitted: it does not) and
# against 8-way TP with 2 replicas on the same 16 GPUs (modelled).

# %%
rows = []
for k in (1, 2):
    shape = tmoe.with_experts("mixtral-8x7b", 16, k)
    for label, batch, prompt_len, new in (("chat: 16 requests", 16, 512, 256),
                                          ("busy: 256 requests", 256, 512, 256),
                                          ("prefill only: 16 x 4k", 16, 4096, 1)):
        kw = dict(gpu="H100", batch=batch, prompt_len=prompt_len, new_tokens=new)
        one, spread = theory.serving_time(shape, **kw), theory.serving_time(shape, ep=16, **kw)
        rows.append({"top-k": k, "workload": label,
                     "EP 16 / 1 GPU": spread["tokens_per_s"] / one["tokens_per_s"],
                     "TP 8 x 2 replicas / 1 GPU": theory.serving_time(
                         shape, tp=8, replicas=2, **kw)["tokens_per_s"] / one["tokens_per_s"],
                     "TPOT, 1 GPU / EP 16": one["tpot_s"] / spread["tpot_s"]})
claim8 = pd.DataFrame(rows).set_index(["top-k", "workload"]).round(1)
claim8

# %%
lo, hi = claim8["EP 16 / 1 GPU"].min(), claim8["EP 16 / 1 GPU"].max()
display(Markdown(
    f"The multiplier is not one number: {lo:.1f}× to {hi:.1f}× over one GPU depending on the "
    f"workload (modelled). Eight is E/k for top-2 of 16 experts, a ratio of *compute per token* "
    f"against a dense model of the same size, not of GPUs; 16 GPUs used as TP and replicas give "
    f"{claim8['TP 8 x 2 replicas / 1 GPU'].min():.1f}× to "
    f"{claim8['TP 8 x 2 replicas / 1 GPU'].max():.1f}× on the same workloads. A daily token "
    f"count (10,000 → 80,000) is throughput; the time per token of a request falls "
    f"{claim8['TPOT, 1 GPU / EP 16'].min():.1f}× to {claim8['TPOT, 1 GPU / EP 16'].max():.1f}×, "
    f"since each GPU reads only its own experts' weights."))

# %% [markdown]
# ## 8 · Explore
#
# Model, GPUs, GPU kind, batch, prompt length and weight precision: the explorer redraws the
# time per output token (split into the roofline step and communication), the memory per GPU
# against what is usable, the time to first token and the output tokens/s per GPU for one GPU,
# TP, PP, replicas and (for an MoE model) EP over the chosen GPUs. Pale bars do not fit. All
# numbers are modelled. Try: Llama 3 70B at batch 1 then 256; int4 on 2 GPUs; Mixtral with EP.

# %%
serving_explorer()

# %% [markdown]
# ## Takeaways
#
# - Serving is prefill (compute-bound, like training) then one step per token (memory-bound):
#   a decode step reads every weight for a few rows, so batching requests is nearly free up to
#   the roofline knee, and the KV cache, which grows with every token of every user, decides
#   how many requests fit.
# - The training blocks serve unchanged: `parallelize_module` splits heads (and so the cache),
#   stages hold their layers and their cache, replicas split the requests, `ExpertParallel` moves
#   tokens to experts; every layout gives exactly the single-device greedy tokens.
# - TP lowers the time per token (each GPU reads 1/t of the weights) at 2 all-reduces per layer
#   per token, whose latency matters at small batch; PP divides memory, not latency; replicas
#   and micro-batched pipelines buy throughput.
# - The source article's inference claims hold under conditions it does not state: 40 GB means
#   4-bit weights and few users; two pipeline GPUs give 20 GB each at the same time per token;
#   a second node doubles throughput, not latency; "eightfold" for 16 experts depends on the
#   workload and compares compute, not GPUs.

# %% [markdown]
# ## Exercises
#
# Three exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · A tensor-parallel decode step of attention, on 2 ranks.** Write
# `attention_step(ctx, x, shard, cache, group)`: `x` is (batch, new tokens, 16); `shard` holds
# this rank's `w_qkv` and `b_qkv` (the rows of q, k and v of its 2 heads, in that order),
# `w_proj` (the columns of the output projection for those heads), the full `b_proj`, and
# `head_dim`. Compute this step's q, k, v; append k and v to `cache["k"]`, `cache["v"]` (a dict,
# empty before the prompt; along dim 1); attend with `labkit.models.causal_attention(q, k, v,
# heads)` (it accepts k longer than q); project, **all-reduce** over `group` with
# `ctx.comm.all_reduce`, and add the bias once. The checker runs the prompt and three decode
# steps on 2 ranks against the full attention with a KV cache, and counts each step's FLOPs
# (recomputing every token's k and v gives the right values, at a cost that grows each step).

# %% tags=["solution"]
import torch.nn.functional as F
from labkit.models import causal_attention

def attention_step(ctx, x, shard, cache, group):
    q, k, v = F.linear(x, shard["w_qkv"], shard["b_qkv"]).chunk(3, dim=-1)
    if "k" in cache:                                   # decode: the new token joins the cache
        k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
    cache["k"], cache["v"] = k, v
    out = causal_attention(q, k, v, q.shape[-1] // shard["head_dim"])
    partial = F.linear(out, shard["w_proj"])           # this rank's heads' share of the sum
    return ctx.comm.all_reduce(partial, group=group) + shard["b_proj"]


# %%
check_tp_decode_step(attention_step);

# %% [markdown]
# **2 · The cache of 8 users.** Llama 3 70B (80 layers, 64 query heads, 8 KV heads, head_dim
# 128) serves 8 requests at a context of 8,192 tokens with a bf16 cache. How many bytes does the
# KV cache take? Write it as an expression.

# %% tags=["solution"]
# layers x (k, v) x kv heads x head_dim x tokens x requests x bytes
kv_bytes = 80 * 2 * 8 * 128 * 8192 * 8 * 2

# %%
check_kv_bytes(kv_bytes);

# %% [markdown]
# **3 · The floor of the time per token.** Llama 3 8B (8.03B parameters) in bf16 on one H100
# SXM (3.35 TB/s of HBM bandwidth), one request: what is the least time per output token, in
# milliseconds, ignoring the cache?

# %% tags=["solution"]
tpot_floor_ms = catalog.model("llama-3-8b").param_count() * 2 / 3.35e12 * 1e3

# %%
check_tpot_floor(tpot_floor_ms);

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
# # 00 · Why parallelism? What fills a GPU's memory
#
# A model too big for one GPU is the first reason to use many. Before any parallel technique, this
# lesson counts what a GPU has to hold, measures it on a tiny model, and scales the same formulas
# up to real ones.
#
# **Training.** With Ψ parameters and mixed-precision Adam, every GPU keeps the bf16 weights
# (2Ψ bytes), their bf16 gradients (2Ψ) and the optimizer state (12Ψ: an fp32 master copy of the
# weights plus Adam's fp32 momentum and variance). That is **2Ψ + 2Ψ + 12Ψ = 16Ψ bytes** of
# *model states* before a single token is processed (the accounting of the ZeRO paper,
# Rajbhandari et al. 2020). On top come the **activations** that the forward pass saves for the
# backward pass. For one transformer layer in 16-bit, Korthikanti et al. 2022 count
# s·b·h·(34 + 5·a·s/h) bytes for s tokens, b sequences, hidden size h and a heads: the 34·sbh part
# are the layer's inputs, Q, K, V, MLP intermediates and dropout masks; the 5·a·s²·b part is the
# attention score matrix, which grows with the square of the sequence length.
#
# **The source article.** This lab started from an overview article by the Genesis Cloud team (a
# GPU cloud provider) on parallelizing LLM training and inference on NVIDIA H100s: data
# parallelism, pipeline and tensor parallelism, ZeRO and Mixture of Experts. Every lesson calls it
# "the source article", quotes its claims briefly, and puts each claim beside what `labkit`
# measures or derives:
#
# | # | the claim, in short | checked in |
# |---|---|---|
# | 1 | twice the GPUs, up to twice as fast through the data | 01 data parallelism |
# | 2 | a second node halves Stable Diffusion's time per batch (2.6 s → 1.3 s) | 01 data parallelism, 09 serving |
# | 3 | model parallelism's runtime grows with the number of GPUs | 02, 03, 06 |
# | 4 | Llama 3 70B needs "about 40GB" | 00 (below), 09 serving |
# | 5 | two GPUs of pipeline parallelism: "roughly 20GB per GPU" | 02 pipeline, 09 serving |
# | 6 | ZeRO: "tenfold increases in training efficiency" | 04 ZeRO |
# | 7 | "Mixtral 8B" outperforms Llama 2 70B with much less compute | 05 MoE |
# | 8 | 16 experts on 16 GPUs: inference throughput "about eightfold" | 05 MoE, 09 serving |
# | 9 | Stable Diffusion "has over a billion parameters" | 00 (below) |
#
# **Inference.** No gradients, no optimizer: the **weights** (Ψ × bytes per weight: 2 for bf16,
# 1 for int8/fp8, ½ for int4) and the **KV cache**, the keys and values of every token seen so
# far, 2 · layers · kv_heads · head_dim · context · batch · bytes. The cache grows with context and
# batch; grouped-query attention (few KV heads) keeps it small.

# %%
import pandas as pd
import matplotlib.pyplot as plt
import torch

import labkit
from labkit.runs.reference import RunConfig, predict_memory, train
from labkit.theory import catalog, hardware, memory as tm
from labkit.viz import comm_bars, memory_stack
from labkit.viz.widgets import capacities, memory_explorer
from labkit.exercises.why_parallelism import (check_broadcast, check_fewest_gpus_zero3,
                                            check_gb_no_zero, show_solution)

pd.set_option("display.precision", 3)
pd.set_option("display.width", 120)
GB = 1e9

# %% [markdown]
# ## 1 · Run it and measure it: the tiny GPT on this machine
#
# `labkit.runs.reference.train` trains the lab's tiny GPT (2 layers, hidden 64, 32 tokens, batch 8) on
# one CPU with fp32 Adam and *measures* the bytes of every tensor that exists, by category.
# `predict_memory` *models* the same run with `labkit.theory`: fp32 Adam holds 4Ψ weights + 4Ψ
# gradients + 8Ψ moments, and the activation formula counts what this model saves for backward.

# %%
cfg = RunConfig(steps=2)
run = train(cfg)
measured = run["memory"]       # bytes, measured from the tensors
predicted = predict_memory(cfg)  # bytes, modelled by labkit.theory

rows = ["params", "grads", "optimizer", "activations", "peak"]
table = pd.DataFrame({
    "measured (MB)": [measured[k] / 1e6 for k in rows],
    "modelled (MB)": [predicted[k] / 1e6 for k in rows],
}, index=rows)
table["measured / modelled"] = table["measured (MB)"] / table["modelled (MB)"]
table

# %%
fig = memory_stack({"measured": measured, "modelled": predicted}, unit="MB",
                   title="tiny GPT, fp32 Adam, one CPU: measured vs modelled")

# %% [markdown]
# Weights, gradients and optimizer state agree to the byte: they are just Ψ times 4, 4 and 8.
# The activations agree within about 1%. The formula
# (`theory.memory.tiny_gpt_activation_bytes`) counts, per layer, 16·sbh + a·s²·b fp32 elements:
# the attention block keeps its LayerNorm output, Q, K, V and the input of the output projection
# (5sbh) plus the softmax output (a·s²·b), the MLP keeps its input and the two 4h-wide GELU tensors
# (9sbh), and the two LayerNorms keep their inputs (2sbh). It is the Korthikanti count without
# dropout masks (this model has no dropout) and in 4-byte floats. Outside the blocks: the final
# LayerNorm and head inputs and the log-softmax over the vocabulary. What it leaves out (LayerNorm
# statistics, the causal mask) is the small gap you see. The modelled *peak* is an upper bound
# (everything at once); the measured peak is lower because backward frees activations while it
# fills in gradients.

# %%
# NBVAL_CHECK_OUTPUT
print("parameters:", run["param_count"])
print("params equal:", measured["params"] == predicted["params"])
print("grads equal:", measured["grads"] == predicted["grads"])
print("optimizer equal:", measured["optimizer"] == predicted["optimizer"])
print("activations within 1%:", abs(measured["activations"] / predicted["activations"] - 1) < 0.01)

# %% [markdown]
# ## 2 · Real models: the same formulas, scaled up
#
# `labkit.theory.catalog` holds real model shapes (from `data/models.csv`, each with its source).
# Parameter counts are *derived* from the shapes and checked against the published totals.

# %%
models = catalog.table()
params = pd.DataFrame({
    "model": models["display_name"],
    "derived (B params)": models["params_derived"] / 1e9,
    "published (B params)": models["params_published"] / 1e9,
})
params["derived / published"] = params["derived (B params)"] / params["published (B params)"]
params.set_index("model")

# %% [markdown]
# Llama 3 70B, served (batch 1, an 8192-token context, bf16 KV cache) with three weight precisions,
# and trained with mixed-precision Adam (batch 1 × 4096 tokens, no activation recomputation).
# The dashed lines are single GPUs from `data/hardware.csv`. All numbers here are *modelled*.

# %%
llama70 = catalog.model("llama-3-70b")
serving = {f"{dtype} weights": tm.inference_memory(llama70, batch=1, context=8192,
                                                   weight_dtype=dtype)
           for dtype in ("bf16", "int8", "int4")}
training = tm.training_memory(llama70, batch=1, seq=4096, mixed_precision=True)

fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8), width_ratios=[3, 2])
memory_stack(serving, capacity=capacities(), ax=left,
             title="Llama 3 70B inference (modelled)")
memory_stack({"mixed-precision\nAdam": training}, capacity=capacities(), ax=right,
             title="Llama 3 70B training (modelled)")
fig.tight_layout()

# %% [markdown]
# Training needs more than ten times what serving in bf16 does, and the optimizer state alone is
# the biggest block. The activations here assume the attention score matrix is stored
# (the 5·a·s/h term); FlashAttention and selective recomputation avoid most of it.
#
# ## 3 · The source article's claims, checked
#
# The source article says: *"Let's say you want to run Llama 3 70B on your hardware. You will
# require about 40GB of RAM."* And, of image models: *"Stable Diffusion, which has over a billion
# parameters"*.

# %%
claim = []
for dtype in ("bf16", "int8", "int4"):
    for context in (8192, 32768):
        m = tm.inference_memory(llama70, batch=1, context=context, weight_dtype=dtype)
        claim.append({"what": f"serve, {dtype} weights, {context}-token context",
                      "weights (GB)": m["weights"] / GB, "KV cache (GB)": m["kv_cache"] / GB,
                      "grads + optimizer (GB)": 0.0, "total (GB)": m["total"] / GB})
states = tm.model_state_bytes(llama70.param_count(), mixed_precision=True, optimizer="adam")
claim.append({"what": "train, mixed-precision Adam, model states only",
              "weights (GB)": states["params"] / GB, "KV cache (GB)": 0.0,
              "grads + optimizer (GB)": (states["grads"] + states["optimizer"]) / GB,
              "total (GB)": states["total"] / GB})
pd.DataFrame(claim).set_index("what")

# %%
sd = catalog.model("stable-diffusion-1.5")
print(f"Stable Diffusion 1.5: {sd.param_count() / 1e9:.2f} B parameters "
      "(UNet ~0.86B + text encoder ~0.12B + VAE ~0.08B, from the catalog)")

# %%
from IPython.display import Markdown

def serve_gb(dtype, context):
    m = tm.inference_memory(llama70, batch=1, context=context, weight_dtype=dtype)
    return m["weights"] / GB, m["kv_cache"] / GB, m["total"] / GB

w4, kv8k, total4 = serve_gb("int4", 8192)
w16, w8 = serve_gb("bf16", 8192)[0], serve_gb("int8", 8192)[0]
kv32k = serve_gb("bf16", 32768)[1]
UNET = 0.86e9   # the UNet alone, as its model card gives it (the catalog holds the total)
Markdown(f'''
**Verdict** (every number computed above by `labkit.theory`).
- *"about 40GB"* for Llama 3 70B holds **only for 4-bit weights and a short context**: int4
  weights are {w4:.1f} GB, plus {kv8k:.1f} GB of KV cache at 8k tokens: {total4:.1f} GB. In
  bf16, the precision the model is released in, the weights alone are {w16:.0f} GB; int8 is
  {w8:.0f} GB. A 32k context adds {kv32k:.1f} GB of cache.
- For **training**, the claim is off by a factor of about {states["total"] / 40e9:.0f}:
  mixed-precision Adam needs 16 bytes per parameter, {states["total"] / 1e12:.2f} TB of model
  states before any activation. No single GPU comes close; that is what the rest of this lab
  is about.
- *"over a billion parameters"* for Stable Diffusion holds, barely: SD 1.5 is
  {sd.param_count() / 1e9:.2f} B in all, and its UNet alone (~{UNET / 1e9:.2f} B) is under a
  billion.
''')

# %% [markdown]
# ## 4 · Explore
#
# Pick a model, inference or training, a precision, batch and sequence length. The bar is
# modelled by `labkit.theory.memory`, on one GPU with no parallelism.

# %%
memory_explorer()


# %% [markdown]
# ## 5 · A first taste of `launch`
#
# `labkit.launch(fn, world_size=4)` starts four processes (*ranks*) on this machine, joins them in
# a process group (gloo on CPU) and calls `fn(ctx)` on each; `ctx` knows its rank, the world size
# and the logged collectives in `ctx.comm`. Here each rank holds a tensor filled with its rank + 1
# and they sum them with an all-reduce: 1 + 2 + 3 + 4 = 10 everywhere.

# %%
# NBVAL_CHECK_OUTPUT
def hello(ctx):
    t = torch.ones(4) * (ctx.rank + 1)
    ctx.comm.all_reduce(t)
    return f"rank {ctx.rank} of {ctx.world_size}: sum {t[0].item():.0f}"


for line in labkit.launch(hello, world_size=4):
    print(line)


# %% [markdown]
# Every collective is logged. The next function runs four of them on 4 MB tensors and hands back
# rank 0's log.

# %%
def comm_demo(ctx):
    ctx.comm.all_reduce(torch.ones(1_000_000))          # 4 MB, summed everywhere
    ctx.comm.all_gather(torch.ones(250_000))            # 1 MB from each rank -> 4 MB
    ctx.comm.reduce_scatter(torch.ones(1_000_000))      # 4 MB summed, 1 MB kept per rank
    ctx.comm.broadcast(torch.ones(1_000_000), src=0)    # 4 MB from rank 0
    return (ctx.comm.dataframe(), ctx.comm.summary()) if ctx.rank == 0 else None


log, summary = labkit.launch(comm_demo, world_size=4)[0]
log = log[["op", "group_size", "bytes", "wire_bytes_per_rank", "wall_s", "modelled_s"]]
log.rename(columns={"wall_s": "wall_s (measured)",
                    "modelled_s": "modelled_s (modelled on 8xH100-NVLink)"})

# %%
fig = comm_bars(summary, title="rank 0's collectives (payload logged, wire bytes by ring formula)")


# %% [markdown]
# `bytes` is the tensor a rank hands to the op; `wire_bytes_per_rank` is what each rank sends over
# the wire with the ring algorithm. A ring all-reduce of S bytes over n ranks is a reduce-scatter
# followed by an all-gather, each moving (n−1)/n·S per rank, so **2(n−1)/n·S**: 6 MB for 4 MB on
# 4 ranks, and it approaches 2S however many ranks join. `wall_s` is *measured* here, on CPU
# processes talking through gloo; `modelled_s` is what the alpha-beta model says the same call
# would take on the *modelled* cluster, eight H100s on NVLink. The two are different machines:
# never compare them as if they were one.

# %% [markdown]
# ## Takeaways
#
# - Training memory is dominated by **model states**: 16 bytes per parameter with mixed-precision
#   Adam, 12 of them optimizer state. Llama 3 70B needs over a terabyte before activations.
# - Inference needs the **weights** (2, 1 or ½ byte per parameter) plus a **KV cache** that grows
#   with context × batch; "70B in 40 GB" is true only with 4-bit weights and a short context.
# - The formulas are not folklore: on the tiny model they match the measured bytes exactly for
#   model states and closely for activations (the measured / modelled column above).
# - Plain data parallelism copies everything to every GPU, so it cannot make a model fit; splitting
#   the states (ZeRO), the layers (pipeline) or the matrices (tensor parallelism) can, and the next
#   lessons measure what each costs in communication.

# %% [markdown]
# ## Exercises
#
# Three exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · A broadcast by hand.** `hello` above used a collective. Collectives are made of
# point-to-point messages: `ctx.comm.send(tensor, dst)` sends a tensor to rank `dst` and
# `ctx.comm.recv(tensor, src)` waits for one from rank `src` and writes it into `tensor` (same
# shape). Write `my_broadcast(ctx, tensor)`: afterwards every rank holds rank 0's tensor. The
# checker runs it on 4 ranks, each starting with different data, and says what went wrong (a
# rank that received nothing, a hang, a collective used instead).

# %% tags=["solution"]
def my_broadcast(ctx, tensor):
    if ctx.rank == 0:                          # the root sends a copy to every other rank
        for dst in range(1, ctx.world_size):
            ctx.comm.send(tensor, dst)
    else:                                      # the others receive once, from the root
        ctx.comm.recv(tensor, 0)
    return tensor


# %%
check_broadcast(my_broadcast);

# %% [markdown]
# **2 · Llama 3 8B with plain data parallelism.** Count model states only (mixed-precision Adam;
# activations aside): how many GB does each GPU hold when Llama 3 8B (8.03 B parameters) is
# trained with plain data parallelism on 8 GPUs? Does it fit an H100? Write the number as an
# expression that shows where it comes from.

# %% tags=["solution"]
gb_per_gpu_no_zero = 16 * 8.03e9 / 1e9   # 2 + 2 + 12 bytes per parameter, on every replica

# %%
check_gb_no_zero(gb_per_gpu_no_zero);

# %% [markdown]
# **3 · The fewest H100s with ZeRO-3.** ZeRO stage 3 (lesson 04) splits all three model states
# N ways. What is the fewest H100s that hold Llama 3 8B's model states that way? Use the H100's
# memory as the hardware table gives it: `hardware.gpu("H100").memory_bytes`.

# %% tags=["solution"]
fewest_h100s_zero3 = 2   # 128.5 GB / 2 = 64 GB fits one H100; 128.5 GB on one does not

# %%
check_fewest_gpus_zero3(fewest_h100s_zero3);

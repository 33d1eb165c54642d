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
# # 03 · Tensor parallelism: splitting every matrix across GPUs
#
# **The idea** (Megatron-LM, Shoeybi et al. 2019). Data parallelism copies the model; tensor
# parallelism (TP) cuts each weight matrix into t pieces, one per GPU, so every GPU holds ~1/t of
# the weights, gradients and optimizer state. A linear layer Y = X Aᵀ can be cut two ways:
#
# - **column-parallel**: split A by *output* features. Rank i computes its own output features
#   Y_i = X A_iᵀ from the full input. No communication in forward; the output stays split.
# - **row-parallel**: split A by *input* features. If X arrives split the same way (exactly what a
#   column-parallel layer produced), rank i computes a partial sum X_i A_iᵀ, and one
#   **all-reduce** adds the t partial sums.
#
# An MLP is column-then-row (the GELU runs on each rank's slice, no communication in between);
# attention is split by heads: q, k, v column-parallel, each rank attends with its own heads, the
# output projection row-parallel. Megatron wraps the communication in two conjugate operators:
# **f** (identity forward, all-reduce backward) before the column-parallel layer and **g**
# (all-reduce forward, identity backward) after the row-parallel one. Per transformer block and
# micro-batch: **2 all-reduces of b·s·h elements forward and 2 backward**.
#
# **Sequence parallelism** (Korthikanti et al. 2022) notices that LayerNorm (and dropout) regions
# between the blocks are replicated on every rank, and shards them along the sequence instead: g
# becomes a *reduce-scatter*, f an *all-gather*, the same bytes on the wire, while activation
# memory per layer drops from sbh(10 + 24/t + 5as/(ht)) to sbh/t·(34 + 5as/h) bytes.
#
# labkit's building block is `parallelize_module(module, device_mesh, parallelize_plan)`, PyTorch's
# name and signature: the plan names layers (globs) and gives each a style, torch's
# `ColwiseParallel()` / `RowwiseParallel()` or labkit's strings `"colwise"`, `"rowwise"`,
# `"vocab"` (then `sequence_parallel=True` turns on SP).

# %%
import copy
import inspect

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import numerics
from labkit.exercises.tensor_parallel import (check_block_bytes, check_break_even_tokens,
                                              check_row_parallel, show_solution)
from labkit.parallel import (ColwiseParallel, RowwiseParallel, mappings, parallelize_module,
                             tensor_parallel as tp)
from labkit.runs import tensor_parallel as run_tp
from labkit.runs.reference import RunConfig, build_model
from labkit.theory import hardware
from labkit.theory import tensor_parallel as ttp
from labkit.theory.step_rate import in_step_gemm_rate
from labkit.viz import comm_bars, memory_stack
from labkit.viz.tp_widgets import tp_explorer

pd.set_option("display.precision", 3)
pd.set_option("display.width", 120)

# %% [markdown]
# ## Where the communication sits
#
# The two operators are ordinary `torch.autograd.Function`s: the all-reduce is in `backward` for
# f and in `forward` for g. Each calls `ctx.comm` with the process group and a tag (the layer's
# name), so every call lands in the comm log and on the modelled clock. They live, with every
# other forward/backward pair of collectives the lab's techniques use, in
# `labkit/parallel/mappings.py` (Megatron keeps them in a `mappings.py` too). The layers are a
# few lines on top; the column-parallel one below (the row-parallel forward is the exercise at
# the end):

# %%
print(inspect.getsource(mappings._CopyTo))
print(inspect.getsource(mappings._ReduceFrom))
print(inspect.getsource(tp.ColumnParallelLinear.forward))


# %% [markdown]
# ## Your own model, your own loop
#
# `parallelize_module` works on any module. Here a plain `nn.Sequential` MLP is split over 2 ranks
# (first Linear column-parallel, last row-parallel) inside an ordinary training loop, beside an
# unsplit copy of the same module. Each rank now holds half of each weight; the gathered
# parameters must equal the unsplit run's after the same steps:

# %%
def my_mlp(ctx):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    single = copy.deepcopy(net)
    exact = numerics.exact_copy(net)          # float64: what rounding is measured from
    parallelize_module(net, None, {"0": ColwiseParallel(), "2": RowwiseParallel()})  # None: world
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, single, exact)]
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        for model, optimizer in zip((net, single, exact), optimizers):
            optimizer.zero_grad()
            dtype = numerics.dtype_of(model)
            F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
            optimizer.step()
    with ctx.off_the_record():      # gathering the shards is a check, not part of training
        full = tp.gather_params(net)
    check = numerics.compare(full, dict(single.named_parameters()),
                             dict(exact.named_parameters()))
    shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    return dict(check=check, shapes=shapes, net=repr(net),
                comm=ctx.comm.summary(by=("op", "tag")))


mine = labkit.launch(my_mlp, 2)[0]
print(mine["net"])
print("rank 0's parameters:", mine["shapes"])
print(f"gathered parameters after 3 SGD steps, against the float64 run: {mine['check']}")
pd.DataFrame(mine["comm"])[["op", "tag", "calls", "bytes"]]

# %% [markdown]
# One all-reduce per step: g after the row-parallel layer in forward (tag `2 fwd`, one row per
# layer and direction in the log). Its partner f, in front of the column-parallel layer, would
# all-reduce the gradient of the layer's input in backward, but this input is the data, which
# needs no gradient: autograd never calls that backward. Inside a transformer the input of a
# column-parallel layer comes from earlier layers, and there f does communicate (below).
#
# ## labkit's GPT: the Megatron plan
#
# For the tiny GPT the plan splits attention by heads (the fused `qkv` projection column-parallel
# *part by part*, so each rank gets q, k and v of whole heads, not the fused matrix cut in thirds;
# the output projection row-parallel), the MLP column-then-row, and the token embedding and the
# output layer by vocabulary. With sequence parallelism the position table joins the plan: split
# by rows, its reduce-scatter hands each rank the rows of its own slice of the sequence.

# %%
for sp in (False, True):
    print(f"sequence_parallel={sp}: {run_tp.gpt_plan(sp)}")


def one_block(ctx):
    return repr(run_tp.build_tp_model(RunConfig(), sequence_parallel=True).blocks[0])


print(labkit.launch(one_block, 2)[0])

# %% [markdown]
# ## Run it: the tiny GPT on 2 ranks, against one device
#
# `run_tp.report` builds the single-device TinyGPT (same seed), applies the plan, trains a few
# steps and gathers the shards back under the reference's parameter names. The loss is computed
# on the vocabulary shards of the logits (`vocab_parallel_cross_entropy`: the max, the target's
# logit and the sum of exponentials are all-reduced, one number per token each, instead of
# gathering every logit). We use SGD here: its update is linear in the gradient, so the two runs
# agree to float32 rounding. (With Adam they agree too, except where a gradient is pure rounding
# noise, e.g. the attention key bias that softmax cancels: Adam turns that noise into steps of
# lr·noise/(|noise| + eps), far above rounding once the noise nears eps.) "Agree to rounding" is
# measured as in lesson 01: against the same single-device run in float64, within a few times
# float32's own error there (`labkit.numerics`; each report carries this `agreement`).

# %%
cfg = RunConfig(steps=3, optimizer="sgd")
runs = {sp: run_tp.report(2, cfg, sequence_parallel=sp) for sp in (False, True)}
for sp, r in runs.items():
    print(f"TP=2{' + SP' if sp else '     '}: loss {[round(x, 4) for x in r['loss']]} "
          f"reference {[round(x, 4) for x in r['reference_loss']]}\n  parameters: "
          f"{r['agreement']['params']['verdict']}\n  losses: {r['agreement']['loss']['verdict']}")

# %%
# NBVAL_CHECK_OUTPUT
for sp, r in runs.items():
    print(f"sequence parallel {sp!s:>5}: losses equal the reference (within float32 rounding): "
          f"{r['agreement']['loss']['ok']}; gathered parameters equal the reference's: "
          f"{r['agreement']['params']['ok']}")

# %% [markdown]
# ## Measure the communication: per block, against the formula
#
# Every collective is tagged with the layer that issued it, so the log tells exactly what one
# block sent. The formula in `labkit.theory.tensor_parallel.block_comm`: without SP, 2
# all-reduces of b·s·h forward and 2 backward. With SP, 2 all-gathers of the b·(s/t)·h shard and
# 2 reduce-scatters of b·s·h in each direction, plus, in backward, one more all-gather per
# column-parallel layer: labkit keeps only the sequence *shard* of a column layer's input for the
# weight gradient and gathers it again (Korthikanti's choice: memory for comm, overlapped).

# %%
# NBVAL_CHECK_OUTPUT
c = run_tp.gpt_config(cfg)
rows = []
for sp, r in runs.items():
    log = pd.DataFrame(r["comm_by_tag"])
    block = log[log.tag.str.startswith("blocks.0.")]
    block = block.assign(direction=block.tag.map(lambda t: "backward" if " bwd" in t
                                                 else "forward"))
    measured = block.groupby(["direction", "op"]).agg(calls=("calls", "sum"),
                                                      bytes=("bytes", "sum"))
    for th in ttp.block_comm(cfg.global_batch, c.seq, c.hidden, 2, sequence_parallel=sp,
                             bytes_per_element=4):
        m = measured.loc[(th["direction"], th["op"])]
        rows.append(dict(SP=sp, direction=th["direction"], op=th["op"],
                         calls_per_step=m.calls / cfg.steps, formula_calls=th["calls"],
                         bytes_per_call=m.bytes // m.calls, formula_bytes=int(th["bytes"])))
pd.DataFrame(rows)

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for ax, (sp, r) in zip(axes, runs.items()):
    comm_bars(r["comm"], ax=ax, title=f"TP=2{' + SP' if sp else ''}, {cfg.steps} steps: "
              "payloads from the log,\nwire bytes from the ring model")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)   # room for the legend above the call counts
    wire = sum(x["wire_bytes_per_rank"] for x in r["comm"])
    print(f"SP={sp}: ring-model bytes per rank from the log {wire:,.0f}, "
          f"formula {r['predicted_comm_bytes_per_rank']:,.0f}")
plt.show()

# %% [markdown]
# Nearly the same volume: a ring all-reduce *is* a reduce-scatter followed by an all-gather, so
# SP moves the same bytes for the conjugate pair. What SP adds: the backward regathers, the
# position table's reduce-scatter, and one small all-reduce per replicated parameter (LayerNorm
# weights, row-parallel biases): each rank saw only its own tokens, so their gradients are summed
# over the group.
#
# ## Measure the memory: 1/t, and Korthikanti's activation formula
#
# Each rank's memory tracker counts its parameters, gradients and what autograd saves for
# backward. The Korthikanti et al. formula is for 16-bit activations with dropout masks; labkit's
# tiny GPT is fp32 without dropout, so `ttp.tiny_gpt_activation_bytes` applies the *same
# accounting* to it (documented term by term in its docstring): per layer
# 4sbh + (4sbh + 2sfb + as²b)/t elements without SP, everything divided by t with SP.

# %%
runs4 = labkit.launch(run_tp.train, 4, cfg, True)
measured = {(2, False): runs[False]["memory"][0], (2, True): runs[True]["memory"][0],
            (4, True): runs4[0]["memory"]}
shape = dict(c.as_dict(), batch=cfg.global_batch, optimizer=cfg.optimizer)
one = ttp.tiny_gpt_training_memory(**shape, tp=1)
rows = []
for (t, sp), mem in measured.items():
    pred = ttp.tiny_gpt_training_memory(**shape, tp=t, sequence_parallel=sp)
    korth = ttp.korthikanti_bytes_per_layer(c.seq, cfg.global_batch, c.hidden, c.heads, t, sp)
    korth1 = ttp.korthikanti_bytes_per_layer(c.seq, cfg.global_batch, c.hidden, c.heads, 1)
    rows.append(dict(tp=t, SP=sp, params_measured=mem["params"], params_vs_1_over_t=(
        mem["params"] / (one["params"] / t)), act_measured=mem["activations"],
        act_formula=pred["activations"], measured_over_formula=mem["activations"] /
        pred["activations"], act_vs_tp1=mem["activations"] / one["activations"],
        korthikanti_vs_tp1=korth / korth1))
table = pd.DataFrame(rows)
table

# %%
# NBVAL_CHECK_OUTPUT
print("activations within 15% of the formula:", bool((abs(table.measured_over_formula - 1)
                                                       < 0.15).all()))
print("params per rank / (single-device params / t):", list(table.params_vs_1_over_t.round(3)))
replicated = ttp.tiny_gpt_replicated_params(layers=c.layers, hidden=c.hidden, seq=c.seq)
print(f"replicated on every rank without SP: {replicated:,} of {c.param_count():,} parameters "
      f"({replicated / c.param_count():.1%})")

# %% [markdown]
# The parameters shrink to a little more than 1/t: the LayerNorms, the biases added after a
# row-parallel all-reduce and (without SP) the position table are replicated on every rank (the
# share printed above; far less for a real model). The activations shrink as the formula says:
# without SP the replicated LayerNorm regions keep a floor that does not divide by t; with SP
# everything does.

# %%
bars = {"TP=1 (formula)": {k: one[k] for k in ("params", "grads", "optimizer",
                                               "activations")}}
for (t, sp), mem in measured.items():
    bars[f"TP={t}{' + SP' if sp else ''}\nrank 0, measured"] = {
        k: mem[k] for k in ("params", "grads", "optimizer", "activations")}
fig = memory_stack(bars, unit="MB", title="tiny GPT, fp32 SGD: memory per rank")
plt.show()

# %% [markdown]
# ## Why tensor parallelism stays inside a node
#
# TP's collectives sit on the critical path: every layer waits for its all-reduce before the next
# matmul. On a real model the modelled step time (compute: 6 FLOPs per matmul weight + 12·L·h·s
# per token, as in lesson 01, at the in-step GEMM rate `in_step_gemm_rate` (the planner's and
# the run clock's: peak × the measured MAMF ceiling × the one fitted in-step fraction),
# alpha-beta collectives over the group's link) for Llama 3 70B, one micro-batch of 4,096 tokens:

# %%
# NBVAL_CHECK_OUTPUT
steps = ttp.step_time_table("llama-3-70b", (1, 2, 4, 8, 16), batch=1, seq=4096)
show = steps[["link", "compute", "exposed_comm", "total", "exposed_share", "speedup_vs_tp1",
              "gpu_seconds_vs_tp1"]]
print(show.to_string(float_format=lambda v: f"{v:.3f}"))
nv, ib = hardware.link("NVLink 4"), hardware.link("InfiniBand NDR")
s = steps
print(f"\nInside a node (NVLink, {nv.bandwidth * nv.efficiency / 1e9:.0f} GB/s effective per "
      f"direction) exposed communication grows from {s.exposed_share[2]:.0%} of the step at "
      f"TP=2 to {s.exposed_share[8]:.0%} at TP=8; the step is {s.speedup_vs_tp1[8]:.1f}x "
      f"faster on 8 GPUs.")
print(f"At TP=16 the group spans two nodes (InfiniBand, {ib.bandwidth * ib.efficiency / 1e9:.0f}"
      f" GB/s effective per GPU): {s.exposed_share[16]:.0%} of the step is waiting; 16 GPUs are "
      f"{'slower' if s.total[16] > s.total[8] else 'faster'} than 8 "
      f"({s.speedup_vs_tp1[16]:.1f}x against {s.speedup_vs_tp1[8]:.1f}x).")
print(f"GPU-seconds per step against one GPU: {s.gpu_seconds_vs_tp1[8]:.2f}x at TP=8, "
      f"{s.gpu_seconds_vs_tp1[16]:.1f}x at TP=16.")

# %% [markdown]
# **The source article's claim 3**: for model parallelism, "the runtime compared to single GPU
# training tends to increase by a similar magnitude to the number of GPUs used". Against the
# numbers above: *wrong* for tensor parallelism inside a node: the step time falls, and the cost
# in GPU-seconds grows far less than the number of GPUs. *Roughly right* only where TP crosses
# the node boundary, where the GPU-seconds at TP=16 over InfiniBand are several times a single
# GPU's. (It is closest to the truth for a naive pipeline without micro-batches, where one stage
# works while the others wait: lesson 02.) What the model leaves out makes large t worse still:
# smaller per-GPU matmuls run below the in-step rate of a large GEMM assumed here (lesson 06's
# planner prices each GEMM's shape).
#
# ## Serving Llama 3 70B with TP: weights and KV cache per GPU
#
# For inference, TP divides the weights by t and the KV cache by min(t, kv_heads) (Llama 3 70B has
# 8 KV heads). At batch 8 and a context of 8,192 tokens (bf16 KV cache), against the H100's
# memory as the hardware table gives it:

# %%
# NBVAL_CHECK_OUTPUT
capacity = hardware.gpu("H100").memory_bytes
inference = ttp.inference_table("llama-3-70b", (2, 4, 8), ("bf16", "int8", "int4"),
                                batch=8, context=8192)
inference["fits_H100"] = inference.total_gb * 1e9 < capacity
print(inference.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
row = inference.set_index(["tp", "weights"]).total_gb
fits = "fits" if row[2, "bf16"] * 1e9 < capacity else "does not fit"
print(f"\nH100 memory in the table: {capacity / 1e9:.1f} GB. bf16 at TP=2 needs "
      f"{row[2, 'bf16']:.1f} GB per GPU ({fits}, before any runtime overhead); TP=4 needs "
      f"{row[4, 'bf16']:.1f} GB; int8 weights at TP=2 {row[2, 'int8']:.1f} GB, int4 "
      f"{row[2, 'int4']:.1f} GB.")


# %% [markdown]
# Quantised weights leave most of the GPU to the KV cache. (The source article's "about 40GB" for
# Llama 3 70B is the int4 weights plus a cache; lesson 00 and lesson 09 count them the same way,
# `theory.weights.weight_bytes`:)

# %%
from labkit.theory.weights import weight_bytes

int4_70b = weight_bytes("llama-3-70b", "int4")
print(f"Llama 3 70B in int4: {int4_70b['total'] / 1e9:.1f} GB of weights (int4 matrices "
      f"{int4_70b['matrices'] / 1e9:.1f} GB, their scales {int4_70b['scales'] / 1e9:.1f} GB, "
      f"embeddings and norms in bf16 {int4_70b['other'] / 1e9:.1f} GB); bf16: "
      f"{weight_bytes('llama-3-70b', 'bf16')['total'] / 1e9:.1f} GB")

# %% [markdown]
# ### Inference with a KV cache, on 2 ranks
#
# The same split model can generate: each rank caches the keys and values of *its own heads*
# (1/t of the cache), and the greedy choice is the argmax over the vocabulary shards. It must pick
# exactly the tokens the single-device model picks:

# %%
# NBVAL_CHECK_OUTPUT
def serve(ctx, cfg, prompt, new_tokens):
    return run_tp.generate(ctx, run_tp.build_tp_model(cfg), prompt, new_tokens)


prompt = torch.tensor([[5, 12, 19, 26], [40, 41, 42, 43]])
(tokens, cache_bytes), _ = labkit.launch(serve, 2, RunConfig(), prompt, 10)
expected = run_tp.reference_generate(build_model(RunConfig()), prompt, 10)
print("TP=2 generation equals the single-device greedy generation:", torch.equal(tokens,
                                                                               expected))
print(f"KV cache on each rank: {cache_bytes:,} bytes (half of the heads)")

# %% [markdown]
# ## Explore: a real model under TP
#
# Pick a model, TP degree, sequence parallelism, the link and the batch shape. All three panels
# are modelled by `labkit.theory` (mixed-precision Adam training memory; ring collectives; compute
# at the in-step GEMM rate); a redraw takes milliseconds. An NVLink domain is one 8-GPU node,
# so at TP=16 the group spans two nodes and the link list offers InfiniBand only. Compare TP=8
# over NVLink with TP=8 over PCIe (no NVLink) and with TP=16 over InfiniBand, and watch SP take
# the activations down.

# %%
tp_explorer()

# %% [markdown]
# ## Against PyTorch
#
# `bench/tensor_parallel.py` runs labkit's `parallelize_module` beside PyTorch's with
# `ColwiseParallel` / `RowwiseParallel` (DTensor) on the same weights, input and 2 gloo ranks (an
# MLP block and a whole transformer block), in interleaved rounds with instrumentation off on both
# sides, and writes its rows into `data/bench.csv` (`labkit_over_torch`: labkit's number over
# PyTorch's, the median of the per-round ratios; `spread_min`-`spread_max`: their range):

# %%
bench = pd.read_csv("../data/bench.csv", dtype=str, keep_default_na=False)   # as written
latest = bench[bench.benchmark == "tensor_parallel"].drop_duplicates("metric", keep="last")
latest[["metric", "labkit", "torch", "labkit_over_torch", "spread_min", "spread_max", "rounds"]]


# %% [markdown]
# ## The roofline: why the batch does not help TP
#
# Data parallelism and FSDP hide their communication behind a large enough batch per GPU
# (lessons 01 and 04): their compute grows with the tokens, their bytes do not. TP is different.
# Per layer and token, a GPU computes 6·P_layer/t FLOPs (its 1/t of the layer's matmul weights)
# and sends, for each of the 4 all-reduces of an h-wide activation (2 forward, 2 backward),
# 2(t−1)/t·h·e bytes. Both grow with the tokens, so the **arithmetic intensity** has no batch in
# it:
#
#   I_TP = 6·P_layer/t / (8(t−1)/t·h·e) = 3·P_layer / (4·h·e·(t−1))
#
# (= 9h/(e(t−1)) for a plain block of 12h² weights). It must reach the **ridge**, the GPU's
# FLOP/s over the link's bytes/s, for the all-reduces to be able to hide: only a wider model, a
# smaller t or a faster link gets there. For Llama 3 70B (its layer's weights with grouped-query
# attention and the SwiGLU MLP; bf16; all modelled by `labkit.theory.roofline`, bandwidth term,
# at the H100's bf16 peak):

# %%
from labkit.theory import catalog
from labkit.theory import roofline

llama70 = catalog.model("llama-3-70b")
h = llama70.hidden
layer = (2 * h * h + 2 * h * llama70.kv_heads * llama70.head_dim   # q, o; k, v (GQA)
         + 3 * h * llama70.ffn)                                    # SwiGLU: gate, up, down
rows = [dict(tp=t, intensity_FLOPs_per_byte=roofline.tp_intensity(h, layer, t),
             **{f"hides on {link}": roofline.tp_intensity(h, layer, t)
                >= roofline.ridge("H100", link) for link in ("NVLink 4", "InfiniBand NDR")})
        for t in (2, 4, 8, 16, 32)]
for link in ("NVLink 4", "InfiniBand NDR"):
    print(f"ridge of an H100 over {link}: {roofline.ridge('H100', link):,.0f} FLOPs per byte; "
          f"the largest TP degree whose all-reduces can hide: "
          f"{roofline.tp_max_degree(h, layer, 'H100', link)}")
pd.DataFrame(rows).round(0)

# %%
ts = list(range(2, 33))
fig, ax = plt.subplots(figsize=(8, 4))
ax.semilogy(ts, [roofline.tp_intensity(h, layer, t) for t in ts], "o-", ms=3,
            label=f"TP intensity, {llama70.display_name} layer (any batch)")
for link, style in (("NVLink 4", "-"), ("InfiniBand NDR", "--")):
    ax.axhline(roofline.ridge("H100", link), color="black", ls=style, lw=1,
               label=f"ridge: H100 over {link}")
ax.axvline(8, color="0.6", ls=":", lw=1)
ax.text(8.3, roofline.tp_intensity(h, layer, 2), "8 GPUs: one\nNVLink node", fontsize=8,
        color="0.4", va="top")
ax.set_xlabel("TP degree t")
ax.set_ylabel("FLOPs per byte sent (modelled)")
ax.set_title("Tensor parallelism's roofline: intensity falls as 1/(t−1), whatever the batch")
ax.legend(fontsize=8, frameon=False)
ax.grid(alpha=0.3, which="both", lw=0.4)
fig.tight_layout()
plt.show()

# %% [markdown]
# Over NVLink a 70B layer is wide enough to hide its all-reduces up to the degree printed above
# (past a node's 8 GPUs), while across InfiniBand, whose ridge is as many times higher as its
# bandwidth is lower, it shrinks to the second degree printed: that is the roofline's reason
# for "TP inside a node", the same conclusion as the step times above, and it holds for every
# batch size. (Hiding also needs the overlap itself: Megatron's plain TP
# waits for each all-reduce; async TP splits the matmul so that one chunk's collective runs
# while the next chunk multiplies.)

# %% [markdown]
# ## Async TP: hide the all-gather under the matmul
#
# With sequence parallelism each colwise layer **waits** for the all-gather of its input, and
# each rowwise layer's reduce-scatter waits for its whole matmul. But a ring all-gather is
# t−1 steps that each pass one sequence chunk to the next rank, and the matmul of the gathered
# input is t independent matmuls, one per chunk. Interleave them: multiply the chunk you hold
# while the next one travels. That is the *collective matmul* of Wang et al. 2023 ("Overlap
# communication with dependent computation via decomposition in large deep learning models",
# ASPLOS), which PyTorch ships as async TP (`torch.distributed._symmetric_memory`'s
# `fused_all_gather_matmul` / `fused_matmul_reduce_scatter`). The reduce-scatter after a rowwise
# matmul is the same ring run the other way: the running sum of a chunk travels while the next
# chunk multiplies. In backward the two swap (an all-gather's gradient is a reduce-scatter).
#
# `parallelize_module(model, None, plan, sequence_parallel=True, async_tp=True)` does this with
# visible `comm.send` / `comm.recv` calls (`labkit/parallel/async_tp.py`). It moves exactly
# the bytes of the plain collectives, in t−1 messages. Below, 2 ranks train TinyGPT and a wider
# MLP block one step each way, against one device (the lab's float64 rule), and the virtual
# clock (modelled on 8×H100 NVLink) splits every message into exposed and hidden time.

# %%
from labkit.runs import async_tp as run_async
from labkit.theory import async_tp as theory_async
from labkit.viz.async_tp import chunk_timeline

found = labkit.launch(run_async.compare, 2)[0]
rows = []
for (model, mode), r in found.items():
    rows.append({"model": model, "TP": mode, "loss = 1 device": r["loss"].ok,
                 "params = 1 device": r["params"].ok, "wire MB": r["wire_bytes"] / 1e6,
                 "sends": r["calls"].get("send", 0),
                 "seq. comm µs (modelled)": r["sequence"]["modelled_s"] * 1e6,
                 "hidden": f"{r['sequence']['share']:.1%}",
                 "step µs (modelled)": r["step_s"][-1] * 1e6})
print(pd.DataFrame(rows).to_string(index=False))
for (model, mode), r in found.items():
    print(f"{model}, {mode}: parameters {r['params']}")

# %% [markdown]
# Both paths equal one device to rounding and send the same bytes; the async path's sequence
# traffic is all sends. The modelled hidden share shows *when* the ring pays: in TinyGPT a
# chunk's matmul takes nanoseconds on an H100 while each message pays the link's latency
# (microseconds), so almost nothing hides; in the wider MLP a chunk's matmul is a fair part of
# a message, and that part hides. How the steps line up, modelled for one layer on H100s:

# %%
fig, axes = plt.subplots(2, 1, figsize=(9, 6.4))
chunk_timeline(4096, 8192, 28672, 8, ax=axes[0])   # Llama-3-70B's fc1 at TP=8, one 4k sequence
chunk_timeline(256, 4096, 14336, 8, ax=axes[1])    # an 8B model's fc1, 256 tokens
plt.show()

# %%
big = theory_async.all_gather_matmul(4096, 8192, 28672, 8)
print(f"Modelled, Llama-3-70B fc1 at TP=8 on H100 NVLink, 4096 tokens: the plain all-gather "
      f"takes {big['all_gather_s'] * 1e6:.0f} µs before {8 * big['compute_s'] * 1e6:.0f} µs of "
      f"matmul; async hides {big['hidden_s'] / big['comm_s']:.0%} of it, "
      f"{big['plain_s'] * 1e6:.0f} -> {big['total_s'] * 1e6:.0f} µs "
      f"({1 - big['total_s'] / big['plain_s']:.0%} less) per colwise layer.")

# %% [markdown]
# At scale it buys back the TP communication that sequence parallelism leaves on the critical
# path (the sentence above: the whole all-gather, once a chunk's matmul outlasts its message;
# exercise 3 finds from how many tokens); below that, only the part of each message that a
# chunk's matmul covers.
# On these CPU ranks it does not pay in wall time: two shared cores have no spare engine to
# move data while they multiply (`bench/async_tp.py` measures it), and PyTorch's own
# `fused_all_gather_matmul` needs CUDA symmetric memory (on CPU it raises NotImplementedError).

# %% [markdown]
# ## Takeaways
#
# - Column-parallel then row-parallel needs **one all-reduce per MLP and one per attention** in
#   forward (g) and the same in backward (f): 4 all-reduces of b·s·h per block, measured in the
#   log exactly as the formula says, and the result equals one device to float32 rounding.
# - `parallelize_module(model, device_mesh, plan)` applies this to any module: globs and styles,
#   the module changed in place, the layers holding this rank's shard of the original weights.
# - Weights, gradients and optimizer state shrink to ~1/t; activations shrink only partly, since
#   the LayerNorm regions stay replicated, until **sequence parallelism** shards them along the
#   sequence with the same communication volume (all-gather + reduce-scatter).
# - TP communicates inside every layer, on the critical path: affordable over NVLink, ruinous
#   over InfiniBand (for Llama 3 70B, TP=16 across two nodes is slower than TP=8 in one, in the
#   table above). So TP stays inside a node; data and pipeline parallelism span the nodes
#   (combining them: lesson 06).
# - For serving, TP divides the weights and the KV cache across the GPUs of a node.
# - **Async TP** cuts the sequence all-gather / reduce-scatter into a ring of chunk messages
#   that travel while the previous chunk multiplies: the same bytes, hidden once a chunk's
#   matmul outlasts its message.

# %% [markdown]
# ## Exercises
#
# Three exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · The row-parallel forward.** Write the forward of a row-parallel linear. You get this
# rank's slice of the input features `x_shard` (4 × 8/t), the matching columns of the weight
# `weight_shard` (6 × 8/t), the full `bias` (6), the `group`, and `ctx`. Return the full output (4
# × 6), the same on every rank. Where does the all-reduce go, and where the bias?
# (`tp.reduce_from_tp(y, group)` is g; `ctx.comm.all_reduce(y, group=group)` sums in place.)
# `check_row_parallel` runs your function on 2 ranks and says what is wrong, if anything (it
# returns a `Check`: `.ok`, `.problem`).

# %% tags=["solution"]
def my_row_parallel_forward(ctx, x_shard, weight_shard, bias, group):
    partial = F.linear(x_shard, weight_shard)               # this rank's share of every output
    return tp.reduce_from_tp(partial, group, "exercise") + bias   # sum over ranks, bias once


# %%
check = check_row_parallel(my_row_parallel_forward)

# %% [markdown]
# **2 · The bytes of one block.** Llama 3 70B (hidden size h = 8,192) is trained with TP = 8
# inside a node, one sequence of s = 4,096 tokens per micro-batch (b = 1), bf16 activations, no
# sequence parallelism. How many bytes does **each GPU send** for one transformer block and one
# micro-batch, forward and backward together, with ring collectives? Write it as an expression
# that shows the derivation.

# %% tags=["solution"]
S = 1 * 4096 * 8192 * 2                            # one b x s x h activation in bf16, bytes
block_bytes_per_gpu = 4 * 2 * (8 - 1) / 8 * S      # 2 all-reduces forward + 2 backward

# %%
check_block_bytes(block_bytes_per_gpu);

# %% [markdown]
# **3 · When does the ring hide?** Llama 3 70B's fc1 (h_in = 8,192 → h_out = 28,672) runs with
# TP = 8 and sequence parallelism on H100s over NVLink 4, bf16, async TP: a chunk holds T/8 of
# the micro-batch's T tokens. Find the T at which one chunk's matmul (at the in-step GEMM rate,
# `in_step_gemm_rate(gpu)` in FLOP/s) takes exactly as long as the message carrying the chunk
# (latency alpha + bytes / effective bandwidth). `hardware.cluster("8xH100-NVLink")` has `.gpu`
# and the link `.intra` with `.latency` and `.effective_bandwidth`.

# %% tags=["solution"]
node = hardware.cluster("8xH100-NVLink")
matmul_s_per_token = 2 * 8192 * (28672 / 8) / in_step_gemm_rate(node.gpu)
message_s_per_token = 8192 * 2 / node.intra.effective_bandwidth
# (T/8) * matmul_s_per_token = alpha + (T/8) * message_s_per_token, solved for T
break_even = 8 * node.intra.latency / (matmul_s_per_token - message_s_per_token)

# %%
check_break_even_tokens(break_even);

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
# # 04 · ZeRO: data parallelism without the redundant copies
#
# **The idea** (Rajbhandari et al. 2020, *ZeRO: Memory Optimizations Toward Training Trillion
# Parameter Models*, arXiv 1910.02054). Data parallelism (lesson 01) keeps a *full* copy of the
# model states on each of the N GPUs. With Ψ parameters and mixed-precision Adam that is 2Ψ bytes
# of bf16 weights, 2Ψ of bf16 gradients and KΨ of optimizer state, K = 12 (the fp32 master
# weights, momentum and variance, 4 + 4 + 4): **(2 + 2 + K)Ψ = 16Ψ bytes per GPU, N times over**.
# Each GPU only *updates* 1/N of the parameters if the work is split, so most of that memory is
# redundant. ZeRO cuts the states into N shards, one per GPU, in three stages:
#
# | | per GPU | 7.5B params, N = 64 |
# |---|---|---|
# | baseline DP | (2 + 2 + K)Ψ | 120 GB |
# | stage 1: shard the optimizer state | 2Ψ + 2Ψ + KΨ/N | 31.4 GB |
# | stage 2: ... and the gradients | 2Ψ + (2 + K)Ψ/N | 16.6 GB |
# | stage 3: ... and the parameters | (2 + 2 + K)Ψ/N | 1.9 GB |
#
# (in fp32 without mixed precision the 2s become 4s and K = 8: momentum and variance only).
#
# **Communication.** DP all-reduces the gradients: a ring all-reduce sends 2(N−1)/N·Ψ elements
# per GPU, ≈ 2Ψ. Stage 2 replaces it by a *reduce-scatter* of the gradients (each GPU gets the
# average of its own shard, Ψ) and, after each GPU has updated its shard, an *all-gather* of the
# new weights (Ψ): **the same ≈ 2Ψ as DP**. Stage 1 as PyTorch's `ZeroRedundancyOptimizer` runs
# it keeps DP's all-reduce (2Ψ: every rank gets every gradient, though it steps only its share)
# and then sends the updated weights out (Ψ): **3Ψ**; the paper's stage 1 reduce-scatters
# instead, and costs 2Ψ like stage 2. Stage 3 has no full weights anywhere, so it all-gathers
# each layer just before its forward and again before its backward (2Ψ) besides the
# reduce-scatter: **3Ψ, 1.5× DP**. This lesson runs all three stages on 4 CPU ranks, measures the
# memory and the bytes, and checks them against these formulas.

# %%
import inspect
import math

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import Markdown, display

import labkit
from labkit import FullyShard
from labkit.exercises.zero import check_gradient_shard, check_stage_memory_answer, show_solution
from labkit.parallel.fully_shard import layer_units
from labkit.runs import data_parallel as dp
from labkit.runs import zero
from labkit.runs.reference import RunConfig, build_model, train_mixed_precision
from labkit.theory import catalog, hardware, memory as tm, zero as theory_zero
from labkit.viz import memory_stack
from labkit.viz import zero_widgets as zw

pd.set_option("display.precision", 3)
pd.set_option("display.width", 120)

# %% [markdown]
# ## How it is built
#
# Three building blocks, each usable on your own `nn.Module` in your own training loop (lesson 01
# has a plain `nn.Sequential` trained with `FullyShard` against one device):
#
# - **stage 1**: `DistributedDataParallel(model)` averages the gradients, and
#   `ShardedOptimizer(model.parameters(), torch.optim.Adam, stage=1)` (like PyTorch's
#   `ZeroRedundancyOptimizer`) gives each rank whole tensors worth about 1/N of the bytes: it
#   keeps optimizer state for those only, steps them, and broadcasts them to the others.
# - **stage 2**: `ShardedOptimizer(..., stage=2)` packs the parameters into flat buckets padded to
#   a multiple of N; backward hooks reduce-scatter each bucket's gradient as soon as it is
#   complete, and each rank keeps only its slice (`labkit/parallel/zero.py`).
# - **stage 3**: `FullyShard(model)` (like PyTorch's `fully_shard`, FSDP2) cuts the model into
#   units (here: its layers), lays each unit's parameters out in one flat buffer padded to a
#   multiple of N, and keeps only this rank's slice: `model.parameters()` *are* the shards, so an
#   ordinary optimizer steps them (`labkit/parallel/fully_shard.py`). A unit's full weights exist
#   only while it computes. The hook that runs before each unit's forward, and the gather it calls:

# %%
print(inspect.getsource(FullyShard._pre_forward))
print(inspect.getsource(FullyShard._gather))

# %% [markdown]
# ## Run it: baseline and three stages on 4 ranks, against one device
#
# Four runs of the tiny GPT, 2 steps of a global batch of 8 sequences split over 4 ranks. The
# **baseline** is lesson 01's data parallelism (`labkit.runs.data_parallel`): a full replica per
# rank, measured the same way.
#
# We train with **fp32 Adam** (K = 8): ZeRO is about the optimizer state, so plain SGD (K = 0)
# would leave stage 1 nothing to shard. Adam's update divides by √v, which can amplify a rounding
# difference in a gradient that is pure noise: the attention *key* bias has a true gradient of 0
# (softmax ignores a constant shift of a row of scores), so backward computes rounding noise for
# it, and Adam's step lr·m/(√v + eps) turns noise far above eps into steps of up to lr.
# `labkit.runs.reference.build_optimizer` uses eps = 1e-6 instead of 1e-8, far above that noise,
# so the step stays about lr·noise/eps. The float32 single-device reference makes such noise too,
# so each report judges "equal" against the same run in float64: within a few times float32's own
# error there (`labkit.numerics`, as in lesson 01), the key bias included.

# %%
cfg = RunConfig(steps=2, global_batch=8, optimizer="adam")
N = 4
runs = {"baseline DP": dp.report(N, cfg)}
for stage in zero.STAGES:
    runs[f"ZeRO-{stage}"] = zero.report(N, cfg, stage=stage)
psi = runs["ZeRO-1"]["config"]["param_count"]
print(f"tiny GPT: {psi:,} parameters")
for label, r in runs.items():
    print(f"{label:12s} loss {[round(x, 4) for x in r['loss']]}  reference "
          f"{[round(x, 4) for x in r['reference_loss']]}\n  parameters: "
          f"{r['agreement']['params']['verdict']}")

# %%
# NBVAL_CHECK_OUTPUT
for label, r in runs.items():
    print(f"{label:12s} losses equal the reference (within float32 rounding): "
          f"{r['agreement']['loss']['ok']}; parameters equal the reference's: "
          f"{r['agreement']['params']['ok']}")

# %% [markdown]
# ## Measure it: bytes per rank, against the paper's formulas
#
# Each rank's memory tracker counts what it holds: the parameters (full, or the shards in
# stage 3), the gradients (full in stage 1, the reduced shard in 2 and 3), the optimizer state
# (Adam's two moments of what this rank steps), and what autograd saves for backward. The formula
# column is `labkit.theory.memory.model_state_bytes` in fp32: 4Ψ + 4Ψ + 8Ψ divided as the stage
# says.

# %%
rows = []
for stage, (label, r) in enumerate(runs.items()):
    formula = tm.model_state_bytes(psi, mixed_precision=False, zero_stage=stage, world_size=N)
    measured = r["memory"][0]
    for cat in zw.STATE_CATEGORIES:
        rows.append(dict(run=label, category=cat, measured=measured[cat],
                         formula=formula[cat], ratio=measured[cat] / formula[cat]))
memory_table = pd.DataFrame(rows).pivot(index="run", columns="category",
                                        values=["measured", "ratio"]).reindex(list(runs))
memory_table["measured"] = memory_table["measured"].astype(int)
memory_table[("states, MB", "")] = memory_table["measured"].sum(axis=1) / 1e6
memory_table[("activations, MB", "")] = [r["memory"][0]["activations"] / 1e6
                                         for r in runs.values()]
memory_table

# %%
fig = memory_stack(zw.measured_beside_predicted(runs), unit="MB",
                   title=f"tiny GPT, fp32 Adam, {N} ranks: memory of rank 0 (measured beside "
                   "modelled)")
plt.show()

# %%
states = {label: sum(r["memory"][0][c] for c in zw.STATE_CATEGORIES) / 1e6
          for label, r in runs.items()}
act = runs["ZeRO-3"]["memory"][0]["activations"] / 1e6
smaller = [label for label, s in states.items() if s < act]
stage1_opt = [runs["ZeRO-1"]["memory"][r]["optimizer"] for r in range(N)]
display(Markdown(f'''
The model states shrink as the formulas say: {" → ".join(f"{s:.2f}" for s in states.values())}
MB per rank from DP to stage 3, a factor of {states["baseline DP"] / states["ZeRO-3"]:.2f}
≈ N = {N} overall. The optimizer state goes first (stage 1), then the gradients (stage 2), then
the weights (stage 3). The activations do not change: every rank still runs forward and backward
on its {cfg.global_batch // N} sequences, {act:.2f} MB per rank. Against DP's
{states["baseline DP"]:.2f} MB of states they are the smaller part; once ZeRO has cut the
states, they are the larger one in {", ".join(smaller) or "no run"}. That is why real ZeRO
runs care about activations too (checkpointing, ZeRO-R): after stage 3 they are what is left.

Stage 1's ratio is not exactly 1: it hands out *whole tensors*, largest first to the
least-loaded rank, so the ranks' optimizer bytes are {", ".join(f"{b:,}" for b in stage1_opt)}
against {8 * psi / N:,.0f} for an exact quarter (balanced to within one tensor).
'''))

# %% [markdown]
# **Padding.** Stages 2 and 3 cut flat buffers (stage 2: gradient buckets; stage 3: one buffer per
# layer) into N equal slices, so each buffer is padded up to a multiple of N: fewer than N extra
# elements per buffer. A small MLP with layers of 33·65+65, 65·31+31 and 31·7+7 parameters does
# not divide by 4, and shows the remainder:

# %%
odd_cfg = RunConfig(model="mlp", steps=2, global_batch=8, optimizer="adam",
                    model_kwargs=dict(dims=(33, 65, 31, 7)))
odd = zero.report(N, odd_cfg, stage=3)
layers = [sum(p.numel() for p in m.parameters())
          for _, m in layer_units(build_model(odd_cfg))]
print("layer sizes:", layers, "-> padded to a multiple of 4:", [-(-u // N) * N for u in layers])
odd_formula = tm.model_state_bytes(sum(layers), mixed_precision=False, zero_stage=3,
                                   world_size=N)
print(pd.DataFrame({"measured": {c: odd["memory"][0][c] for c in zw.STATE_CATEGORIES},
                    "formula (unpadded Ψ)": {c: odd_formula[c] for c in zw.STATE_CATEGORIES}}))


# %%
# NBVAL_CHECK_OUTPUT
def padded_layout_bytes(padded, n, stage, w=4, k=8):
    # what the flat layout holds: full buffers (stage 2) or shards (stage 3) of padded elements
    return dict(params=w * (padded // n if stage == 3 else padded), grads=w * padded // n,
                optimizer=k * padded // n)


for stage in (2, 3):
    r = runs[f"ZeRO-{stage}"]
    exact = padded_layout_bytes(r["config"]["padded_param_count"], N, stage)
    print(f"ZeRO-{stage}: every rank's params/grads/optimizer bytes equal the padded layout:",
          all(r["memory"][k][c] == exact[c] for k in range(N) for c in zw.STATE_CATEGORIES))
one = runs["ZeRO-1"]["memory"]
print("ZeRO-1: every rank holds all 4Ψ weights and 4Ψ gradients:",
      all(one[k]["params"] == one[k]["grads"] == 4 * psi for k in range(N)),
      "- and the ranks' optimizer bytes add up to 8Ψ:",
      sum(one[k]["optimizer"] for k in range(N)) == 8 * psi)
exact = padded_layout_bytes(odd["config"]["padded_param_count"], N, 3)
print("odd MLP, ZeRO-3: equal to the padded layout:",
      all(odd["memory"][0][c] == exact[c] for c in zw.STATE_CATEGORIES))
print("padding elements in the odd MLP:", odd["config"]["padded_param_count"] - sum(layers),
      "=", [-u % N for u in layers])

# %%
pad = odd["config"]["padded_param_count"] - sum(layers)
display(Markdown(f'''
{pad} padding elements on {sum(layers):,} parameters: the measured stage-3 bytes are
{100 * pad / sum(layers):.2f}% above Ψ/N ({odd["config"]["padded_param_count"] // N:,} elements
per rank instead of {sum(layers) / N:,.0f}). For a real model the remainder is under N elements
per buffer against millions: invisible. The tiny GPT's stage-3 layers carry
{runs["ZeRO-3"]["config"]["padded_param_count"] - psi} padding elements.
'''))


# %% [markdown]
# ## Communication per step: the comm log against 2Ψ and 3Ψ
#
# Every collective goes through `ctx.comm` and is logged with its payload; the wire bytes are the
# ring model's (N−1)/N per all-gather, reduce-scatter or broadcast and 2(N−1)/N per all-reduce
# (modelled from the payloads: gloo does not report its own). DataParallel's one broadcast of the
# weights when it is built is set-up, not a training step, and is left out of the per-step bytes.

# %%
def wire_per_step(report, ops=None):
    return sum(row["wire_bytes_per_rank"] for row in report["comm"]
               if ops is None or row["op"] in ops) / report["steps"]


def per_step(label, r):
    return wire_per_step(r, {"all_reduce"} if label == "baseline DP" else None)


comm_rows, table = {}, []
dp_formula = 2 * (N - 1) / N * psi * 4        # ring all-reduce of 4Ψ bytes of fp32 gradients
for stage, (label, r) in enumerate(runs.items()):
    formula = dp_formula if stage == 0 else theory_zero.formula_wire_bytes(psi, N, stage, 4)
    comm_rows[label] = dict(measured=per_step(label, r), formula=formula)
    ops = ", ".join(f"{row['calls'] // cfg.steps} {row['op']}" for row in r["comm"]
                    if label != "baseline DP" or row["op"] == "all_reduce")
    table.append(dict(run=label, collectives_per_step=ops, wire_bytes=per_step(label, r),
                      formula=formula,
                      vs_DP=per_step(label, r) / per_step("baseline DP", runs["baseline DP"])))
fig = zw.comm_per_step_figure(comm_rows, title=f"tiny GPT, fp32, {N} ranks: bytes sent per rank "
                              "and step (ring model)")
plt.show()
pd.DataFrame(table).set_index("run")

# %%
# NBVAL_CHECK_OUTPUT
dp_bytes = per_step("baseline DP", runs["baseline DP"])
for label in ("ZeRO-1", "ZeRO-2", "ZeRO-3"):
    r = runs[label]
    logged = sum(row["wire_bytes_per_rank"] for row in r["comm"])
    print(f"{label}: bytes / DP's = {per_step(label, r) / dp_bytes:.3f}; log equals the "
          f"per-buffer plan: {logged == r['predicted_comm_bytes_per_rank']}")

# %%
extra = per_step("ZeRO-3", runs["ZeRO-3"]) - per_step("ZeRO-2", runs["ZeRO-2"])
display(Markdown(f'''
Stage 2 moves DP's bytes, {per_step("ZeRO-2", runs["ZeRO-2"]) / dp_bytes:.3f}× (a ring
all-reduce *is* a reduce-scatter followed by an all-gather: ZeRO does the optimizer step in
between, on the shard; padding its buckets to a multiple of N can add a few bytes). Stage 1
moves
{per_step("ZeRO-1", runs["ZeRO-1"]) / dp_bytes:.2f}×: DP's all-reduce and then the owners'
broadcasts of the updated weights. Stage 3 moves {per_step("ZeRO-3", runs["ZeRO-3"]) /
dp_bytes:.2f}× DP: the extra Ψ is the second gather of every layer before its backward. Here it
costs {extra / 1e6:.2f} MB per rank and step (ring model); on a real model the price is paid only
if the gathers cannot hide behind compute, which is what the prefetch is for.
'''))

# %% [markdown]
# ## Watch the prefetch hide the gathers
#
# `FullyShard(prefetch=True)` (the default) starts the all-gather of the *next* unit as soon as
# this one begins its forward (and of the previous unit in backward), so its weights travel
# while this unit computes; `prefetch=False` gathers each unit only when it is needed, and the
# compute waits for every gather. The virtual clock runs the async collectives on a comm lane
# beside compute (a GPU's comm stream), one at a time, and notes for each how much the compute
# had to wait for it (**exposed**) and how much ran under compute (**hidden**).
#
# The gathers can hide only if a unit computes for longer than the next one takes to arrive:
# the tokens per GPU decide it (the roofline section below). So this run uses the wider GPT of
# lesson 01 (hidden 128, 4 layers) and 128 sequences of 32 tokens per rank, ZeRO-3 on 2 ranks,
# one step each way, modelled on an 8xH100 NVLink node:

# %%
from labkit.runtime import trace
from labkit.viz.overlap import overlap_timeline

wide = RunConfig(steps=1, global_batch=256, optimizer="sgd",
                 model_kwargs=dict(hidden=128, layers=4, ffn=512))
fsdp = {f"FullyShard, prefetch={p}": labkit.launch(zero.train, 2, wide, stage=3, prefetch=p)
        for p in (True, False)}
timelines = {label: [e for r in res for e in r["timeline"]] for label, res in fsdp.items()}
hiding = {label: trace.overlap_by_op(tl, rank=0) for label, tl in timelines.items()}
fig = overlap_timeline(timelines, summaries=hiding,
                       title=f"ZeRO-3 on 2 ranks, one step (modelled on "
                             f"{fsdp['FullyShard, prefetch=True'][0]['cluster']})")
plt.show()
rows = [dict(run=label, op=op, calls=r["calls"], modelled_us=r["modelled_s"] * 1e6,
             exposed_us=r["exposed_s"] * 1e6, hidden_us=r["hidden_s"] * 1e6,
             hidden_share=r["hidden_s"] / r["modelled_s"])
        for label, ops in hiding.items() for op, r in ops.items()]
pd.DataFrame(rows).set_index(["run", "op"]).round(2)

# %%
# NBVAL_CHECK_OUTPUT
on, off = (hiding[f"FullyShard, prefetch={p}"]["all_gather"] for p in (True, False))
step_on, step_off = (fsdp[f"FullyShard, prefetch={p}"][0]["modelled_step_s"][-1]
                     for p in (True, False))
print("prefetch leaves less all-gather time exposed:", on["exposed_s"] < off["exposed_s"])
print("the same gathers either way:", on["calls"] == off["calls"])
print("modelled step shorter with prefetch:", step_on < step_off)

# %%
shortest = min(e["end"] - e["start"] for e in timelines["FullyShard, prefetch=True"]
               if e["rank"] == 0 and e["name"] == "all_gather")
display(Markdown(f'''
Rank 0, one step (modelled): the {on["calls"]} all-gathers take {on["modelled_s"] * 1e6:.1f} µs
on the link either way. Without prefetch all of it is exposed; with it
{on["hidden_s"] * 1e6:.1f} µs ({on["hidden_s"] / on["modelled_s"]:.0%}) runs under the previous
unit's forward or the next unit's backward, and the step takes {step_on * 1e6:.1f} µs instead of
{step_off * 1e6:.1f} µs. What stays exposed (hatched) follows layers with almost no compute to
hide under: the token and position embeddings come first, so the first block's gather waits in
full, and the final LayerNorm comes before the head. Even the smallest gather takes
{shortest * 1e6:.1f} µs, nearly all of it the link's latency: few bytes do not make it free.
The reduce-scatters share the one comm lane with the backward prefetches, and the last ones end
the step.

The same two runs on this machine's wall clock: a collective's bar runs from its issue to the
moment its result was there. With prefetch each gather is issued a unit early, so its bar spans
the previous unit's forward: the communication is in flight while the compute runs, the
structure the modelled chart times as on H100s. (Two CPU processes on a shared machine: the
proportions are this machine's.)
'''))
fig = overlap_timeline(timelines, clock="wall", title="the same runs, measured on this machine")
plt.show()

# %% [markdown]
# ## The peak over a step, not only the steady state
#
# The table above is what a rank holds *between* steps. During a step there is more: activations
# build up in forward and drain in backward; stage 3 holds the layer it is computing *gathered*,
# the next one already arriving (prefetch), and the full gradient of a layer until its
# reduce-scatter lands (the gradient bucket). The tracker samples memory whenever one of these
# buffers comes or goes (rank 0, the last step of ZeRO-3):

# %%
fig = zw.step_memory_compare({"ZeRO-3": runs["ZeRO-3"]["step_memory"][0]}, unit="KB")
plt.show()
for name in ("ZeRO-2", "ZeRO-3"):
    r = runs[name]
    samples = r["step_memory"][0]
    buffers = max(s["buffers"] for _, s in samples)
    modelled = (f" (modelled gather + prefetch: {r['predicted_memory']['buffers']:,.0f})"
                if name == "ZeRO-3" else "")
    print(f"{name}: measured peak {r['memory'][0]['peak']:,} bytes at "
          f"'{r['memory'][0]['peak_phase']}'; largest transient buffers {buffers:,} bytes"
          + modelled)

# %%
# NBVAL_CHECK_OUTPUT
samples = runs["ZeRO-3"]["step_memory"][0]
block = sum(p.numel() for p in build_model(cfg).blocks[0].parameters())
both = next(s for phase, s in samples if phase == "+prefetch blocks.1")["buffers"]
print("stage 3 holds block 0 gathered while block 1 is prefetched (>= 2 fp32 blocks):",
      both >= 2 * 4 * block)
print("stage 3's measured peak includes transient buffers:",
      runs["ZeRO-3"]["memory"][0]["peak"] > sum(runs["ZeRO-3"]["memory"][0][c]
                                                 for c in zw.STATE_CATEGORIES))
print("nothing transient left after the step:",
      all(r["memory"][0]["buffers"] == 0 for name, r in runs.items() if name != "baseline DP"))

# %%
three = runs["ZeRO-3"]
forward = samples[:[phase for phase, _ in samples].index("after forward")]
backward = samples[len(forward):]
two = runs["ZeRO-2"]["step_memory"][0]
after_backward = next(s for phase, s in two if phase == "after backward")["grads"]
display(Markdown(f'''
In stage 3 rank 0 keeps only its {three["memory"][0]["params"] / 1e3:.0f} KB shard of the
weights, but while block 0 computes, its full weights ({block:,} parameters,
{4 * block / 1e3:.0f} KB in fp32) and block 1's incoming prefetch are there as well: the
bumps in forward, {max(s["buffers"] for _, s in forward) / 1e3:.0f} KB at most. The modelled
`buffers` (the two largest layers, {three["predicted_memory"]["buffers"] / 1e3:.0f} KB) count
exactly these. In backward the measured buffers go higher,
{max(s["buffers"] for _, s in backward) / 1e3:.0f} KB: the gathered block and the prefetched
one, plus the gradient bucket of the block just finished while its reduce-scatter is in flight.
The measured peak, {three["memory"][0]["peak"] / 1e3:.0f} KB, comes at
'{three["memory"][0]["peak_phase"]}'. A real ZeRO-3 budgets for "a few full layers" on top of
Ψ/N for the same reason.

Stage 2 counts its transient full-gradient buckets as gradients: after backward rank 0 holds
{after_backward / 1e3:.0f} KB of them against {runs["ZeRO-2"]["memory"][0]["grads"] / 1e3:.0f}
KB once the last bucket's reduce-scatter has landed.
'''))

# %% [markdown]
# ## Real models: the paper's 7.5B on 64 GPUs
#
# The same formulas for a 7.5B-parameter model, mixed-precision Adam, 64 GPUs, against the 32 GB
# of the V100s the paper used:

# %%
# NBVAL_CHECK_OUTPUT
paper = tm.zero_stage_table(7.5e9, 64, mixed_precision=True)
print("GB per GPU of model states, 7.5B params, 64 GPUs, mixed-precision Adam (K = 12):")
print((paper[["params", "grads", "optimizer", "total"]] / 1e9).round(2).to_string())

# %%
fig = memory_stack(zw.stage_bars(7.5e9, 64), capacity={"32 GB (V100)": 32e9}, unit="GB",
                   title="7.5B params on 64 GPUs, mixed-precision Adam: model states per GPU "
                   "(modelled)")
plt.show()

# %% [markdown]
# 120 GB → 31.4 → 16.6 → 1.9 GB: the paper's Figure 1. Without ZeRO the model states alone are
# almost four times a 32 GB GPU; stage 1 gets them just under it (with no room for activations),
# stage 2 leaves half the GPU free, stage 3 leaves nearly all of it.
#
# ## Explore: which stages fit?
#
# Pick a model from the catalog, a GPU and the number of data-parallel GPUs. The bars are model
# states only (activations come on top), modelled by `labkit.theory.memory`. The slider offers
# powers of two; the smallest GPU counts that fit are computed below.

# %%
h100 = hardware.gpu("H100 SXM")


def fewest_gpus(model, stage, gpu=h100):
    # the smallest N whose per-GPU model states fit (None: no N does, the replicated part is
    # already larger than the GPU)
    psi = catalog.model(model).param_count()
    per = lambda n: tm.model_state_bytes(psi, zero_stage=stage, world_size=n)["total"]  # noqa
    if per(10**9) > gpu.memory_bytes:
        return None
    return next(n for n in range(1, 10**6) if per(n) <= gpu.memory_bytes)


def pow2(n):
    return 2 ** math.ceil(math.log2(n))


def say(n):
    return "never, whatever N" if n is None else f"from {n} GPUs (slider: {pow2(n)})"


l8, l70, l405 = (catalog.model(m) for m in ("Llama 3 8B", "Llama 3 70B", "Llama 3.1 405B"))
dp_8b = tm.model_state_bytes(l8.param_count(), zero_stage=0)["total"]
display(Markdown(f'''
On {h100.name}s (sold as 80 GB; {h100.memory_bytes / 1e9:.1f} GB as the driver reports it;
mixed-precision Adam): Llama 3 8B needs
{dp_8b / 1e9:.0f} GB per GPU in plain DP; with ZeRO, stage 1 fits {say(fewest_gpus(l8.name, 1))},
stage 2 {say(fewest_gpus(l8.name, 2))}, stage 3 {say(fewest_gpus(l8.name, 3))}. Llama 3 70B:
stage 3 {say(fewest_gpus(l70.name, 3))}; stages 1 and 2 {say(fewest_gpus(l70.name, 2))} (their
replicated bf16 weights alone are {2 * l70.param_count() / 1e9:.0f} GB). Llama 3.1 405B with
stage 3: {say(fewest_gpus(l405.name, 3))}, before activations.
'''))

# %%
zw.zero_explorer()

# %% [markdown]
# ## The source article's "tenfold"
#
# The source article says of ZeRO that "the authors demonstrated tenfold increases in training
# efficiency over state-of-the-art methods". What the paper reports: its implementation (stages
# 1 and 2, "ZeRO-100B") trained models of over 100B parameters on 400 GPUs, with "an 8x increase
# in model size and 10x increase in achievable performance over state-of-the-art", the baseline
# being Megatron-LM model parallelism. So the claim holds in the sense the paper measured:
# throughput for 100B-parameter models on that cluster. It is not a tenfold gain in general:
# at sizes that already fit with plain data parallelism, ZeRO-2 sends the same bytes as DP
# (measured above) and does not make a step faster (at best the freed memory allows a larger
# batch per GPU); the speed-up comes from *not* having to split a large model across nodes with
# tensor parallelism, whose communication on the critical path is slow over InfiniBand
# (lesson 03).
#
# What the memory saving buys is easier to state: the largest model whose states fit. Per GPU,
# mixed-precision Adam needs 16 bytes per parameter in DP, 4 + 12/N in stage 1, 2 + 14/N in
# stage 2, 16/N in stage 3:

# %%
# NBVAL_CHECK_OUTPUT
counts = (1, 8, 64, 1024)
largest = pd.DataFrame({f"{n} GPUs": [tm.largest_trainable_params(h100, n, s) / 1e9
                                      for s in range(4)] for n in counts},
                       index=zw.STAGE_LABELS)
print(f"largest model (billions of parameters) whose states fit in an {h100.name}:")
print(largest.round(1).to_string())
print("stage 2 / DP as N grows:", round(tm.largest_trainable_params(h100, 10**6, 2)
                                       / tm.largest_trainable_params(h100, 1, 0), 2))

# %%
fig = zw.largest_model_figure("H100 SXM", gpu_counts=(1, 4, 16, 64, 256, 1024))
plt.show()

# %% [markdown]
# DP stays at the same size however many GPUs are added. Stages 1 and 2 approach a limit of 4×
# and 8× that (the replicated 4 or 2 bytes per parameter remain, against DP's 16); only stage 3
# grows with N without limit (the table above). The paper's "8x increase in model size" is a
# different quantity: the largest model ZeRO-100B trained against the largest the
# state-of-the-art system (Megatron-LM) trained on the same 400-GPU cluster, two systems measured
# side by side. That it equals the stage-2 ceiling 16/2 here is a coincidence: the ceiling is a
# per-GPU bound as N → ∞ for model states alone, the paper's ratio a measurement at one N with
# activations, buffers and a different baseline. So "tenfold" is the right order for the paper's
# throughput measurement at 100B parameters; for the memory it is too little for stage 3 at
# scale and too much for stage 1.
#
# ## Offload: the shards in host memory
#
# ZeRO-Offload (Ren et al. 2021) keeps the fp32 master weights and the Adam moments in CPU memory
# and runs the optimizer step there. `FullyShard(..., offload=True)` does this for stage 3: the
# shards the optimizer steps, their gradients, and so the optimizer's state live in host memory;
# each step copies every shard to the device before its two gathers (in bf16) and every gradient
# shard back. **On this CPU-only machine host and device are the same memory**: the split below
# is modelled (what would be on the GPU), and so are the PCIe times on the clock. One stage-3 run
# in mixed precision (K = 12) with `offload=True`:

# %%
off = zero.report(N, cfg, stage=3, mixed_precision=True, offload=True)
mem = off["memory"][0]
padded = off["config"]["padded_param_count"]
print(f"on the device (rank 0, modelled split): params {mem['params']:,} B, grads "
      f"{mem['grads']:,} B, optimizer {mem['optimizer']:,} B")
print(f"in host memory: {off['offloaded_bytes']:,} B = (4 + 4 + 8) x padded Ψ / N = "
      f"{16 * padded // N:,} (fp32 shards, their gradients, Adam's moments)")
mixed_reference = train_mixed_precision(cfg, zero.COMPUTE_DTYPE)["params"]
gaps = torch.cat([(off["params"][k] - mixed_reference[k]).abs().reshape(-1)
                  for k in mixed_reference])
close = (gaps < 1e-4).float().mean().item()
print(f"max |param - mixed-precision reference| {gaps.max():.1e}; {close:.1%} of the "
      f"{gaps.numel():,} elements within 1e-4")
print("losses", [round(x, 3) for x in off["loss"]], "reference",
      [round(x, 3) for x in off["reference_loss"]])
pcie = [e for e in off["timeline"] if e["rank"] == 0 and e["name"].startswith("offload")]
pcie_s = sum(e["end"] - e["start"] for e in pcie) / cfg.steps
print(f"modelled PCIe copies per step: {pcie_s * 1e6:.1f} µs of a "
      f"{off['modelled_step_s'] * 1e6:.1f} µs step (modelled, 8xH100 node)")

# %%
# NBVAL_CHECK_OUTPUT
units = len(off["flat_numels"])   # FullyShard's units: the GPT's layers
print("params, grads and optimizer bytes on the device:",
      [off["memory"][0][c] for c in zw.STATE_CATEGORIES])
print("host bytes = 16 x padded Ψ / N:", off["offloaded_bytes"] == 16 * padded // N)
print("PCIe copies on the timeline per rank = 3 per layer and step:",
      len(pcie) == 3 * units * cfg.steps)

# %%
fig = zw.offload_gantt(off["timeline"], ranks=(0, 1),
                       title="ZeRO-3 + offload, ranks 0 and 1 of 4, 2 steps, modelled 8xH100 node")
plt.show()

# %%
display(Markdown(f'''
The PCIe copies (pink, on the compute lane: the step waits for them) sit before each gather of a
layer (its bf16 shard down to the device) and after backward (each gradient shard up to the
host); the host's optimizer step is not timed by the model (its FLOPs are elementwise and
uncounted). On this tiny model every transfer is mostly latency: {len(pcie) // cfg.steps}
copies per step take {pcie_s * 1e6:.1f} µs of the modelled {off["modelled_step_s"] * 1e6:.1f}
µs. On a real model they carry 2Ψ/N bytes of weights twice and 2Ψ/N of gradients per step, and
the CPU's Adam step adds to them: the price of training a model whose states would not fit on
the GPUs.

The loss matches the mixed-precision single-device reference within bf16's resolution.
{close:.1%} of the parameters are within 1e-4 of the reference's; the others differ by up to
{gaps.max():.1e}, about one learning rate ({cfg.lr}): Adam divides by √v, so where a gradient
is as small as its bf16 rounding, the two summation orders (4 shards averaged, or one batch)
give steps of different size or sign. (The tests check the same algorithm with SGD, where every
stage stays within 1e-4 of the reference, and that offload changes nothing, bit for bit,
against the same run without it.)
'''))

# %% [markdown]
# ## The roofline: when can FSDP's communication hide?
#
# ZeRO-3 (FSDP) sends 3(N−1)/N·Ψ·e bytes per GPU and step (two all-gathers of the weights, one
# reduce-scatter of the gradients; e = 2 bytes in bf16), DP 2(N−1)/N·Ψ·e. Both can overlap
# their collectives with compute (FSDP prefetches the next unit's weights during this one's
# forward), but overlap only helps if the compute is the longer of the two. A step on B tokens
# per GPU computes 6·Ψ·B FLOPs, so its **arithmetic intensity**, FLOPs per byte sent, is
#
#   I_DP = 6ΨB / (2(N−1)/N·Ψe) ≈ 3B/e,      I_FSDP = 6ΨB / (3(N−1)/N·Ψe) ≈ 2B/e:
#
# Ψ cancels and only the **tokens per GPU** count. The hardware has its own ratio, the
# **ridge**: FLOP/s of the GPU over bytes/s of the link. Below it the step waits for the link
# however well it overlaps; above it the communication can hide. (`labkit.theory.roofline`, all
# modelled, bandwidth term only, at the GPU's bf16 peak.)

# %%
from labkit.theory import roofline
from labkit.viz.roofline import roofline_figure

# DP only: FSDP's line over InfiniBand is exercise 3 at the end, derived before it is drawn
fig = roofline_figure(64, "H100", links=("NVLink 4", "InfiniBand NDR"), techniques=("dp",))
plt.show()
rows = [dict(link=link, ridge_FLOPs_per_byte=roofline.ridge("H100", link),
             DP_min_tokens_per_GPU=roofline.critical_batch("dp", 64, "H100", link))
        for link in ("NVLink 4", "InfiniBand NDR")]
pd.DataFrame(rows).round(0)

# %% [markdown]
# DP's line crosses each ridge at B*, and the slower link moves B* by the ratio of the
# bandwidths. In sequences of 4,096 tokens, DP's B* over InfiniBand is a few sequences per GPU:
# easy for pre-training, not for a small fine-tuning batch. FSDP sends more bytes per step, so
# its B* lies further right; exercise 3 at the end asks for it over InfiniBand (the table and
# the figure leave it out, so that you derive it first).

# %%
ratio = per_step("ZeRO-3", runs["ZeRO-3"]) / dp_bytes
display(Markdown(f'''
## Takeaways

- Data parallelism keeps N copies of (2 + 2 + K)Ψ bytes of model states. ZeRO keeps one,
  spread: stage 1 shards the optimizer state, stage 2 the gradients as well, stage 3 the
  weights too. Measured here: {" → ".join(f"{s:.2f}" for s in states.values())} MB per rank on
  {N} ranks, equal to the formula up to padding of fewer than N elements per buffer (and, in
  stage 1, the balance of whole tensors).
- Stage 2 costs nothing extra on the wire: reduce-scatter + all-gather is what DP's all-reduce
  is made of (measured: {per_step("ZeRO-2", runs["ZeRO-2"]) / dp_bytes:.2f}× DP). Stage 1 after
  DP's all-reduce, and stage 3 with its second gather, move {ratio:.2f}× DP.
- The steady state is not the peak: stage 3 holds a gathered layer, the prefetched next one and
  a gradient bucket while it computes, and the activations come on top of it all.
- The paper's 7.5B-parameter model on 64 GPUs: 120 → 31.4 → 16.6 → 1.9 GB per GPU. Stages 1
  and 2 raise the largest trainable model by at most 4× and 8×; only stage 3 grows with N.
- The source article's "tenfold" is the paper's throughput result for 100B-parameter models
  against Megatron-LM, not a general speed-up: below that scale ZeRO-2 moves the same bytes as
  DP.
'''))


# %% [markdown]
# ## Exercises
#
# Three exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · A ZeRO-2 gradient shard.** After backward every rank holds the gradient of its own part
# of the batch, the whole flat vector. ZeRO-2 keeps only this rank's 1/N slice of the *averaged*
# gradient, and moves no more bytes than it needs. Write `my_gradient_shard(ctx, grad)`: return
# this rank's slice (slice r of dim 0 on rank r) of the gradient averaged over all ranks.
# `ctx.comm` has `all_reduce`, `reduce_scatter` and `all_gather`. The checker runs it on 4 ranks,
# each with a different gradient of 16 values.

# %% tags=["solution"]
def my_gradient_shard(ctx, grad):
    mine = ctx.comm.reduce_scatter(grad)   # sum over ranks; rank r keeps slice r of dim 0
    return mine / ctx.world_size           # each rank's loss is a mean: average, not sum


# %%
check_gradient_shard(my_gradient_shard);

# %% [markdown]
# **2 · Stage 2 for Llama 3 8B on 8 GPUs.** How many bytes of model states does each GPU hold
# when Llama 3 8B (8.03B parameters) is trained with mixed-precision Adam and ZeRO stage 2 on 8
# GPUs? Write it as an expression that shows the derivation, in bytes.

# %% tags=["solution"]
zero2_bytes_per_gpu = (2 + (2 + 12) / 8) * 8.03e9   # bf16 weights whole; grads + Adam state / N

# %%
check_stage_memory_answer(zero2_bytes_per_gpu, params=8.03e9, world_size=8, stage=2);

# %% [markdown]
# **3 · One more: the roofline of FSDP.** What is the smallest per-GPU batch, in tokens, at
# which FSDP (ZeRO-3) on 64 H100s over 400 Gb/s InfiniBand NDR can be compute-bound? Use the
# H100's dense bf16 peak (`hardware.gpu("H100").flops("bf16")`), the link's effective bandwidth
# (`hardware.link("InfiniBand NDR").effective_bandwidth`: the lab's link model delivers the
# fraction `efficiency` of the line rate), bf16 weights and gradients, and the ring's bytes
# per GPU. Write it as an expression that shows the derivation.

# %% tags=["solution"]
fsdp_min_tokens = (hardware.gpu("H100").flops("bf16")
                   / hardware.link("InfiniBand NDR").effective_bandwidth   # FLOPs per byte
                   * 3 * (64 - 1) / 64 * 2 / 6)    # bytes per parameter sent / FLOPs per token

# %%
from labkit.exercises.zero import check_fsdp_critical_batch

check_fsdp_critical_batch(fsdp_min_tokens);

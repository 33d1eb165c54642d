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
# # 01 · Data parallelism: replicas, an all-reduce, and hiding it under backward
#
# **The idea.** Put a full copy of the model on each of N GPUs. Split every global batch into N
# equal shards; each replica runs forward and backward on its own shard. The loss is a mean over
# examples, so the *average* of the N shard gradients is exactly the full-batch gradient. One
# collective, an **all-reduce** that averages the gradients across the replicas, therefore makes
# every replica take the same optimizer step a single GPU would take on the whole batch: the same
# numbers, with 1/N of the compute per GPU.
#
# **The price.** The all-reduce moves data every step. The ring algorithm cuts the S gradient
# bytes into N chunks and passes them around a ring twice (reduce-scatter, then all-gather), so
# each GPU sends
#
# $$\text{bytes per GPU per step} = \frac{2(N-1)}{N}\,S \;<\; 2S \quad\text{whatever } N.$$
#
# The traffic per GPU does not grow with N, but it does not shrink either, while the compute per
# GPU does: with enough GPUs the step is all communication. PyTorch's `DistributedDataParallel`
# fights this by **overlapping**: gradients are grouped into buckets and each bucket's all-reduce
# starts while backward is still computing the earlier layers (Li et al. 2020).
#
# This lesson runs labkit's `DistributedDataParallel` (torch's name and signature) on CPU ranks
# (gloo), checks it against one device, puts it on a model and a training loop of your own, measures
# the traffic, builds the ring from `send`/`recv`, shows the overlap on a modelled H100 timeline,
# and checks two claims of the source article.

# %%
import inspect
import os
import statistics
from types import SimpleNamespace

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from IPython.display import Markdown, display

import labkit
from labkit import numerics
from labkit.exercises import reset_hints
from labkit.exercises.data_parallel import check_ring_all_reduce, check_ring_bytes, show_solution
from labkit.parallel.data_parallel import DistributedDataParallel, ring_all_reduce
from labkit.runs import data_parallel as dp
from labkit.runs.reference import RunConfig, batch, build_model, float64_reference, train
from labkit.theory import catalog, data_parallel as theory_dp, memory as tm, time as tt
from labkit.viz import comm_bars, gantt, speedup_curve
from labkit.viz import dp_widgets
from labkit.viz.overlap import accumulation_bars

pd.set_option("display.precision", 3)
pd.set_option("display.width", 120)

# %% [markdown]
# ## 1 · Run it: four replicas against one device
#
# `dp.train` (`labkit/runs/data_parallel.py`) builds the tiny GPT on every rank, wraps it in
# `labkit.DistributedDataParallel` (the building block, `labkit/parallel/data_parallel.py`), takes
# its shard of each batch with `data.shard(batch, rank, N)`, runs forward and backward, and steps.
# The wrapper is the technique: when it is built, rank 0 broadcasts its weights so that every
# replica starts equal; during backward a hook on each parameter copies its gradient into a flat
# **bucket**, and a full bucket's all-reduce (average) starts at once, asynchronously; when backward
# ends it waits for them and leaves the averaged gradients in `.grad`.
#
# We use plain SGD for this check, so the comparison is about the parallelism only. (With Adam,
# one tensor, the attention *key* bias, has a true gradient of exactly 0 that softmax cancels; its
# computed gradient is float noise, which Adam turns into steps of lr·noise/(|noise| + eps): up
# to lr when the noise exceeds eps, and different for *any* two summation orders.)

# %%
cfg = RunConfig(steps=3, global_batch=8, optimizer="sgd")   # the tiny GPT, 8 sequences of 32


def train_and_log(ctx, cfg, **options):
    # A function defined in a notebook cell runs on every rank (sent by value).
    out = dp.train(ctx, cfg, **options)
    out["log"] = ctx.comm.dataframe()
    return out


results = labkit.launch(train_and_log, 4, cfg, bucket_mb=0.25)
reference = train(cfg)
loss = dp.global_loss(results)   # the mean over ranks of each shard's loss = full-batch loss
print(pd.DataFrame({"4 ranks (mean of shard losses)": loss, "one device": reference["loss"]}))

# %% [markdown]
# The numbers cannot be *bit for bit* equal: 4 ranks add the same gradients in another order, and
# float32 rounds each order differently (so does each CPU's own arithmetic). What does "equal"
# mean then? Run the single-device reference once more in float64 (nearly exact), and measure how
# far float32 itself lands from it. A parallel run whose distance is within a few times float32's
# own is equal up to rounding; a real bug (a missing all-reduce) is off by a whole gradient step.
# The distance is the root mean square over every parameter, not the largest difference: the
# largest of thousands of rounding errors is a lucky or unlucky draw, and can flip from one CPU
# to the next. `labkit.numerics.compare` does this and returns the verdict with its numbers:

# %%
exact = float64_reference(cfg)
params_check = numerics.compare(results[0]["params"], reference["params"], exact["params"])
loss_check = numerics.compare_loss(loss, reference["loss"], exact["loss"])
print(f"parameters after {cfg.steps} steps: {params_check}")
print(f"losses: {loss_check}")

# %%
# NBVAL_CHECK_OUTPUT
print(f"4 ranks equal one device (parameters and losses, within float32 rounding): "
      f"{bool(params_check) and bool(loss_check)}")

# %% [markdown]
# The two methods that do the work: the hook that backward calls once a parameter's gradient is
# complete, and the launch, which starts full buckets *in bucket order* on every rank (a
# collective is matched with the other ranks' by its place in that order, whatever order the
# hooks fired in):

# %%
print(inspect.getsource(DistributedDataParallel._on_gradient))
print(inspect.getsource(DistributedDataParallel._launch))


# %% [markdown]
# ## 2 · Your own model, your own loop
#
# `labkit.DistributedDataParallel` works on any `nn.Module` in any training loop, as PyTorch's does
# (same name, same arguments): wrap the model, give each rank its slice of the batch, and keep the
# loop as it is. Below, a plain `nn.Sequential` regression trained with AdamW. The function runs on
# 2 ranks under `labkit.launch`; in a script of your own you would start it with `torchrun` or
# `mp.spawn` after `init_process_group`, and the wrapper finds the process group by itself. The
# reference is *the same function* on one device (rank 0 of 1: the whole batch, no wrapper).

# %%
def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 1))


def make_batch(step, size=32, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, 16, generator=g).to(dtype)
    return x, x[:, :4].sum(dim=1, keepdim=True).sin()


def full_weights(model):
    if hasattr(model, "full_state_dict"):      # a sharded model gathers its pieces
        return model.full_state_dict()
    inner = getattr(model, "module", model)    # a wrapper keeps the original in .module
    return {name: p.detach().clone() for name, p in inner.named_parameters()}


def my_training(ctx, wrap, steps=5, dtype=torch.float32):   # float64: the exact reference
    model = wrap(make_model().to(dtype))        # the one line data parallelism adds
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = make_batch(step, dtype=dtype)    # the global batch; keep my slice
        per_rank = len(x) // ctx.world_size
        mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
        loss = F.mse_loss(model(x[mine]), y[mine])
        optimizer.zero_grad()
        loss.backward()                         # gradients averaged by the end of backward
        optimizer.step()
    return full_weights(model)


alone = SimpleNamespace(rank=0, world_size=1)
one_device = my_training(alone, wrap=lambda model: model)
exact = my_training(alone, wrap=lambda model: model, dtype=torch.float64)
with_dp = labkit.launch(my_training, 2, labkit.DistributedDataParallel)[0]
dp_check = numerics.compare(with_dp, one_device, exact)
print(f"DistributedDataParallel on 2 ranks, after 5 AdamW steps, parameters: {dp_check}")

# %%
# NBVAL_CHECK_OUTPUT
print(f"DistributedDataParallel equals one device (within float32 rounding): {bool(dp_check)}")

# %% [markdown]
# `labkit.FullyShard` (lesson 04's ZeRO stage 3) goes in the same place: each rank then keeps only
# its 1/N shard of every weight, gradient and optimizer state, and the weights are gathered layer
# by layer when they are needed. The loop does not change; only the wrapper does.

# %%
with_fsdp = labkit.launch(my_training, 2, labkit.FullyShard)[0]
fsdp_check = numerics.compare(with_fsdp, one_device, exact)
print(f"FullyShard on 2 ranks, after 5 AdamW steps, parameters: {fsdp_check}")

# %%
# NBVAL_CHECK_OUTPUT
print(f"FullyShard equals one device (within float32 rounding): {bool(fsdp_check)}")

# %% [markdown]
# ## 3 · Measure it: the comm log against 2(N−1)/N
#
# Every collective goes through `ctx.comm`, which logs it. With 0.25 MiB buckets (`bucket_mb`
# is in MiB, 2**20 bytes, as DDP's `bucket_cap_mb`) the tiny model's fp32 gradients become two
# buckets, so each step is two all-reduces. The log also holds the
# broadcasts of the weights when the wrapper was built (one per tensor, once per run); the clock
# sends nothing through the collectives (its issue times go to the launch's key-value store).

# %%
log = results[0]["log"]
log.loc[log.op == "all_reduce", ["op", "tag", "group_size", "bytes", "wire_bytes_per_rank",
                                 "async_op"]].head(4)

# %%
# NBVAL_CHECK_OUTPUT
n = 4
grad_bytes = theory_dp.gradient_bytes(build_model(cfg))
measured = log.loc[log.op == "all_reduce", "wire_bytes_per_rank"].sum()
formula = 2 * (n - 1) / n * grad_bytes * cfg.steps
print(f"gradient bytes per step S      = {grad_bytes:,}")
print(f"wire bytes per rank, comm log  = {measured:,.0f}")
print(f"2(N-1)/N x S x {cfg.steps} steps        = {formula:,.0f}")

# %%
fig = comm_bars(results[0]["comm"], title="rank 0, 3 steps on 4 ranks (logged)")


# %% [markdown]
# ## 4 · The ring all-reduce, from `send` and `recv`
#
# `ring_all_reduce(ctx, tensor, group=None)` (in `labkit/parallel/data_parallel.py`) is written
# with nothing but point-to-point messages. Cut the tensor into N chunks. **Reduce-scatter:** in
# step s (of N−1), rank r sends chunk (r−s) mod N to its right neighbour and adds the chunk
# arriving from its left into chunk (r−s−1) mod N. After N−1 steps, rank r holds the complete
# sum of chunk (r+1) mod N.
# **All-gather:** N−1 more steps pass the finished chunks around the ring. Each step moves one
# chunk of S/N bytes per rank, so each rank sends 2(N−1)·S/N: at most 2S whatever N is, while a
# naive "everyone sends everything to everyone" would send (N−1)·S.
#
# To avoid a deadlock, each step *posts* its send (`async_op=True`), then receives, then waits.

# %%
# NBVAL_CHECK_OUTPUT
def ring_vs_library(ctx, numel):
    t = torch.arange(numel, dtype=torch.float32) * (ctx.rank + 1)
    mine = ring_all_reduce(ctx, t.clone())
    sent = sum(r.bytes for r in ctx.comm.records if r.op == "send")
    return torch.equal(mine, ctx.comm.all_reduce(t.clone())), sent


S = 96 * 4   # 96 float32 numbers
rows = []
for n in (2, 3, 4, 8):
    out = labkit.launch(ring_vs_library, n, 96)
    rows.append(dict(N=n, equals_all_reduce=all(ok for ok, _ in out),
                     sent_per_rank=out[0][1], formula=2 * (n - 1) / n * S,
                     naive_send_everything=(n - 1) * S))
print(pd.DataFrame(rows).to_string(index=False))

# %% [markdown]
# ## 5 · Overlap on the virtual timeline
#
# The CPU ranks also run a **modelled clock**: each compute region advances by its counted FLOPs
# at an H100's in-step GEMM rate (`theory.step_rate.in_step_gemm_rate`: the planner's rate of a
# large GEMM inside a step), each collective by its alpha-beta time on NVLink. Async
# all-reduces run on a separate *comm lane* (the thin bar under each rank), so overlap shows.
#
# On a tiny model communication dominates: the overlap can hide at most the backward pass. What
# matters is the ratio of compute to gradient bytes, which is the number of **tokens per GPU**.
# So this run uses a wider GPT (hidden 128, 4 layers) and a global batch of 128 sequences of 32
# tokens (2,048 tokens per rank), 1 MiB buckets, on 2 ranks.

# %%
big = RunConfig(steps=2, global_batch=128, optimizer="sgd",
                model_kwargs=dict(hidden=128, layers=4, ffn=512))
print(f"{sum(p.numel() for p in build_model(big).parameters()):,} parameters, "
      f"{theory_dp.gradient_bytes(build_model(big)) / 1e6:.1f} MB of fp32 gradients")
runs = {}
for overlap in (True, False):
    runs[overlap] = labkit.launch(dp.train, 2, big, bucket_mb=1.0, overlap=overlap)


def last_step(results):
    # modelled events of the last step, shifted to start at 0 (the first step warms up)
    out = []
    for r in results:
        begin = sum(r["modelled_step_s"][:-1])
        out += [dict(e, start=e["start"] - begin, end=e["end"] - begin)
                for e in r["timeline"] if e["start"] >= begin - 1e-12]
    return out


fig, axes = plt.subplots(2, 1, figsize=(10, 4.6), sharex=True)
for ax, overlap in zip(axes, (True, False)):
    gantt(last_step(runs[overlap]), ax=ax,
          title=f"bucketed, overlap={overlap}: one step on 2 modelled H100s (NVLink)")
fig.tight_layout()

# %%
# NBVAL_CHECK_OUTPUT
on, off = (runs[o][0]["modelled_step_s"][-1] for o in (True, False))
print(f"modelled step with overlap shorter than without: {on < off}")

# %%
print(f"modelled step time: overlap {on * 1e6:.1f} us, no overlap {off * 1e6:.1f} us "
      f"({(off - on) / off:.0%} shorter)")


def aligned_wall(results):
    # each rank's wall clock starts when its process does: align its first bar at 0
    out = []
    for r in results:
        t0 = min(e["wall_start"] for e in r["timeline"])
        out += [dict(e, wall_start=e["wall_start"] - t0, wall_end=e["wall_end"] - t0)
                for e in r["timeline"]]
    return out


wall = aligned_wall(runs[True])
fig = gantt(wall, clock="wall",
            title="the same run (overlap=True), both steps, measured on this machine's CPUs")
_ = fig.axes[0].set_xlim(0, 1.04 * max(e["wall_end"] for e in wall))   # room for the last bar


# %%
def per_step(results, clock, keep, span=False):
    # seconds per step of rank 0's events matching `keep`: their sum (bars one after another)
    # or, with span=True, first start to last end (bars that overlap, like waits in a row)
    lo, hi = ("start", "end") if clock == "modelled" else ("wall_start", "wall_end")
    marks = [0.0]
    for t in results[0]["modelled_step_s"]:
        marks.append(marks[-1] + t)
    out = []
    for begin, end in zip(marks, marks[1:]):
        events = [e for e in results[0]["timeline"] if keep(e) and begin <= e["start"] < end]
        out.append(max(e[hi] for e in events) - min(e[lo] for e in events) if span
                   else sum(e[hi] - e[lo] for e in events))
    return statistics.mean(out)


def is_compute(e):
    return e["kind"] == "compute" and e["name"] in ("forward", "backward")


def is_bucket(e):
    return e["kind"] == "comm" and e["name"] == "all_reduce"


model_compute = per_step(runs[True], "modelled", is_compute)
model_comm = per_step(runs[False], "modelled", is_bucket, span=True)
wall_compute = per_step(runs[True], "wall", is_compute)
wall_comm = per_step(runs[False], "wall", is_bucket, span=True)   # nothing runs beside them
display(Markdown(f'''
The **modelled** chart is the story for H100s: one step computes for {model_compute * 1e6:.1f} µs
and its bucket all-reduces take {model_comm * 1e6:.1f} µs on NVLink
({model_comm / model_compute:.2f}× the compute). The purple bucket bars on the comm lane start
while backward (orange) is still running: {(off - on) / model_comm:.0%} of the communication
hides under it, the rest is exposed after backward.

The **measured** chart is what two CPU processes on this machine did: forward and backward took
{wall_compute * 1e3:.0f} ms per step, and the all-reduces, timed in the overlap=False run where
nothing else runs beside them (from the first launch to the last wait returning, the other rank
catching up included), {wall_comm * 1e3:.0f} ms per step over loopback
({wall_comm / wall_compute:.2f}× the compute). In the overlap=True chart a comm bar runs from
the bucket's launch to the moment its wait returned, so it also covers the rest of backward and
the other rank catching up. Those proportions are this machine's, not an H100's: the chart is
there to show that the modelled picture comes from a real run.
'''))

# %% [markdown]
# ## 6 · How far does it scale? Modelled on H100s, measured here
#
# `theory.time.dp_step_time` is the closed form: compute (6 FLOPs per matmul weight + 12·L·h·s for
# the attention scores) per token, tokens/N of them per GPU, at the in-step GEMM rate (the run
# clock's and the planner's; the input embedding is a lookup, no FLOPs; s = 4,096 for Llama 3
# 8B), plus the all-reduce of 2Ψ bytes of bf16 gradients in 25 MiB buckets, of which
# everything but the last bucket hides under backward. Within a node the ring runs on NVLink; beyond 8 GPUs it crosses
# InfiniBand, and the curve bends.
#
# Memory comes first, though: every replica holds the whole model's states, 16 bytes per
# parameter with mixed-precision Adam (bf16 weights and gradients, fp32 master weights and two
# moments), whatever N is.

# %%
gpus = [1, 2, 4, 8, 16, 32, 64]
cluster = lambda n: dp_widgets.cluster_for(n)   # 8 x H100 per node, NVLink in, IB NDR between
hbm = cluster(1).gpu.memory_bytes
for name in ("GPT-2 small", "Llama 3 8B"):
    psi = catalog.model(name).param_count()
    states = tm.model_state_bytes(psi)["total"]
    zero2 = next(n for n in gpus if tm.model_state_bytes(psi, zero_stage=2,
                                                         world_size=n)["total"] <= hbm)
    print(f"{name:12} {psi / 1e9:5.2f}B parameters: {states / 1e9:6.1f} GB of model states per "
          f"replica, {'fits' if states <= hbm else 'does NOT fit'} one 80 GB H100 "
          f"({hbm / 1e9:.1f}e9 bytes, as the driver reports it; ZeRO-2, which sends the same "
          f"bytes per step, fits from {zero2} GPU(s))")


# %%
def wall_step(n, cfg):
    out = labkit.launch(dp.train, n, cfg, threads=1)   # one core's worth per rank, as 1 GPU each
    per_step = [max(ts) for ts in zip(*(r["step_wall_s"] for r in out))][1:]
    return statistics.median(per_step)


small = RunConfig(steps=4, global_batch=32, model_kwargs=dict(hidden=128, layers=4, ffn=512))
wall = {n: wall_step(n, small) for n in (1, 2, 4)}

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
dp_widgets.scaling_plot(ax1, [("Llama 3 8B", 2**20), ("GPT-2 small", 2**17)], gpus,
                        title="modelled strong scaling on H100 nodes")
speedup_curve([1, 2, 4], {"measured wall clock, CPU ranks (gloo)":
                          [wall[1] / wall[n] for n in (1, 2, 4)]},
              ax=ax2, title=f"measured on this machine ({os.cpu_count()} CPU cores)")
fig.tight_layout()

# %% [markdown]
# The hollow Llama 3 8B curve is time modelled *as if* its states fitted (sharded ZeRO-2 style,
# lesson 04, which moves the same bytes per step as the all-reduce); plain data parallelism cannot
# run it on H100s at any GPU count.
#
# The measured curve is not the H100 story, and is not meant to be: every rank is a process on
# the same few CPU cores (one thread each), so past as many ranks as there are cores the ranks only
# split the same cores' time, and pay for gloo messages over loopback and process switching on top;
# on a shared or busy machine even the first step up is noisy. Speedup needs a processor per
# replica, which is what each GPU is.
#
# ## 7 · The article's two claims, with numbers
#
# **Claim 1** (source article): *"Iterating through the same training data can be up to twice as
# fast with double the number of GPUs in use, depending on the batch size."*

# %%
doublings = ((1, 2), (4, 8), (8, 16), (32, 64))
token_sizes = (2**14, 2**17, 2**20, 2**22)
speedup = {}   # (tokens, a, b) -> time(a GPUs) / time(b GPUs)
for tokens in token_sizes:
    for a, b in doublings:
        ta = tt.dp_step_time("Llama 3 8B", gpus=a, cluster=cluster(a), global_batch_tokens=tokens)
        tb = tt.dp_step_time("Llama 3 8B", gpus=b, cluster=cluster(b), global_batch_tokens=tokens)
        speedup[tokens, a, b] = ta["total"] / tb["total"]
table = pd.DataFrame([{"global batch (tokens)": f"{t:,}",
                       **{f"{a}->{b} GPUs": round(speedup[t, a, b], 2) for a, b in doublings}}
                      for t in token_sizes])
print("speedup from doubling the GPUs, Llama 3 8B, modelled (overlap on, 25 MiB buckets;\n"
      "its states sharded ZeRO-2 style so that it fits: the same bytes on the wire)")
print(table.to_string(index=False))


# %%
def how_fast(s):
    if s < 1:
        return f"makes the step **slower** ({s:.2f}×)"
    if s < 1.8:
        return f"is faster, but well short of 2× ({s:.2f}×)"
    return f"is close to 2× ({s:.2f}×)"


few, some, many = 2**14, 2**17, 2**20
at_many = [speedup[many, a, b] for a, b in doublings]
nvlink, ib = cluster(16).intra, cluster(16).inter
display(Markdown(f'''
It holds where compute dominates: at {many:,} tokens per step every doubling gives between
{min(at_many):.2f}× and {max(at_many):.2f}×, inside a node and across nodes. It stops holding
when the tokens per GPU get few, because the all-reduce does not shrink with N. The first step
across nodes, 8→16 GPUs ({nvlink.name} at {nvlink.bandwidth / 1e9:.0f} GB/s to {ib.name} at
{ib.bandwidth / 1e9:.0f} GB/s per GPU), {how_fast(speedup[few, 8, 16])} at {few:,} tokens and
{how_fast(speedup[some, 8, 16])} at {some:,}; at 32→64 GPUs doubling
{how_fast(speedup[few, 32, 64])} at {few:,} tokens and {how_fast(speedup[some, 32, 64])} at
{some:,}. "Up to" and "depending on the batch size" are both doing real work in that sentence.
(At a fixed batch size per GPU instead, "weak scaling", the step time stays nearly flat and the
throughput doubles, but each step then sees twice the data.)
'''))

# %% [markdown]
# **Claim 2** (source article): running Stable Diffusion at 2.6 s per batch on one H100 node, a
# second node "allows you to process 2 batches in 2.6 seconds, effectively reducing the inference
# time to 1.3 seconds per batch". Inference data parallelism needs no communication at all: each
# replica serves its own batches.

# %%
# NBVAL_CHECK_OUTPUT
latency = 2.6   # seconds per batch on one node (the article's number)
rows = []
for batches in (1, 2, 3, 10, 100):
    for nodes in (1, 2):
        r = theory_dp.inference_throughput(latency, replicas=nodes, batches=batches)
        rows.append(dict(batches=batches, nodes=nodes, makespan_s=r["makespan_s"],
                         s_per_batch=round(r["seconds_per_batch"], 2),
                         latency_per_batch_s=r["latency_s"], utilisation=r["utilisation"]))
inference = pd.DataFrame(rows)
print(inference.to_string(index=False))

# %%
row = lambda b, n: inference[(inference.batches == b) & (inference.nodes == n)].iloc[0]
display(Markdown(f'''
With a steady stream of batches the second node doubles throughput: 2 batches per
{row(2, 2).makespan_s:g} s, {row(100, 2).s_per_batch:g} s per batch *on average*. But no batch
finishes sooner: each still takes **{latency:g} s**, so a user waiting for one image waits just
as long. It stops holding when there are fewer batches than replicas (1 batch: the second node
idles, {row(1, 2).utilisation:.0%} utilisation) or an odd count (3 batches take
{row(3, 2).makespan_s:g} s, {row(3, 2).s_per_batch:g} s per batch). Cutting the latency of one
batch needs its work split (a smaller batch per node, or model parallelism), and a batch that is
already small does not get twice as fast at half the size.

The same thing on CPU ranks with the tiny GPT, on the modelled clock:
'''))

# %%
# NBVAL_CHECK_OUTPUT
model = build_model(RunConfig())
batches = [batch(model, RunConfig(), i)[0] for i in range(4)]
for n in (1, 2):
    out = labkit.launch(dp.infer, n, RunConfig(), batches)
    per_batch = out[0]["batch_s"][0]
    finish = max(r["finished_s"] for r in out)
    print(f"{n} replica(s), 4 batches: all done at {finish / per_batch:.0f} x the latency of "
          f"one batch; each batch still takes 1 x")

# %% [markdown]
# ## 8 · Explore: when does the all-reduce stop hiding?
#
# All modelled (theory only, so it redraws at once); the line above the panels says whether a
# replica's model states fit one GPU at all. Things to try: GPT-2 small at 16K tokens on 64 GPUs
# (communication-bound); the same at 4M tokens; 1 MiB buckets (latency-bound: many small messages)
# against 1000 MiB buckets (nothing left to overlap: one bucket arrives at the end of backward);
# PCIe instead of NVLink.

# %%
dp_widgets.dp_explorer()


# %% [markdown]
# ## 9 · Exposed or hidden: each collective on the clock, and a trace for Perfetto
#
# The modelled clock runs async collectives on a comm lane beside compute (the comm stream of a
# GPU), and notes for each one how much of it the compute lane had to wait for (**exposed**)
# and how much ran under compute (**hidden**). For the last step of the two runs of section 5,
# rank 0's bucket all-reduces (modelled):

# %%
from labkit.runtime import trace

rows = []
for overlap in (True, False):
    buckets = trace.overlap_by_op(last_step(runs[overlap]), rank=0)["all_reduce"]
    rows.append({"overlap": overlap, "all-reduces": buckets["calls"],
                 "modelled µs": buckets["modelled_s"] * 1e6,
                 "exposed µs": buckets["exposed_s"] * 1e6,
                 "hidden µs": buckets["hidden_s"] * 1e6,
                 "hidden share": buckets["hidden_s"] / buckets["modelled_s"]})
pd.DataFrame(rows).round(2)

# %% [markdown]
# The same step drawn per rank, compute on top and the comm lane under it; the hatched part of
# each all-reduce is the time the compute lane waited for it:

# %%
from labkit.viz.overlap import overlap_timeline

steps = {f"DDP, overlap={o}": last_step(runs[o]) for o in (True, False)}
fig = overlap_timeline(steps, summaries={k: trace.overlap_by_op(v, rank=0)
                                         for k, v in steps.items()},
                       title=f"one step, bucket all-reduces (modelled on "
                             f"{runs[True][0]['cluster']})")
plt.show()

# %% [markdown]
# Without overlap every bucket is exposed; with it, the buckets launched during backward hide
# under the rest of backward and only the tail is exposed, the share printed above.
#
# The whole timeline of a run (every rank; compute, each collective, each send and receive;
# the modelled lanes and the measured wall-clock lanes as separate processes) exports as a
# **Chrome trace**, the JSON that `torch.profiler` writes (`prof.export_chrome_trace(path)`)
# and that Perfetto opens: `trace.to_trace(timeline, path)` here, `to_trace(report, path)` for a
# run report (`labkit.runs.report`), or `python -m labkit run dp --world-size 2 --trace
# dp.json` on the command line. Open the file at https://ui.perfetto.dev ("Open trace file"):
# each rank is a process, with threads compute, comm, send and recv; click a bar to see its
# bytes, group and exposed/hidden microseconds.

# %%
import json
import os
import tempfile

trace_path = os.path.join(tempfile.mkdtemp(), "dp_overlap_trace.json")
trace.to_trace([e for r in runs[True] for e in r["timeline"]], trace_path,
               cluster=runs[True][0]["cluster"], technique="dp, overlap=True")
with open(trace_path) as f:
    events = json.load(f)["traceEvents"]
spans = [e for e in events if e["ph"] == "X"]
print(f"wrote {len(spans)} spans to {trace_path}")
pd.DataFrame(spans[:4])[["name", "ph", "ts", "dur", "pid", "tid", "args"]]

# %% [markdown]
# Reading the two kinds side by side: `torch.profiler` records what PyTorch *ran* in a process
# (every aten operator, autograd node, and the backend's collectives such as `gloo:all_reduce`)
# at this machine's speed; the lab's timeline records what the program *meant* (forward,
# backward, each bucket's all-reduce) on the modelled clock and on the wall clock. Below, rank 0
# of the same DP program (the wider GPT, 1 MiB buckets, 2 ranks) runs under
# `torch.profiler.profile(activities=[CPU], record_shapes=False)` (`labkit.runtime.profiler
# .profiled`: only rank 0 is profiled, inside its worker process; the other rank runs plainly).
# To keep it fast it is one step of a quarter of the batch, and the profile covers all of
# `dp.train`: the wrapper's set-up broadcasts, then the step. Both traces go to the same folder:

# %%
from labkit.runtime import profiler

one_step = RunConfig(steps=1, global_batch=32, optimizer="sgd", model_kwargs=big.model_kwargs)
folder = os.path.dirname(trace_path)
torch_path = os.path.join(folder, "dp_torch_profiler_rank0.json")
profiled_run = labkit.launch(profiler.profiled, 2, dp.train, one_step, bucket_mb=1.0,
                             path=torch_path)
summary = profiled_run[0]["profile"]
lab_path = os.path.join(folder, "dp_profiled_run_trace.json")
lab_timeline = [e for r in profiled_run for e in r["result"]["timeline"]]
trace.to_trace(lab_timeline, lab_path, cluster=profiled_run[0]["result"]["cluster"])
torch_events, lab_events = profiler.trace_events(torch_path), profiler.trace_events(lab_path)
print(f"torch.profiler, rank 0: {len(torch_events):,} events, {summary['operator_names']} "
      f"operator names -> {torch_path}")
print(f"lab timeline, both ranks, modelled and wall: {len(lab_events):,} events -> {lab_path}")
pd.DataFrame(summary["top_ops"], columns=["top ops by self CPU time (torch.profiler)",
                                          "self CPU µs", "calls"]).round(0)

# %%
lab_ops = {}
for row in profiled_run[0]["result"]["comm"]:   # rank 0's comm log: the program's collectives
    lab_ops[row["op"]] = lab_ops.get(row["op"], 0) + row["calls"]
lab_spans = {op: sum(1 for e in profiled_run[0]["result"]["timeline"]
                     if e["kind"] == "comm" and e["name"] == op) for op in lab_ops}
rows = [{"collective": op, "lab comm log (calls)": lab_ops[op], "lab timeline (spans)":
         lab_spans[op], "torch.profiler (gloo events)":
         summary["collectives"].get(f"gloo:{op}", 0)} for op in sorted(lab_ops)]
pd.DataFrame(rows).set_index("collective")

# %%
# NBVAL_CHECK_OUTPUT
gloo_all_reduce = summary["collectives"].get("gloo:all_reduce", 0)
print("every broadcast of the log is a gloo:broadcast in the profile:",
      summary["collectives"].get("gloo:broadcast", 0) == lab_ops["broadcast"])
print("every bucket all-reduce of the log is a gloo:all_reduce in the profile:",
      gloo_all_reduce == lab_ops["all_reduce"])

# %%
top_names = [name for name, _, _ in summary["top_ops"]]
matmuls = ", ".join(f"`{n}`" for n in top_names if n in ("aten::mm", "aten::addmm",
                                                           "aten::bmm", "aten::matmul"))
counter = ("`PythonDispatchMode` among them is the lab's own FLOP counter (a dispatch mode that "
           "sees every op, to time it on the modelled clock): a cost of this lab's "
           "instrumentation, not of training. " if "PythonDispatchMode" in top_names else "")
display(Markdown(f'''
Both files describe the same program. The profiler's top operators by self CPU time include the
matmuls of forward and backward ({matmuls or "none in the top five this time"}): the compute bars
of the lab's timeline. {counter}Its gloo events are the lab's collectives, one for one:
{lab_ops["broadcast"]} broadcasts (the replicas start from rank 0's weights) and
{lab_ops["all_reduce"]} bucket all-reduces; the profiler shows {gloo_all_reduce}
`gloo:all_reduce`. The virtual clock adds none: each collective sends its own bytes only, and
each rank's issue times reach its peers through the launch's key-value store.
What the profiler cannot show is the H100 picture: its times are this CPU's, and the modelled
lanes are the lab's. Open both files at https://ui.perfetto.dev.
'''))

# %% [markdown]
# ## 10 · Gradient accumulation: what `no_sync` saves
#
# A global batch too large for memory is split into K **micro-batches** per optimizer step: forward
# and backward each one, let the gradients add up in `.grad`, step once. Done naively, every
# backward all-reduces its gradients: K all-reduces of the S gradient bytes per step. But only the
# sum matters, and the average of sums is the sum of averages, so one all-reduce after the last
# micro-batch gives the same gradient. `DistributedDataParallel.no_sync()` (as in PyTorch) is that
# switch: a forward and backward inside it only accumulate locally. Per optimizer step:
#
#   bytes all-reduced = K·S without it,  S with it: **1/K of the traffic**.
#
# `dp.train(ctx, cfg, accumulate=K)` wraps the first K−1 micro-batches in `no_sync()`. The loop
# below does the same, with a switch to all-reduce every micro-batch instead, and both run on
# 2 ranks (the tiny GPT, 16 sequences per step, K = 4):

# %%
from contextlib import nullcontext

from labkit import data


def accumulate(ctx, cfg, k, use_no_sync):
    model = DistributedDataParallel(build_model(cfg), bucket_cap_mb=dp.DEFAULT_BUCKET_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    for step in range(cfg.steps):
        with ctx.step(step, cfg.steps):
            x, y = (data.shard(t, ctx.rank, ctx.world_size) for t in batch(model.module, cfg,
                                                                             step))
            optimizer.zero_grad(set_to_none=True)
            for i, (mx, my) in enumerate(zip(x.chunk(k), y.chunk(k))):
                last = i == k - 1
                with model.no_sync() if use_no_sync and not last else nullcontext():
                    with ctx.clock.compute("forward"):
                        loss = model(mx, my) / k     # K micro-means add up to the mean
                    with ctx.clock.compute("backward"):
                        loss.backward()
            optimizer.step()
    return dict(comm=ctx.comm.summary(), timeline=ctx.clock.timeline(),
                params={n: p.detach().clone() for n, p in model.module.named_parameters()})


K = 4
small = RunConfig(steps=2, global_batch=16, optimizer="sgd")
acc = {"all-reduce after\nevery micro-batch": labkit.launch(accumulate, 2, small, K, False),
       "no_sync on the first\nK−1 micro-batches": labkit.launch(accumulate, 2, small, K, True)}
S = theory_dp.gradient_bytes(build_model(small))
acc_rows = {}
for (label, res), formula in zip(acc.items(), (K * S, S)):
    log = [row for row in res[0]["comm"] if row["op"] == "all_reduce"]
    ops = trace.overlap_by_op(res[0]["timeline"], rank=0)["all_reduce"]
    acc_rows[label] = dict(bytes_per_step=sum(r["bytes"] for r in log) / small.steps,
                           calls_per_step=sum(r["calls"] for r in log) / small.steps,
                           formula_bytes=formula,
                           exposed_s=ops["exposed_s"] / small.steps)
fig = accumulation_bars(acc_rows, title=f"gradient accumulation, K = {K} micro-batches, 2 ranks:"
                        f" per optimizer step (S = {S / 1e6:.2f} MB of fp32 gradients)")
plt.show()
pd.DataFrame(acc_rows).T.assign(exposed_us=lambda d: d.exposed_s * 1e6).drop(
    columns="exposed_s").rename(index=lambda label: label.replace("\n", " "))

# %%
# NBVAL_CHECK_OUTPUT
every, quiet = acc_rows.values()
print("no_sync all-reduces 1/K of the bytes per step:",
      every["bytes_per_step"] == K * quiet["bytes_per_step"])
print("both equal the formula (K·S and S):", all(r["bytes_per_step"] == r["formula_bytes"]
                                                 for r in acc_rows.values()))
same = max((a - b).abs().max().item() for a, b in zip(
    *(res[0]["params"].values() for res in acc.values())))
print("the same parameters either way (float32 rounding):", same < 1e-5)
driver = labkit.launch(dp.train, 2, small, accumulate=K)   # the lab's driver: no_sync inside
print("dp.train(accumulate=K) all-reduces the same bytes per step:",
      sum(r["bytes"] for r in driver[0]["comm"] if r["op"] == "all_reduce") / small.steps
      == quiet["bytes_per_step"])

# %%
display(Markdown(f'''
Measured from rank 0's comm log: {every["bytes_per_step"] / 1e6:.2f} MB in
{every["calls_per_step"]:g} all-reduces per step without `no_sync`, {quiet["bytes_per_step"] /
1e6:.2f} MB in {quiet["calls_per_step"]:g} with it: 1/{K}, the formula. On the modelled clock
the exposed all-reduce time per step falls from {every["exposed_s"] * 1e6:.1f} µs to
{quiet["exposed_s"] * 1e6:.1f} µs (modelled, 2 H100s over NVLink): only the last micro-batch's
backward has buckets to overlap, the others compute without waiting for the link. The
parameters agree within {same:.0e}: the same step. `no_sync` costs nothing but the memory of
the local `.grad`s, which the loop holds anyway; it is why accumulation is almost free in
communication and why large global batches are cheap to reach with data parallelism.
'''))

# %% [markdown]
# ## 11 · The roofline: when can the all-reduce hide at all?
#
# Overlap hides communication only when there is more compute than communication. A step on B
# tokens per GPU computes 6·Ψ·B FLOPs (Ψ matmul weights) and all-reduces 2(N−1)/N·Ψ·e bytes of
# gradients (e = 2 bytes in bf16), so its **arithmetic intensity**, FLOPs per byte sent, is
# 3·B·N/((N−1)·e): Ψ cancels, only the **tokens per GPU** count. The GPU and link have their own
# ratio, the **ridge**: FLOP/s over bytes/s. Below it the step waits for the link whatever the
# overlap (the network roofline of *How to Scale Your Model*; `labkit.theory.roofline`, all
# modelled, bandwidth term only, at the H100's bf16 peak). FSDP's line (lesson 04) for
# comparison:

# %%
from labkit.theory import roofline
from labkit.theory import hardware
from labkit.viz.roofline import all_reduce_fit_figure, roofline_figure

fig = roofline_figure(64, "H100", links=("NVLink 4", "InfiniBand NDR"))
plt.show()
for gpus, link in ((8, "NVLink 4"), (64, "InfiniBand NDR")):   # one node; 8 nodes
    b = roofline.critical_batch("dp", gpus, "H100", link)
    print(f"DP on {gpus} H100s over {link}: compute-bound from {b:,.0f} tokens per GPU "
          f"({b / 4096:.1f} sequences of 4,096) (modelled)")

# %% [markdown]
# ## 12 · Measured here: all-reduce time against message size
#
# The alpha-beta model says an all-reduce of S bytes on N ranks takes 2(N−1)·α + 2(N−1)/N·S/β:
# a latency α per ring step, and bandwidth β. Measured on these CPU ranks (gloo over loopback,
# 2 ranks, 1 KB to 64 MB, the median of 3 calls each), fitted, and drawn beside the model of
# NCCL on NVLink 4 that the virtual clock uses:

# %%
SIZES = [4 ** k * 1024 for k in range(9)]    # 1 KB ... 64 MB


def all_reduce_times(ctx, sizes, repeats=3):
    out = []
    for size in sizes:
        x = torch.ones(size // 4)              # fp32: 4 bytes a value
        with ctx.off_the_record():
            ctx.comm.all_reduce(x)             # warm up this size
        times = []
        for _ in range(repeats):
            ctx.comm.all_reduce(x)
            times.append(ctx.comm.records[-1].wall_s)
        out.append(statistics.median(times))
    return out


measured = labkit.launch(all_reduce_times, 2, SIZES)
seconds = [max(a, b) for a, b in zip(*measured)]          # the slower rank sets the time
alpha, beta = roofline.fit_alpha_beta(SIZES, seconds, 2)
nvlink = hardware.link("NVLink 4")
modelled = [tt.collective_time("all_reduce", s, 2, nvlink) for s in SIZES]
fig = all_reduce_fit_figure(SIZES, seconds, alpha, beta,
                            {"NCCL-like ring, 2 GPUs over NVLink 4": modelled})
plt.show()
half_here = roofline.half_latency_bytes(alpha, beta, 2)
half_nvlink = roofline.half_latency_bytes(nvlink.latency, nvlink.effective_bandwidth, 2)
print(f"fitted here: alpha {alpha * 1e6:.0f} µs per step, beta {beta / 1e9:.2f} GB/s "
      f"(measured); NVLink 4 in the model: {nvlink.latency * 1e6:.0f} µs, "
      f"{nvlink.effective_bandwidth / 1e9:.0f} GB/s")
print(f"latency = bandwidth time at {half_here / 1e6:.2f} MB here, "
      f"{half_nvlink / 1e6:.2f} MB on NVLink 4 (modelled)")

# %% [markdown]
# (This machine is shared and its two cores run both ranks, so the points scatter; the fit
# weighs each point by its relative error.) Small messages pay mostly latency, large ones
# mostly bandwidth; the size where the two costs
# are equal (printed above) is the floor for a gradient bucket. Buckets several times larger
# spend little on latency; buckets much larger leave less of backward to overlap (the last
# bucket is always exposed). PyTorch DDP's default of 25 MiB sits well above the NVLink figure,
# trading a little latency for fewer, larger messages.

# %% [markdown]
# ## Takeaways
#
# - Data parallelism copies the whole model to every GPU and averages gradients with one
#   all-reduce per step; the result equals one device on the full batch (checked above to float
#   rounding), on labkit's GPT and on a model and loop of your own, with one wrapper line.
# - A ring all-reduce sends 2(N−1)/N × the gradient bytes per GPU: under 2× whatever N, measured
#   byte-for-byte in the comm log. It does not shrink with N while compute does, so scaling is set
#   by **tokens per GPU** against gradient bytes and link bandwidth.
# - Buckets launched from gradient hooks overlap the all-reduce with backward (what PyTorch DDP
#   does); the modelled step gets shorter, and only the last bucket is always exposed.
# - Gradient accumulation over K micro-batches needs one all-reduce per step, not K: `no_sync()`
#   on the first K−1 cuts the bytes to 1/K (measured in the comm log) and the same parameters.
# - The lab's trace and `torch.profiler`'s are the same Chrome trace format: the profiler shows
#   what PyTorch ran at this CPU's speed, the lab's modelled lanes the same program on H100s.
# - "Twice as fast with twice the GPUs" holds for big batches inside a node, not for small batches
#   or across the NVLink → InfiniBand boundary; a second inference node doubles throughput, not
#   the speed of one batch.
# - Every copy still holds all parameters, gradients and optimizer state: data parallelism does
#   not help a model fit (Llama 3 8B does not fit one H100 this way). ZeRO (lesson 04) shards
#   those states across the same replicas.

# %% [markdown]
# ## Exercises
#
# Two exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · Write the ring all-reduce.** Fill in `my_ring_all_reduce` using only `ctx.comm.send(t,
# dst, async_op=True)` (returns a handle with `.wait()`) and `ctx.comm.recv(t, src)`: cut the
# tensor into N chunks (`torch.tensor_split(tensor.view(-1), n)` gives views, so writing a chunk
# writes the tensor), run N−1 reduce-scatter steps to the right neighbour, then N−1 all-gather
# steps. Then run the checking cell: `check_ring_all_reduce` runs it on 4 ranks with different
# data, and tells you in words what is wrong: a wrong sum, chunks in the wrong place, a deadlock
# (every rank waiting in recv), or more bytes sent than the ring's 2(N−1)/N·S.

# %% tags=["solution"]
def my_ring_all_reduce(ctx, tensor):
    n, r = ctx.world_size, ctx.rank
    chunks = list(torch.tensor_split(tensor.view(-1), n))   # views: writing them writes tensor
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):                                   # reduce-scatter
        send_i, recv_i = (r - s) % n, (r - s - 1) % n        # my partial sum goes right
        incoming = torch.empty_like(chunks[recv_i])
        handle = ctx.comm.send(chunks[send_i], right, async_op=True)
        ctx.comm.recv(incoming, left)
        handle.wait()
        chunks[recv_i] += incoming                           # add mine to the one passing by
    for s in range(n - 1):                                   # all-gather: chunk r+1 is done
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        incoming = torch.empty_like(chunks[recv_i])
        handle = ctx.comm.send(chunks[send_i], right, async_op=True)
        ctx.comm.recv(incoming, left)
        handle.wait()
        chunks[recv_i].copy_(incoming)                       # a finished sum: keep it
    return tensor


# %%
verdict = check_ring_all_reduce(my_ring_all_reduce)


# %% [markdown]
# What the feedback looks like for two classic mistakes: forgetting that the other ranks' data
# differ, and receiving before anybody sends (this one waits 3 s for the time-out).

# %%
def assumes_same_data(ctx, tensor):
    return tensor * ctx.world_size


def receives_first(ctx, tensor):
    incoming = torch.empty_like(tensor)
    ctx.comm.recv(incoming, (ctx.rank - 1) % ctx.world_size)
    ctx.comm.send(tensor, (ctx.rank + 1) % ctx.world_size)
    return tensor + incoming


for mistake, timeout_s in ((assumes_same_data, 20), (receives_first, 3)):
    reset_hints()      # a demo is not your try: each shows a first miss (a hint, not the code)
    _ = check_ring_all_reduce(mistake, timeout_s=timeout_s)
    print()
reset_hints()

# %% [markdown]
# **2 · The bytes of one all-reduce.** Sixteen GPUs (two nodes) train GPT-2 small (124,439,808
# parameters) with data parallelism and bf16 gradients. How many bytes does **each GPU send** in
# the ring all-reduce of one step's gradients? Write it as an expression that shows the
# derivation.

# %% tags=["solution"]
ring_bytes_per_gpu = 2 * (16 - 1) / 16 * (2 * 124_439_808)   # 2(N-1)/N x S, S: bf16 grads

# %%
check_ring_bytes(ring_bytes_per_gpu);

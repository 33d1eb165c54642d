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
# # 07 · When it breaks: the first failures, provoked and diagnosed
#
# The maths of lessons 01-06 is rarely what goes wrong in a first distributed run. What goes
# wrong is one of six things, and each looks different from the outside:
#
# | symptom | usual cause | what tells you |
# |---|---|---|
# | the run stops moving | ranks call different collectives (a **hang**) | a timeout that names each rank and the op it waits in |
# | the run stops with an error | one rank **raised** | that rank's traceback |
# | a crash at a stage boundary | a **shape mismatch** in a pipeline send | the shapes both sides expected |
# | `CUDA out of memory` after an hour of queueing | the layout never fitted | the planner, before the job starts |
# | MFU too good (or too bad) to be true | a **wrong peak**, or recompute counted as work | MFU against HFU, peak from the datasheet |
# | the loss goes down, the model is wrong | a **silent bug** (gradients summed, not averaged) | the single-device reference |
#
# Each section below provokes one on purpose with labkit, shows the plain-word message a learner
# sees, and the fix. The errors are caught in the cells (`try` / `except`), so this notebook runs
# to the end.

# %%
import time

import ipywidgets as widgets
import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from IPython.display import Markdown, display

import labkit
from labkit import data, numerics
from labkit.exercises.when_it_breaks import (check_gradient_sync, check_mfu_answer,
                                             show_solution)
from labkit.parallel.pipeline import PipelineStage, Schedule1F1B, split_into_stages
from labkit.runs import reference
from labkit.runtime.launch import LaunchError
from labkit.theory import catalog, hardware, planner
from labkit.viz.widgets import explorer

pd.set_option("display.precision", 3)
pd.set_option("display.width", 120)
torch.set_num_threads(1)   # this kernel runs only tiny models: one thread beats two here


def first_and_last(error, last=2):
    # A LaunchError's message can hold a whole traceback: its head names the rank, its tail
    # says what went wrong. Print those.
    lines = [line for line in str(error).splitlines() if line.strip()]
    return "\n".join(lines[:1] + (["  ..."] if len(lines) > last + 1 else []) + lines[-last:])


# %% [markdown]
# ## 1 · A hang: two ranks in two different collectives
#
# Rank 0 averages the loss to print it (an all-reduce, a *collective*: every rank of the group
# must call it); rank 1 skipped the logging and already waits for the next activation from
# rank 0 (a point-to-point `recv`). Neither call can finish: each rank waits for the other. Plain
# `torch.distributed` would sit there until its default timeout (printed below); `labkit.launch`
# takes a `timeout_s` and, when it runs out, names each rank and the op it waits in.

# %%
def mismatched(ctx):
    loss = torch.tensor([float(ctx.rank)])
    if ctx.rank == 0:
        ctx.comm.all_reduce(loss, op="avg", tag="loss for the log")   # only rank 0 calls it
    activation = torch.empty(4)
    if ctx.rank == 1:
        ctx.comm.recv(activation, src=0, tag="next activation")
    return loss.item()


start = time.perf_counter()
try:
    labkit.launch(mismatched, 2, timeout_s=3)
except LaunchError as error:
    hang_message = str(error)
    print(hang_message)
hang_s = time.perf_counter() - start
print(f"\nlaunch gave up after {hang_s:.1f} s: timeout_s=3 counts from the ranks' start (the "
      "first launch of a kernel also starts its process server, which imports torch); "
      f"torch.distributed's default timeout for a process group is {dist.default_pg_timeout}")


# %% [markdown]
# **Read it:** each rank's line is the op it entered and never left, with its group, bytes and
# tag. Two ranks in two *different* ops is the signature of mismatched collectives: the fix is
# in the code, not in the timeout. Every rank must call the same collectives, with the same
# sizes, in the same order. Here: every rank logs the loss.

# %%
def matched(ctx):
    loss = torch.tensor([float(ctx.rank)])
    ctx.comm.all_reduce(loss, op="avg", tag="loss for the log")       # every rank calls it
    return loss.item()


start = time.perf_counter()
print(f"every rank's averaged loss: {labkit.launch(matched, 2, timeout_s=30)} "
      f"({time.perf_counter() - start:.1f} s)")


# %% [markdown]
# A near miss looks worse. If rank 1 skips the collective and simply *finishes*, rank 0 does not
# wait until the timeout: gloo sees its peer's connection close and rank 0 raises an error that
# blames the network or a crashed worker. No rank crashed; one rank left early because it called
# fewer collectives.

# %%
def one_sided(ctx):
    loss = torch.tensor([float(ctx.rank)])
    if ctx.rank == 0:
        ctx.comm.all_reduce(loss, op="avg", tag="loss for the log")
    return loss.item()


try:
    labkit.launch(one_sided, 2, timeout_s=10)
except LaunchError as error:
    print(first_and_last(error, last=1))


# %% [markdown]
# ## 2 · A rank that raises
#
# Rank 1 gets a batch with a token id past the vocabulary (a data bug on one shard only, the
# kind that shows up after hours). The embedding raises on rank 1; rank 0 would wait forever in
# its next collective. `launch` stops every rank at the first error and hands back that rank's
# traceback, so the error names the rank, the line and the reason, at once, not at a timeout.

# %%
def bad_shard(ctx):
    model = reference.build_model(reference.RunConfig())
    x, y = data.token_batch(0, 2, model.cfg.seq, model.cfg.vocab)
    if ctx.rank == 1:
        x[0, 5] = model.cfg.vocab + 7                  # one token id past the vocabulary
    loss = model(x, y)
    ctx.comm.all_reduce(loss.detach(), op="avg", tag="loss")
    return loss.item()


start = time.perf_counter()
try:
    labkit.launch(bad_shard, 2, timeout_s=60)
except LaunchError as error:
    print(first_and_last(error, last=3))
print(f"\nstopped after {time.perf_counter() - start:.1f} s: the error came back as soon as "
      "rank 1 raised")


# %% [markdown]
# **Fix:** the traceback's last line names the bad index; check the data where it is made
# (`x.max() < vocab`), not after the fact.
#
# ## 3 · A shape mismatch in a pipeline send
#
# A pipeline stage receives into a buffer it allocates before the message arrives, so it must
# know the shape. `PipelineStage(..., input_shape=...)` declares it; stages without a declaration
# get it from a small header the previous stage sends once. Below, a 5-layer MLP on 3 ranks, cut
# after its first Linear + GELU (stage 0 sends 32 features), while stage 1 declares 16 and
# stage 2 is left to the handshake. labkit compares the header with the declaration and names
# both shapes:

# %%
def pipeline_run(ctx, input_shapes, balance):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(),
                          nn.Linear(16, 4))
    stages = split_into_stages(model, ctx.world_size, balance=balance)
    stage = PipelineStage(stages[ctx.rank], ctx.rank, ctx.world_size,
                          input_shape=input_shapes[ctx.rank])
    pipe = Schedule1F1B(stage, n_microbatches=4, loss_fn=F.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    losses = []                           # the last stage's micro-batch losses
    pipe.step(x if stage.is_first else None, target=y if stage.is_last else None, losses=losses)
    return round(float(torch.stack(losses).mean()), 4) if losses else None


try:
    labkit.launch(pipeline_run, 3, [None, (2, 16), None], [2, 2, 1], timeout_s=60)
except LaunchError as error:
    print(first_and_last(error, last=1))
for shapes in ([None, (2, 32), None], [None, None, None]):
    fixed = labkit.launch(pipeline_run, 3, shapes, [2, 2, 1], timeout_s=60)
    print(f"input_shape {shapes}: the run works, loss on the last stage {fixed[-1]}")


# %% [markdown]
# **Fix:** declare the shape the previous stage really sends (one micro-batch: 8 rows / 4
# micro-batches = 2 rows of 32), or declare nothing. When *every* stage declares a shape there is
# no handshake to check against: a wrong declaration then reaches gloo itself, which aborts the
# receiving process ("Received data size doesn't match expected size. Is there a distributed
# collective mismatch in your code?", on the process's stderr) while its peer sees the connection
# reset. That is why the handshake is the default.
#
# ## 4 · Out of memory, predicted before it happens
#
# On GPUs the same mistake costs a queue wait and then `CUDA out of memory` in the first step.
# The planner (`labkit.theory.planner.plan`, lesson 06) does the arithmetic first: Llama 3 8B,
# plain data parallelism on 8 H100s, a batch of 64 sequences of 4,096 tokens. `fits` is False and
# the reason says by how much.

# %%
def one_plan(fix, model="llama-3-8b", gpus=8):
    return planner.plan(model, gpus, "H100", global_batch=64, seq=4096, fix=fix,
                        top=1)["plans"][0]


SAME = "dp=8,tp=1,pp=1,micro_batch_size=1"        # every row: plain DP 8, micro-batch 1
layouts = {"DP 8, no ZeRO": f"{SAME},zero_stage=0,recompute=none",
           "DP 8, ZeRO-1": f"{SAME},zero_stage=1,recompute=none",
           "DP 8, ZeRO-3": f"{SAME},zero_stage=3,recompute=none",
           "DP 8, ZeRO-3, full recompute": f"{SAME},zero_stage=3,recompute=full"}
oom = {name: one_plan(fix) for name, fix in layouts.items()}
print(f"plain DP: fits={oom['DP 8, no ZeRO']['fits']}: {oom['DP 8, no ZeRO']['reason']}")
states = oom["DP 8, no ZeRO"]["memory_bytes"]
per_param = {k: states[k] / catalog.model("llama-3-8b").param_count()
             for k in ("params", "grads", "optimizer")}
print("bytes of model states per parameter (planner): "
      + " + ".join(f"{v:.0f} {k}" for k, v in per_param.items())
      + f" = {sum(per_param.values()):.0f}")
pd.DataFrame({name: {**{k: v / 1e9 for k, v in p["memory_bytes"].items()}, "fits": p["fits"]}
              for name, p in oom.items()}).T.rename(columns=lambda c: c if c == "fits"
                                                       else f"{c} (GB)")

# %% [markdown]
# Each row changes one thing (every row is plain DP on 8 GPUs with a micro-batch of 1), and the
# table says which category it shrinks: ZeRO shards the model states, the bytes per parameter
# printed above (bf16 weights, gradients as the planner keeps them, fp32 Adam state and master
# weights), ZeRO-1 the optimizer's part only, ZeRO-3 all three; recompute trades the
# activations for a second forward. The same arithmetic on labkit's tiny GPT, where it can be
# measured (one process, fp32 Adam, one step), so you can see how close the prediction is:

# %%
tiny = reference.RunConfig(steps=1)
measured = reference.train(tiny)["memory"]
predicted = reference.predict_memory(tiny)
pd.DataFrame({"measured (bytes)": {k: measured[k] for k in predicted},
              "predicted (bytes)": predicted}).assign(
    **{"measured / predicted": lambda t: t.iloc[:, 0] / t.iloc[:, 1]})

# %% [markdown]
# The states match to the byte; the activations to within the rounding of the formula. The peak
# is lower than the predicted sum because backward frees activations while it fills in the
# gradients (`predict_memory` adds them up: an upper bound).
#
# ## 5 · A wrong MFU: the wrong peak, or recompute counted as work
#
# MFU (model FLOPs utilisation) = the FLOPs the *model* needs per step / (step time × GPUs ×
# the GPU's dense bf16 peak). Two mistakes make it wrong. **Recompute counted as work**: with full
# recompute every layer's forward runs twice; counting those FLOPs gives HFU (hardware FLOPs
# utilisation), which looks better but does not train faster. **The wrong peak**: the datasheet
# also lists a sparse peak (2× the dense one, for 2:4-sparse matrices that training does not
# use), fp8, or another GPU's number. Below, one modelled plan and the "MFU" each mistake gives.

# %%
p = oom["DP 8, ZeRO-3, full recompute"]
achieved = p["model_tflops_per_gpu"] * 1e12          # model FLOP/s per GPU (modelled)
h100, a100 = hardware.gpu("H100"), hardware.gpu("A100")
peaks = {"H100 dense bf16 (right)": h100.bf16_flops,
         "H100 sparse bf16 (2x dense)": 2 * h100.bf16_flops,
         "A100 dense bf16 (wrong GPU)": a100.bf16_flops}
wrong_mfu = pd.DataFrame({"peak (TFLOP/s)": {k: v / 1e12 for k, v in peaks.items()},
                          "MFU reported": {k: achieved / v for k, v in peaks.items()}})
print(f"step {p['step_s']:.2f} s (modelled), {achieved / 1e12:.0f} TFLOP/s of model FLOPs per "
      f"GPU; planner: MFU {p['mfu']:.1%}, HFU {p['hfu']:.1%} (full recompute: the HFU counts "
      f"each layer's second forward)")
wrong_mfu.style.format({"peak (TFLOP/s)": "{:.0f}", "MFU reported": "{:.1%}"})

# %% [markdown]
# **Check an MFU** by recomputing it: 6 × parameters × tokens per second (plus attention) over
# GPUs × the *dense* bf16 peak of the GPU you ran on. Above 60 % on a large model, or above 100 %
# ever, something is wrong: the denominator, or FLOPs the model does not need in the numerator
# (the planner counts the causal half of the attention scores, what a causal model needs, so
# that a 128K-token sequence, where attention dominates, cannot pass 100 %). HFU ≥ MFU always:
# it adds what runs again (recompute, FlashAttention's backward rebuilding the scores) and any
# scores a kernel computes under the mask.
#
# ## 6 · A silent bug: gradients summed instead of averaged
#
# Data parallelism by hand: each rank computes the mean loss of its half of the batch, and the
# gradients are all-reduced. `all_reduce` *sums*; forgetting to divide by the number of ranks
# doubles every step on 2 ranks. Nothing crashes and the loss curve looks like any other, so the
# run looks fine. The single-device reference (`labkit.runs.reference.train`: the same model, the same
# batches, one process) catches it.

# %%
cfg = reference.RunConfig(steps=6, global_batch=8, optimizer="sgd", lr=0.05)


def summed_data_parallel(ctx, cfg):
    model = reference.build_model(cfg)
    optimizer = reference.build_optimizer(model.parameters(), cfg)
    losses = []
    for step in range(cfg.steps):
        x, y = (data.shard(t, ctx.rank, ctx.world_size) for t in reference.batch(model, cfg, step))
        optimizer.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        for p in model.parameters():
            ctx.comm.all_reduce(p.grad, tag="gradients")      # the sum of 2 means: the bug
        optimizer.step()
        logged = loss.detach().clone()
        ctx.comm.all_reduce(logged, op="avg", tag="loss for the log")
        losses.append(logged.item())
    return dict(loss=losses, params=reference.full_params(model))


buggy = labkit.launch(summed_data_parallel, 2, cfg, timeout_s=120)[0]
ref = reference.train(cfg)
exact = reference.float64_reference(cfg)   # what float32 rounding is measured from
check = numerics.compare(buggy["params"], ref["params"], exact["params"])
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(ref["loss"], "o-", label="one device (reference)")
ax.plot(buggy["loss"], "s--", label="2 ranks, gradients summed")
ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend(); ax.set_title("which one is wrong?")
plt.show()
gap = max(abs(a - b) for a, b in zip(ref["loss"], buggy["loss"]))
print(f"largest loss difference over {cfg.steps} steps: {gap:.4f} (on losses near "
      f"{ref['loss'][0]:.2f}); parameters against the float64 run: {check}")


# %% [markdown]
# The two loss curves lie almost on top of each other (this tiny GPT reads random tokens, so
# neither can fall far below ln(vocab)): nothing in the log looks wrong. Only the comparison of
# the parameters with the reference says the run is wrong, by far more than float rounding. The
# same comparison, on 2 and 4 ranks, measures *how* wrong: the first update against the reference's is N times too large (summed: N means added).

# %%
def first_update(ctx, cfg):
    start = torch.cat([p.detach().reshape(-1) for p in reference.build_model(cfg).parameters()])
    out = summed_data_parallel(ctx, cfg)
    return torch.cat([p.reshape(-1) for p in out["params"].values()]) - start


one = reference.RunConfig(steps=1, global_batch=8, optimizer="sgd", lr=0.05)
start = torch.cat([p.detach().reshape(-1) for p in reference.build_model(one).parameters()])
truth = torch.cat([p.reshape(-1) for p in reference.train(one)["params"].values()]) - start
for n in (2, 4):
    update = labkit.launch(first_update, n, one, timeout_s=120)[0]
    print(f"{n} ranks, summed: first update = {float(update @ truth / (truth @ truth)):.3f} x "
          "the single-device update")


# %% [markdown]
# ## 7 · Explore: when does the plan run out of memory?
#
# Pick a model, the ZeRO stage, the micro-batch size and recompute; the planner says whether the
# layout fits 8 H100s (batch 64 × 4,096 tokens, data parallel only), why not, and its MFU and
# HFU. Which single change rescues Llama 3 8B? Does any save Llama 3 70B on 8 GPUs?

# %%
def draw(ax, model, zero_stage, micro_batch_size, recompute):
    p = one_plan(f"dp=8,tp=1,pp=1,zero_stage={zero_stage},micro_batch_size={micro_batch_size},"
                 f"recompute={recompute}", model=model)
    left = 0.0
    for name, value in p["memory_bytes"].items():
        if name != "total" and value:
            ax.barh([0], [value / 1e9], left=left, label=name)
            left += value / 1e9
    ax.axvline(h100.memory_bytes / 1e9, color="k", ls="--", label="H100 memory")
    ax.set_yticks([]); ax.set_xlabel("GB per GPU (modelled)"); ax.legend(fontsize=7, ncol=3)
    ax.set_title(f"{model}, DP 8 on 8 H100s, ZeRO-{zero_stage}")
    verdict = "fits" if p["fits"] else f"<b>does not fit</b>: {p['reason']}"
    return (f"{p['memory_bytes']['total'] / 1e9:.1f} GB per GPU, {verdict}; modelled step "
            f"{p['step_s']:.2f} s, MFU {p['mfu']:.1%}, HFU {p['hfu']:.1%}")


explorer({"zero_stage": widgets.IntSlider(0, 0, 3, description="ZeRO stage"),
          "model": widgets.Dropdown(options=["llama-3-8b", "llama-3-70b"], description="model"),
          "micro_batch_size": widgets.Dropdown(options=[1, 2, 4, 8], description="micro-batch"),
          "recompute": widgets.Dropdown(options=["none", "selective", "full"],
                                        description="recompute")}, draw, figsize=(8, 2.6))


# %% [markdown]
# ## Takeaway
#
# - A **hang** is ranks in different collectives: give runs a timeout and read where each rank
#   waits; the fix is every rank calling the same collectives in the same order.
# - A **rank that raises** should stop everything at once with its traceback; a rank that leaves
#   early shows up on its peer as a misleading network error.
# - **Shapes** at a pipeline boundary are declared or exchanged; the handshake names a wrong
#   declaration, without it the communication library aborts the receiving process.
# - **Out of memory** is arithmetic: ask the planner before the job queues.
# - **MFU** uses the dense peak of the GPU you ran on and the model's FLOPs, not recomputed ones.
# - A **silent bug** trains: only a comparison with the single-device reference on the same
#   batches shows it, and the size of the error (here N×) points at its cause.

# %% [markdown]
# ## Exercises
#
# Two exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · Fix the summed gradients.** Write `my_gradient_sync(ctx, model)`: it is called on every
# rank right after `backward()`, and must leave in every parameter's `.grad` the gradient of the
# *whole* batch's mean loss, the same on every rank. `check_gradient_sync` trains a small MLP on 2
# ranks with it, compares the parameters with one device, and says what is wrong: not synchronised
# (the replicas drift apart), summed (updates N times too large), a hang, or some other
# difference.

# %% tags=["solution"]
def my_gradient_sync(ctx, model):
    for p in model.parameters():
        ctx.comm.all_reduce(p.grad, tag="gradients")
        p.grad /= ctx.world_size


# %%
check = check_gradient_sync(my_gradient_sync)

# %% [markdown]
# **2 · Check an MFU.** A run trains Llama 3 8B (8.03 B parameters) on 64 H100s and processes
# 600,000 tokens per second, all GPUs together (measured). What is its MFU, as a fraction? Count
# 6 FLOPs per parameter and token (attention aside) and use the H100's dense bf16 peak from
# the hardware table, `hardware.gpu("H100").bf16_flops`. Write it as an expression that shows
# the derivation.

# %% tags=["solution"]
h100_peak = hardware.gpu("H100").bf16_flops                 # dense bf16, FLOP/s per GPU
run_mfu = 6 * 8.03e9 * 600_000 / (64 * h100_peak)           # model FLOP/s over all GPUs' peak

# %%
check_mfu_answer(run_mfu);

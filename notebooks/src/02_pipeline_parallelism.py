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
# # 02 · Pipeline parallelism: stages, micro-batches, and the bubble
#
# **Idea.** Cut the model's layers into P contiguous **stages**, one per GPU. A batch flows through
# them: stage r receives activations from stage r-1 (a point-to-point *send/recv*), runs its
# layers, and sends on; the backward pass runs the other way with activation gradients. Each GPU
# holds only Ψ/P of the weights, gradients and optimizer state.
#
# **The catch.** With one batch, only one stage works at a time: the others wait. Split the
# batch into M **micro-batches** and the stages work on different micro-batches at once. What is
# left idle at the start (filling the pipe) and at the end (draining it) is the **bubble**:
#
# - GPipe (all forwards, then all backwards) and 1F1B (one forward, one backward): idle share
#   **(P-1)/(M+P-1)** of the step (Huang et al. 2019, GPipe);
# - interleaved 1F1B with V chunks of layers per GPU: **(P-1)/(V·M+P-1)** (Narayanan et al. 2021).
#
# These assume equal stages and free communication. `labkit` reads the idle share off its
# virtual timeline, the *modelled* clock (`bubble_fraction`: FLOPs on a modelled H100 and modelled
# links, not this machine's wall time), and shows when the assumptions hold. **Memory:** GPipe
# keeps the activations of all M micro-batches until their backward; 1F1B starts backwards early,
# so stage r holds at most P-r micro-batches.

# %%
import pandas as pd
import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

import labkit
from labkit import PipelineStage, numerics, split_into_stages
from labkit.parallel import Schedule1F1B
from labkit.exercises.pipeline import (check_dualpipe_idle, check_gpipe_bubble, check_stage_order,
                                       show_solution)
from labkit.runs import pipeline as run_pp, reference
from labkit.theory import catalog, hardware, memory as tm, pipeline as sched, time as tt
from labkit.viz.pipeline_widgets import pipeline_explorer, run_gantts, stage0_memory_plot

pd.set_option("display.precision", 4)
pd.set_option("display.width", 120)

# %% [markdown]
# ## 1 · Schedules are plain data
#
# A schedule is, for every rank, the ordered list of ops `("F", micro-batch, chunk)` and
# `("B", micro-batch, chunk)` (`labkit.theory.pipeline`: plain Python, no torch). One executor,
# `labkit.PipelineSchedule` (behind torch's `ScheduleGPipe`, `Schedule1F1B`, ...), runs any such
# list: on F it receives the activation, runs forward and
# sends the output on; on B it receives the output's gradient, runs backward and sends the input's
# gradient back. Sends are asynchronous, so a sender never waits for its receiver.

# %%
# NBVAL_CHECK_OUTPUT
print("GPipe, P=4, M=4"); sched.print_schedule(sched.gpipe_schedule(4, 4))
print("\n1F1B, P=3, M=6 (warm-up P-r-1 forwards, then alternate, then drain)")
sched.print_schedule(sched.one_f_one_b_schedule(3, 6))
print("\ninterleaved 1F1B, P=2, M=4, V=2 chunks per rank")
sched.print_schedule(sched.interleaved_schedule(2, 4, 2))


# %% [markdown]
# ## 2 · The building block on your own model
#
# `labkit`'s pipeline has PyTorch's shape (`torch.distributed.pipelining`): cut an
# `nn.Sequential` into stages with `split_into_stages` (balanced by parameter count), wrap this
# rank's stage in `PipelineStage(module, stage_index, num_stages, device=None, group=None)`, and
# let `Schedule1F1B(stage, n_microbatches, loss_fn)` run a step (torch's names and arguments;
# `step` fills `losses` and returns the outputs on the last stage). `x` is read on the first
# stage, `target` on the last; every rank keeps only its stage's parameters and optimizer state.
# Below, a learner's own loop on 2 ranks, checked against the same model trained on one device.

# %%
def my_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)],
                         nn.Linear(32, 8))

g = torch.Generator().manual_seed(1)
x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)

def my_training(ctx):
    model = my_model()
    stages = split_into_stages(model, ctx.world_size)            # one per rank
    stage = PipelineStage(stages[ctx.rank], ctx.rank, ctx.world_size)
    pipe = Schedule1F1B(stage, n_microbatches=4, loss_fn=F.mse_loss)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    for step in range(3):
        optimizer.zero_grad()
        pipe.step(x, target=y)                                   # the outputs on the last rank
        optimizer.step()
    mine = {id(p) for p in stage.parameters()}
    return {name: p.detach() for name, p in model.named_parameters() if id(p) in mine}

pipelined = {}
for params in labkit.launch(my_training, 2):
    pipelined.update(params)
one = my_model()
optimizer = torch.optim.AdamW(one.parameters(), lr=1e-2)
for step in range(3):
    optimizer.zero_grad()
    F.mse_loss(one(x), y).backward()
    optimizer.step()
diff = max((pipelined[n] - p).abs().max().item() for n, p in one.named_parameters())
print(f"{len(pipelined)} parameter tensors from 2 stages; largest difference from one device "
      f"after 3 AdamW steps: {diff:.1e}")

# %% [markdown]
# ## 3 · Every schedule on 4 ranks, checked against one device
#
# The lab's driver (`labkit.runs.pipeline`, also `python -m labkit run pipeline`) does the same
# for labkit's TinyGPT: 8 equal blocks (2 per stage; 1 per chunk when interleaved) and a tiny
# vocabulary. Stage 0 also holds the embeddings, the last stage ln_f, the head and the loss. One
# launch runs all the configurations below (starting ranks is the slow part).
#
# The **modelled clock** counts each op's FLOPs (backward ≈ 2× forward) on an H100. For the bubble
# we first use *free links* (no latency): the formula counts compute only. The last run uses the
# H100's NVLink (2 µs per message) to show what latency does.

# %%
GPT = dict(layers=8, hidden=16, heads=2, seq=8, vocab=8, ffn=64)
cfg = reference.RunConfig(steps=1, global_batch=8, optimizer="sgd", lr=0.1, model_kwargs=GPT)
free = sched.comm_free_cluster()
runs = [dict(schedule=s, microbatches=m, cluster=free) for s in ("gpipe", "1f1b")
        for m in (1, 2, 4, 8)]
runs += [dict(schedule="interleaved", microbatches=8, virtual=2, cluster=free),
         dict(schedule="naive", cluster=free),
         dict(schedule="1f1b", microbatches=8, recompute=True, cluster=free),
         dict(schedule="1f1b", microbatches=8)]              # H100 NVLink: 2 us per message
per_rank = labkit.launch(run_pp.sweep, 4, cfg, runs, timeout_s=300)
results = [run_pp.merge_results([r[i] for r in per_rank]) for i in range(len(runs))]
ref = reference.train(cfg, track_memory=False)
exact = reference.float64_reference(cfg)   # what float32 rounding is measured from

def name(run):
    return run["schedule"] + (" + recompute" if run.get("recompute") else "") + \
        (" (H100 links)" if "cluster" not in run else "")

rows = []
for run, res in zip(runs, results):
    m = 1 if run["schedule"] == "naive" else run["microbatches"]
    v = run.get("virtual", 1)
    timeline = [e for r in res for e in r["timeline"]]
    rows.append(dict(schedule=name(run), M=m, V=v,
                     equals_one_device=bool(numerics.compare(res[0]["params"], ref["params"],
                                                             exact["params"])),
                     loss=res[0]["loss"][0], reference_loss=ref["loss"][0],
                     bubble_fraction=sched.timeline_bubble_fraction(timeline),
                     bubble_formula=sched.bubble_formula(4, m, v)))
table = pd.DataFrame(rows)
table

# %%
free_runs = table[~table.schedule.str.contains("H100")]
one_f = results[runs.index(dict(schedule="1f1b", microbatches=8, cluster=free))]
times = sched.op_times([e for r in one_f for e in r["timeline"]])
last, middle = times[("forward", 3, 0)], times[("forward", 1, 0)]
c = reference.build_model(cfg).cfg
head_flops = 2 * c.hidden * c.vocab                                # per token, forward
block_flops = 2 * (12 * c.hidden ** 2 + 2 * c.seq * c.hidden)     # per token: matmuls + scores
worst = max((numerics.compare(res[0]["params"], ref["params"], exact["params"])
             for res in results), key=lambda a: a.error / a.limit)
print(f"parameters against the float64 run, the worst schedule (SGD): {worst}")
print(f"the last stage's forward takes {last / middle - 1:.1%} longer than a middle stage's "
      f"(modelled); its head adds {head_flops / (2 * block_flops):.1%} to two blocks' matmul "
      f"FLOPs (the clock counts matmul FLOPs: ln_f and the loss add none)")
excess = (free_runs.bubble_fraction / free_runs.bubble_formula - 1).max()
print(f"bubble read off the clock on free links: at most {excess:.1%} above the formula")

# %% [markdown]
# Every schedule ends with the reference's parameters (within float32 rounding, judged against
# the float64 run as in lesson 01) and the same loss. On free links the bubble read off the modelled clock matches
# (P-1)/(V·M+P-1) within the few percent printed above: the formula assumes equal stages, and the
# last stage does a little more work than the others. On the H100's links the tiny model is
# hopeless: each op takes about a nanosecond of modelled compute, each message 2 µs, so the
# pipeline waits almost all the time (the last row). Pipelining pays only when a stage's compute
# is long against the message latency (real models: ms against µs).
#
# ## 4 · The timeline of a real run
#
# 1F1B with M = 4 on free links (M = 8 is the exercise at the end): per-rank rows, forward / backward / idle, micro-batch numbers on
# the bars. Above: the modelled clock. Below: the wall clock measured on this machine from the
# first op, where the ranks share two CPU cores, so the shape is noisier.

# %%
one_f4 = results[runs.index(dict(schedule="1f1b", microbatches=4, cluster=free))]
fig = run_gantts([e for r in one_f4 for e in r["timeline"]], title="1F1B, P=4, M=4, real run")
plt.show()

# %% [markdown]
# ## 5 · Memory on the first stage: GPipe vs 1F1B
#
# The global batch is fixed (8 sequences), so a micro-batch is 8/M sequences. GPipe keeps every
# micro-batch's activations until the backward phase: the whole batch, whatever M. 1F1B keeps at
# most P = 4 micro-batches on stage 0: once M > P it holds only P/M of the batch. The formula is
# *micro-batches in flight (from the schedule) × one micro-batch's saved bytes (Korthikanti et
# al.'s per-layer count for the TinyGPT)*; the measured bytes come from autograd's saved-tensor
# hooks.

# %%
mem_rows = []
for run, res in zip(runs, results):
    if run["schedule"] in ("gpipe", "1f1b") and "cluster" in run and not run.get("recompute"):
        mem_rows.append(dict(schedule=run["schedule"], microbatches=run["microbatches"],
                             measured=res[0]["memory"]["activations"],
                             formula=res[0]["predicted_activations"],
                             in_flight=res[0]["in_flight"]))
fig = stage0_memory_plot(mem_rows)
plt.show()
pd.DataFrame(mem_rows)

# %% [markdown]
# **Recomputation** (`recompute=True`) keeps only each stage's input and runs the forward again
# inside the backward: the stage saves one micro-batch's activations at a time, and backward
# costs a forward more (modelled: forward + backward FLOPs instead of backward).

# %%
rec = results[runs.index(next(r for r in runs if r.get("recompute")))]
times = {k: sched.op_times([e for r in res for e in r["timeline"]])[("backward", 1, 0)]
         for k, res in (("1f1b", one_f), ("1f1b + recompute", rec))}
pd.DataFrame({"stage-0 activations (bytes, measured)":
              {"1f1b": one_f[0]["memory"]["activations"],
               "1f1b + recompute": rec[0]["memory"]["activations"]},
              "backward op on rank 1 (modelled ns)": {k: v * 1e9 for k, v in times.items()}})

# %% [markdown]
# ## 6 · Against PyTorch's own pipeline
#
# `bench/pipeline.py` runs labkit's executor beside `torch.distributed.pipelining`'s
# `ScheduleGPipe` and `Schedule1F1B` (the same TinyGPT split, 8 micro-batches, 4 ranks, gloo on
# CPU) in one run, alternating the two in rounds. Its latest rows in `data/bench.csv`
# (`labkit_over_torch`: labkit's number over PyTorch's, the median over rounds; `spread_min`,
# `spread_max`: the lowest and highest per-round ratio, which show how much the load of a shared
# machine moved the timing):

# %%
bench = pd.read_csv(labkit.theory.hardware.DATA_DIR / "bench.csv", keep_default_na=False)
bench[bench.benchmark == "pipeline"][["labkit_impl", "torch_impl", "metric", "labkit", "torch",
                                      "labkit_over_torch", "spread_min", "spread_max", "rounds",
                                      "date"]]

# %% [markdown]
# ## 7 · The source article's example: Llama 3 70B on 2 (4, 8) GPUs
#
# The source article says that Llama 3 70B needs "about 40GB" and that "using two GPUs pipeline
# parallelism will reduce that amount to roughly 20GB per GPU at the cost of some execution
# speed". With `theory/` (batch 1, context 4096): the halving holds, since each stage keeps half
# of the layers, but 40 GB is the 4-bit figure; in bf16 the weights alone are ~141 GB, 71 GB per
# GPU on two. Training is another order: 16 bytes per parameter of model states, plus activations.
# With 1F1B, stage 0 holds P micro-batches of its L/P layers: the activations of one whole
# micro-batch through the full model, whatever P.

# %%
# NBVAL_CHECK_OUTPUT
llama = catalog.model("llama-3-70b")
M = 8
rows = []
for p in (1, 2, 4, 8):
    bf16 = tm.inference_memory(llama, batch=1, context=4096, pp=p)
    int4 = tm.inference_memory(llama, batch=1, context=4096, pp=p, weight_dtype="int4")
    train_ = tm.training_memory(llama, batch=1, seq=4096, pp=p)
    rows.append({"stages P": p, "inference bf16 GB/GPU": bf16["total"] / 1e9,
                 "inference int4 GB/GPU": int4["total"] / 1e9,
                 "training states GB/GPU": (train_["total"] - train_["activations"]) / 1e9,
                 "training act. GB/GPU (1 micro-batch)": train_["activations"] / 1e9,
                 f"1F1B stage-0 act. GB (M={M})": min(p, M) * train_["activations"] / 1e9})
print(pd.DataFrame(rows).round(1).to_string(index=False))

# %% [markdown]
# **What it costs in time** (the article's claim 3: model parallelism makes the runtime "increase
# by a similar magnitude to the number of GPUs"). For one batch pushed through P stages, the work
# is the same as on one GPU plus P-1 hops: the *runtime* barely changes, but each GPU works only
# 1/P of the time, so the cost in GPU-hours grows P-fold. That is the sense in which the claim
# holds. With M micro-batches the step shrinks to (M+P-1)/(M·P) of one GPU's time. Modelled on
# 8×H100 NVLink for a 4096-token prefill (2·Ψ FLOPs per token at the in-step GEMM rate, as the
# run clock times compute; activations
# 4096·8192·2 bytes per hop):

# %%
# NBVAL_CHECK_OUTPUT
h100 = hardware.cluster("8xH100-NVLink")
t1 = tt.compute_time(2 * llama.param_count() * 4096, h100.gpu)
hop = tt.send_time(4096 * llama.hidden * 2, h100.intra)
rows = []
for p in (1, 2, 4, 8):
    naive = t1 + (p - 1) * hop
    m = 8
    rows.append({"stages P": p, "one batch (s)": naive, "GPU-seconds": naive * p,
                 "GPU busy share": 1 / p,
                 f"M={m} micro-batches: step (s)": (m + p - 1) / (m * p) * t1,
                 "bubble (P-1)/(M+P-1)": tt.bubble_fraction(p, m)})
print(f"one GPU: {t1:.3f} s modelled; one hop {hop * 1e3:.3f} ms")
print(pd.DataFrame(rows).round(3).to_string(index=False))

# %% [markdown]
# So "at the cost of some execution speed" is, for one batch at a time, mostly idle GPUs rather
# than a slower answer: the hops (printed above) are a sliver of the pass. Micro-batches (a stream of
# requests, or a training batch) fill the pipe and win the time back, up to the bubble.
#
# ## 8 · Explore: schedules, bubble and memory per stage
#
# The explorer *simulates* the schedule (the executor's timing rules in pure Python, checked
# against real runs in `tests/test_pipeline.py`). Modelled times: a stage's forward of one
# micro-batch takes 1 ms, backward 2 ms, a message 1 ms / (compute/comm ratio). Try: M from 1 to
# 24 with GPipe; 1F1B at the same M (same bubble, less memory on stage 0); interleaved with V = 4
# (smaller bubble, more memory and V× the messages); a compute/comm ratio of 1. V (chunks per
# rank) applies to the interleaved schedule only, and M to every schedule but naive: the other
# sliders are greyed out, and the caption names the formula that holds for the schedule shown.

# %%
pipeline_explorer()

# %% [markdown]
# ## 9 · Zero bubble: split the backward (ZB-H1)
#
# A backward does two jobs: the gradient of the stage's **input** (B), which the previous stage
# is waiting for, and the gradient of its **weights** (W), which nobody needs before the
# optimizer step. Qi et al. 2023 (*Zero Bubble Pipeline Parallelism*, arXiv 2401.10241) split
# them: B runs as soon as the output gradient arrives and is sent on at once; the W's wait and
# fill the slots where 1F1B idles. In **ZB-H1** stage i runs, for x = 0, 1, 2, ..., the ops
# F_x, B_(x−(P−1−i)), W_(x−(P−1)) (those that exist): 1F1B's order of F and B, each W P−1 slots
# late. With T_B now the input gradient alone and T_W the weight gradient, each rank idles
# **(P−1)(T_F + T_B − T_W)** per step instead of 1F1B's (P−1)(T_F + T_B + T_W), with 1F1B's peak
# activation memory. The schedule is plain data, with W ops:

# %%
from labkit.parallel import ScheduleInterleavedZeroBubble
from labkit.viz import gantt

zb = sched.zb_h1_schedule(4, 8)
sched.print_schedule(zb)

# %% [markdown]
# Simulated (the executor's timing rules, modelled times): T_F = T_B = T_W = 1 ms, a backward
# being about two forwards; 1F1B runs the same work with an unsplit backward of T_B + T_W.

# %%
T_F = T_B = T_W = 1e-3
zb_sim = sched.simulate_schedule(zb, T_F, T_B, t_weight=T_W)
base_sim = sched.simulate_schedule(sched.one_f_one_b_schedule(4, 8), T_F, T_B + T_W)
fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
gantt(base_sim, ax=axes[0], title="1F1B, P=4, M=8, backward = B + W (simulated)")
gantt(zb_sim, ax=axes[1], title="ZB-H1, the same work, W's deferred (simulated)")
fig.tight_layout()
plt.show()

rows = []
for t_w in (1.0, 0.5, 0.25):     # T_W in ms; T_F = 1 ms, T_B = 2 - T_W ms (one backward: 2 ms)
    t_b = 2.0 - t_w
    zb_t = sched.simulate_schedule(zb, 1.0, t_b, t_weight=t_w)
    base_t = sched.simulate_schedule(sched.one_f_one_b_schedule(4, 8), 1.0, 2.0)
    rows.append({"T_W (ms)": t_w, "T_B (ms)": t_b,
                 "ZB-H1 bubble (simulated)": sched.timeline_bubble_fraction(zb_t),
                 "ZB-H1 (P-1)(T_F+T_B-T_W) formula": sched.split_bubble_formula(4, 8, 1.0, t_b,
                                                                                t_w),
                 "1F1B bubble (simulated)": sched.timeline_bubble_fraction(base_t),
                 "1F1B (P-1)/(M+P-1)": sched.bubble_formula(4, 8)})
pd.DataFrame(rows)

# %% [markdown]
# The simulated bubble equals the paper's formula in every row; the larger the weight gradient's
# share of the backward, the more of 1F1B's bubble the W's fill. The W's are not free in memory:
# a W needs its micro-batch's saved inputs, so each stage keeps P micro-batches until their W
# (1F1B's peak, that of its first stage), while up to their B it keeps exactly what 1F1B keeps:

# %%
pd.DataFrame({"1F1B: F done, B not": [sched.microbatches_in_flight(o)
                                      for o in sched.one_f_one_b_schedule(4, 8)],
              "ZB-H1: F done, B not": [sched.microbatches_in_flight(o, until="B") for o in zb],
              "ZB-H1: F done, W not": [sched.microbatches_in_flight(o) for o in zb]},
             index=[f"rank {r}" for r in range(4)])

# %% [markdown]
# **On 4 ranks.** `ScheduleInterleavedZeroBubble(stage, n_microbatches, loss_fn)` (torch's name;
# here ZB-H1, one stage per rank) runs the split schedule over a `PipelineStage`. Its B walks
# autograd from the stage's output to its input only and keeps the gradient at each layer's output;
# its W turns those into weight gradients (PyTorch's own split,
# `torch.distributed.pipelining._backward`). Below, the same 8-layer TinyGPT and batch through ZB-H1
# and through 1F1B, every weight gradient compared with one device's in float64; the verdict allows
# a few times what one device's float32 backward itself differs from float64 (the lab's Numbers
# rule).

# %%
zb_cfg = reference.RunConfig(steps=1, global_batch=8, optimizer="sgd",
                             model_kwargs=dict(layers=8, hidden=16, heads=2, seq=8, vocab=8,
                                               ffn=64))


def lm_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def one_step(ctx, schedule):
    model = reference.build_model(zb_cfg)
    x, y = reference.batch(model, zb_cfg, 0)
    modules = split_into_stages(model, ctx.world_size)
    first = ctx.rank == 0
    stage = PipelineStage(modules[ctx.rank], ctx.rank, ctx.world_size,
                          input_shape=None if first else (1, 8, 16))   # one sequence
    pipe = (ScheduleInterleavedZeroBubble(stage, 8, lm_loss) if schedule == "zb-h1"
            else Schedule1F1B(stage, 8, lm_loss))
    ctx.comm.barrier()                    # both schedules start together on the clock
    start = len(ctx.clock.timeline())
    pipe.step(x if first else None, target=y if stage.is_last else None)
    grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    return dict(grads=grads, timeline=ctx.clock.timeline()[start:])


def both_schedules(ctx):
    return {s: one_step(ctx, s) for s in ("1f1b", "zb-h1")}


on_ranks = labkit.launch(both_schedules, 4, cluster=free)


def single_device_grads(dtype):
    model = reference.build_model(zb_cfg).to(dtype)
    x, y = reference.batch(model, zb_cfg, 0)
    lm_loss(model(x), y).backward()
    return {n: q.grad for n, q in model.named_parameters()}


exact, fp32 = single_device_grads(torch.float64), single_device_grads(torch.float32)


def relative_error(grads):
    return max(((g.double() - exact[n]).abs().max() / exact[n].abs().max()).item()
               for n, g in grads.items())


fp32_own = relative_error(fp32)
for s in ("1f1b", "zb-h1"):
    grads = {n: g for r in on_ranks for n, g in r[s]["grads"].items()}
    assert set(grads) == set(exact)
    error = relative_error(grads)
    print(f"{s:6}: max relative gradient error vs float64 {error:.1e} "
          f"(one device's float32: {fp32_own:.1e}) -> "
          f"{'equal to one device' if error <= 4 * fp32_own + 1e-7 else 'DIFFERENT'}")

# %% [markdown]
# The modelled timelines of that run (free links; the TinyGPT's stages are unequal, the first
# holding the embeddings and the last the head, and its first stage has no input gradient to
# compute, so its W is its whole backward):

# %%
fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
for ax, s in zip(axes, ("1f1b", "zb-h1")):
    timeline = [e for r in on_ranks for e in r[s]["timeline"]]
    t0 = min(e["start"] for e in timeline)
    timeline = [dict(e, start=e["start"] - t0, end=e["end"] - t0) for e in timeline]
    gantt(timeline, ax=ax, title=f"{s}, P=4, M=8, real run, bubble "
                                 f"{sched.timeline_bubble_fraction(timeline):.0%}")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 10 · DualPipe, and torch's own zero-bubble orders
#
# **DualPipe** (DeepSeek-V3 technical report, arXiv 2412.19437, sec. 3.2.1) feeds micro-batches
# from **both ends**: each rank holds two stages, stage r and stage P−1−r of the same model
# (twice the weights), so half the micro-batches run rank 0 → P−1 and the other half
# rank P−1 → 0, and each direction's work fills the other's bubbles. In its steady state a
# rank runs an **F&B** slot: the forward of one micro-batch overlapped with the full backward
# of another (on GPUs this hides the expert-parallel all-to-all behind compute; with free links,
# as here, F&B takes T_F + T_B + T_W). The report's Table 2 gives the idle time per rank, with
# F, B the *full* backward, W its weight part:
#
# | schedule | idle per rank | weights | activations |
# |---|---|---|---|
# | 1F1B | (P−1)(F+B) | 1× | P |
# | ZB1P (ZB-H1) | (P−1)(F+B−2W) | 1× | P |
# | DualPipe | (P/2−1)(F&B+B−3W) | 2× | P+1 |
#
# `labkit.theory.pipeline_layouts` holds DualPipe's order as data (its 8 steps per rank, from
# the report and DeepSeek's public implementation) on the "dual" layout, and replays it with
# the executor's timing rules: a full backward and an F&B are *slots* whose outputs leave
# together at their end. Below, P = 4 and M = 8 (micro-batches 0–3 enter at rank 0, 4–7 at
# rank 3), T_F = T_B = T_W = 1 ms (modelled):

# %%
from labkit.theory import pipeline_layouts as layouts
from labkit.viz.zero_bubble_widgets import draw_zero_bubble, zero_bubble_explorer

fig = plt.figure(figsize=(10, 6))
print(draw_zero_bubble(fig, "DualPipe", 4, 8, weight_share=0.5).replace("&nbsp;", " ")
      .replace("<b>", "").replace("</b>", ""))
plt.show()

# %% [markdown]
# Every rank idles the same, and the simulated idle equals Table 2's when the forward and the
# input gradient take the same time (T_F = T_B, the first two rows of each P below). When they
# differ, the replayed order idles less than the table when T_B > T_F and more when T_F > T_B
# (in every setting tried; `tests/test_pipeline_layouts.py` checks a few): the table's
# formula is exact for T_F = T_B, a close estimate otherwise. Each rank holds P+1
# micro-batches' activations (from F until W), as the table says. Idle per rank, simulated against Table 2, P = 4 and 8:

# %%
rows = []
for p in (4, 8):
    # not (1, 1, 0.5) at P = 8: that is exercise 3's answer, derived at the end
    for t_f, t_b, t_w in ((1.0, 1.0, 1.0), (1.0, 1.0, 0.25), (1.0, 1.5, 0.5), (2.0, 1.5, 0.5)):
        times = (t_f, t_b, t_w)
        row = {"P": p, "T_F, T_B, T_W (ms)": f"{t_f:g}, {t_b:g}, {t_w:g}"}
        for name, schedule in (("1F1B", layouts.from_loop(sched.one_f_one_b_schedule(p, 2 * p))),
                               ("ZB-H1", layouts.from_loop(sched.zb_h1_schedule(p, 2 * p))),
                               ("DualPipe", layouts.dualpipe_schedule(p, 2 * p))):
            key = {"1F1B": "1f1b", "ZB-H1": "zb1p", "DualPipe": "dualpipe"}[name]
            idle = max(layouts.idle_per_rank(layouts.simulate_laid_out(schedule, *times)))
            row[f"{name} simulated"] = idle
            row[f"{name} Table 2"] = layouts.table2_idle(key, p, *times)
        rows.append(row)
pd.DataFrame(rows)

# %% [markdown]
# **torch's orders.** `torch.distributed.pipelining` has zero-bubble schedules of its own,
# `ScheduleZBVZeroBubble` (ZB-V, Qi et al. sec. 6) and `ScheduleDualPipeV` (DualPipe folded
# into a V), both with two stages per rank in a V (rank r holds stages r and 2P−1−r of a
# 2P-stage model). Every rank computes the whole order at construction, so labkit reads it
# without ranks (`labkit.parallel.zero_bubble.torch_order`), turns it into labkit's data
# (torch's I is labkit's B; its full B a slot B, W; its OVERLAP_F_B a slot F, B, W) and replays
# it with the same rules, a V chunk taking half a stage's times. Rank 0's ops, torch's first:

# %%
from labkit.parallel.zero_bubble import readable_torch_orders, torch_actions, torch_order

readable = readable_torch_orders()   # another torch may not let labkit read one: it says so
if "ScheduleDualPipeV" in readable:
    print("torch ScheduleDualPipeV, rank 0:",
          " ".join(map(str, torch_actions("ScheduleDualPipeV", 4, 8)[0])))
    print("as labkit data (Fm.c: micro-batch m, chunk c):",
          " ".join(f"{k}{m}.{c}" for k, m, c in torch_order("ScheduleDualPipeV", 4, 8).ops[0]))

rows = []
for p, m in ((4, 8), (4, 16), (8, 16)):
    ours = {"ZB-H1 (labkit)": layouts.from_loop(sched.zb_h1_schedule(p, m)),
            "DualPipe (labkit)": layouts.dualpipe_schedule(p, m)}
    torch_side = {f"{n} (torch)": torch_order(n, p, m) for n in readable}
    for name, schedule in {**ours, **torch_side}.items():
        scale = 0.5 if schedule.layout == "v" else 1.0          # a V chunk: half a stage
        timeline = layouts.simulate_laid_out(schedule, scale, scale, scale)
        layouts.check_laid_out(schedule)
        rows.append({"P": p, "M": m, "schedule": name,
                     "idle per rank (ms)": max(layouts.idle_per_rank(timeline)),
                     "bubble": sched.timeline_bubble_fraction(timeline),
                     "activations (x stage)": max(layouts.activations_held(schedule))})
pd.DataFrame(rows).round(3)

# %% [markdown]
# Read with T_F = T_B = T_W = 1 ms per stage: labkit's ZB-H1 idles (P−1)(T_F+T_B−T_W), the
# paper's; torch's ZBV idles half of that, (P−1) × T_F/2, the time the first micro-batch takes
# to reach rank P−1 down the V (that rank waits so long whatever the order; torch's docstring
# calls this schedule zero bubble for equal times, apart from that ramp); torch's DualPipeV
# idles exactly what Table 2 gives DualPipe on 2P half stages, (2P/2−1)(F&B+B−3W) with half
# the times, and holds fewer activations (x one whole stage) than DualPipe (its half stages).
# All four run every op once and in order on their layout (checked,
# no deadlock). `bench/zero_bubble.py` runs labkit's ZB-H1 executor against torch's
# `ScheduleZBVZeroBubble` and `Schedule1F1B` on 4 gloo ranks (step time, ratio with spread, in
# data/bench.csv).
#
# **Explore.** Schedule, P, M, and the weight gradient's share of the 2 ms backward (0.5: T_B =
# T_W = T_F = 1 ms). Try: DualPipe against ZB-H1 at P = 8 with a W share of 0.5, then 0.25
# (with equal times DualPipe saves one T_F + T_B − T_W; with a small W it idles less still, the
# ratio the cell below prints, for twice the weights); a W share of 0.1 (little to fill the
# bubbles with: ZB-H1 falls back towards 1F1B); M from 2P to 24 (the idle stays, the bubble's
# share falls).

# %%
zero_bubble_explorer()

# %%
from labkit.viz import zero_bubble_widgets as zb_widgets

for share in (0.5, 0.25):
    idle = {name: max(layouts.idle_per_rank(layouts.simulate_laid_out(
        zb_widgets.laid_out(name, 8, 16), *zb_widgets.op_times(share))))
        for name in ("ZB-H1", "DualPipe")}
    print(f"P = 8, M = 16, W share {share}: DualPipe idles {idle['DualPipe'] * 1e3:.1f} ms per "
          f"rank, ZB-H1 {idle['ZB-H1'] * 1e3:.1f} ms: {idle['DualPipe'] / idle['ZB-H1']:.2f} x "
          "as long (simulated)")

# %% [markdown]
# ## Takeaways
#
# - `split_into_stages`, `PipelineStage` and `Schedule1F1B` (torch's names) pipeline any
#   `nn.Sequential` (or labkit's GPT) in your own loop, in any process group, like
#   `torch.distributed.pipelining`.
# - A pipeline splits the *layers*: Ψ/P of the model states per GPU, activations of the
#   micro-batches in flight, and only the boundary activations on the wire (point to point).
# - The bubble (P-1)/(V·M+P-1) is read off the modelled clock here (`bubble_fraction`): it
#   matches when stages are equal and messages cost nothing; latency and unequal stages make it
#   larger.
# - GPipe and 1F1B have the same bubble; 1F1B bounds the first stage's activations by P
#   micro-batches instead of M. Interleaving shrinks the bubble at the price of V× the messages
#   and more in-flight activations. Recomputation trades a forward per backward for memory.
# - Zero bubble splits the backward into B and W and moves the W's into the idle slots: ZB-H1
#   idles (P−1)(T_F+T_B−T_W), with 1F1B's memory. DualPipe feeds both ends and overlaps a
#   forward with a backward: less idle than ZB-H1 (Table 2's formula, exact when T_F = T_B)
#   for twice the weights and P+1 activations; its F&B overlap pays off most where it hides
#   communication. torch's ZBV and DualPipeV orders replay with labkit's rules.
# - The source article's "half the memory on two GPUs" holds for the per-GPU memory; "some
#   execution speed" is really idle GPUs for a single batch, which micro-batches win back.

# %% [markdown]
# ## Exercises
#
# Three exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · Write the 1F1B order for one stage.** Below, `my_stage0` is the order of ops on stage 0 of
# a 4-stage pipeline with 8 micro-batches; the other stages run labkit's 1F1B. `check_stage_order`
# first checks the schedule the way the executor does (every op once, each F before its B, no
# deadlock: replayed by the simulator), then runs it for real on 4 ranks and compares the
# parameters with one device, and says how many micro-batches' activations the stage holds.
# GPipe's order (all eight F, then all eight B) gives the right result, but stage 0 holds all 8:
# try it first. Then write 1F1B for P = 4 and M = 8 (section 1 shows the rule on 3 stages). Try
# also putting `B0` right after `F0`: the executor refuses it, naming the ops that would wait
# forever.

# %% tags=["solution"]
my_stage0 = ["F0", "F1", "F2",                  # warm-up: P - 1 - stage = 3 forwards
             "F3", "B0", "F4", "B1", "F5", "B2", "F6", "B3", "F7", "B4",   # one F, one B
             "B5", "B6", "B7"]                  # drain

# %%
check = check_stage_order(my_stage0, stage=0, stages=4, microbatches=8)

# %% [markdown]
# **2 · GPipe's bubble.** A GPipe pipeline has P = 6 equal stages and runs M = 20 micro-batches
# per step, messages free. What fraction of the step's time does each stage sit idle? Write it
# as an expression that shows the derivation.

# %% tags=["solution"]
gpipe_bubble = (6 - 1) / (20 + 6 - 1)   # idle slots (P-1) over the step's M + P - 1 slots

# %%
check_gpipe_bubble(gpipe_bubble);

# %% [markdown]
# **3 · DualPipe's idle time.** P = 8 ranks run DualPipe with free links; one stage's forward
# of a micro-batch takes T_F = 1 ms, its input gradient T_B = 1 ms and its weight gradient
# T_W = 0.5 ms. How many milliseconds does each rank idle per step? Use Table 2 (section 10):
# what is its B, and what does an F&B slot take when the overlap has no communication to hide?
# The check compares with DualPipe's order replayed by the simulator.

# %% tags=["solution"]
full_backward = 1.0 + 0.5                        # Table 2's B: input and weight gradients
dualpipe_idle = (8 / 2 - 1) * ((1.0 + full_backward) + full_backward - 3 * 0.5)   # F&B = F + B

# %%
check_dualpipe_idle(dualpipe_idle);

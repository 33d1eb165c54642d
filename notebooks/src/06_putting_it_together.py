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
# # 06 · Putting it together: a DP × TP × PP mesh, and a planner
#
# Each technique of lessons 01-05 hits a wall on its own. Data parallelism copies the whole model
# to every GPU. ZeRO shards the model states, but every GPU still runs every layer on its own
# whole sequences: it pays in recomputation (its activations must fit beside the states) and in
# all-gathers across the slow links between nodes. Tensor parallelism needs NVLink-class links, so
# it stops at one node (8 GPUs). Pipeline parallelism leaves GPUs idle in the bubble unless there
# are many micro-batches per stage. Real runs combine them: Llama 3.1 405B trained with TP 8
# inside each node, PP 16 across nodes and data parallelism over the rest (Dubey et al. 2024).
#
# The source article ends by saying that, depending on the bottleneck, you can cut memory or
# time by "combining these techniques". This lesson does it:
# 1. trains the tiny GPT on a **2 × 2 × 2 mesh** (8 CPU ranks: DP × TP × PP, each dimension one
#    of the building blocks of `labkit.parallel`) and checks it against one device;
# 2. asks a **planner** (`labkit.theory.planner`) which layouts of a real model fit a real cluster
#    and how fast each would go (modelled from measured and published constants and one
#    declared fitted factor), checked against published runs it was not fitted to.

# %%
import pandas as pd
import matplotlib.pyplot as plt
from IPython.display import Markdown

import labkit
from labkit.runs import hybrid, reference
from labkit.theory import catalog, planner
from labkit.viz.planner_widgets import (mesh_layout, plan_figure, plan_label, plan_table,
                                        planner_explorer)
from labkit.exercises.hybrid import (EXERCISE, check_dp_average, check_hybrid_memory,
                                     check_layout, show_solution)

pd.set_option("display.precision", 3)
pd.set_option("display.width", 120)
GB = 1e9

# %% [markdown]
# ## 1 · The walls of each technique alone (modelled)
#
# Llama 3 70B, a batch of 256 sequences of 4,096 tokens, on 64 H100s (8 nodes of 8). The planner
# holds the layout each technique allows on its own and searches the rest (micro-batch size,
# recompute, ...). `fits` compares the worst GPU's bytes with what an 80 GB H100 leaves usable.

# %%
WALLS = {"data parallel only": "dp=64,tp=1,pp=1,zero_stage=0",
         "ZeRO-3 only": "dp=64,tp=1,pp=1,zero_stage=3",
         "tensor parallel only (TP 64)": "dp=1,tp=64,pp=1",
         "pipeline only (PP 64)": "dp=1,tp=1,pp=64,v=1",      # plain 1F1B, no interleaving
         "TP 8 x PP 8": "dp=1,tp=8,pp=8",
         "TP 8 x PP 2 x DP 4": "dp=4,tp=8,pp=2"}


def best_plan(fix):
    """The planner's best plan with the layout `fix` held, or why it cannot be built."""
    try:
        plans = planner.plan("llama-3-70b", 64, "H100", global_batch=256, seq=4096, fix=fix,
                             top=1)["plans"]
    except ValueError as error:
        return {"illegal": str(error)}
    return plans[0] if plans else {"illegal": "no legal plan"}


walls = {name: best_plan(fix) for name, fix in WALLS.items()}
pd.DataFrame({name: {"GB per GPU": p["memory_bytes"]["total"] / GB, "fits": p["fits"],
                     "step (s, modelled)": p["step_s"], "MFU (modelled)": f"{p['mfu']:.1%}",
                     "largest overhead": max((k for k in p["breakdown_s"] if k != "compute"),
                                             key=lambda k: p["breakdown_s"][k])}
              if "illegal" not in p else {"fits": "cannot be built"}
              for name, p in walls.items()}).T

# %%
legal = {n: p for n, p in walls.items() if "illegal" not in p}
best_alone = max((p for n, p in legal.items() if p["fits"] and "x" not in n),
                 key=lambda p: p["mfu"], default=None)
combined, tp64, pp64 = (walls[n] for n in ("TP 8 x PP 2 x DP 4", "tensor parallel only (TP 64)",
                                           "pipeline only (PP 64)"))
zero3 = walls["ZeRO-3 only"]["breakdown_s"]
zero3_costs = sorted((k for k in zero3 if k != "compute"), key=zero3.get, reverse=True)[:2]
layers = catalog.model("llama-3-70b").layers
states = walls["data parallel only"]["memory_bytes"]
per_param = {k: states[k] / catalog.model("llama-3-70b").param_count()
             for k in ("params", "grads", "optimizer")}
pp_text = (f"PP 64 (1F1B, v = {pp64['v']}, {layers} layers over 64 stages) leaves "
           f"{pp64['breakdown_s']['pp_bubble'] / pp64['step_s']:.0%} of the step in the bubble"
           if "illegal" not in pp64 else f"PP 64 cannot be built: {pp64['illegal']}")
Markdown(
    f"Plain data parallelism needs {walls['data parallel only']['memory_bytes']['total'] / GB:.0f}"
    f" GB per GPU. ZeRO-3 alone fits; its two largest overheads are "
    f"{' and '.join(f'{k} ({zero3[k]:.1f} s)' for k in zero3_costs)} of its "
    f"{walls['ZeRO-3 only']['step_s']:.1f} s step. TP 64 spans 8 nodes: its all-reduces cross "
    f"InfiniBand and take {tp64['breakdown_s']['tp_comm']:.0f} s of a {tp64['step_s']:.0f} s "
    f"step. {pp_text}. The best single technique that fits reaches {best_alone['mfu']:.1%} MFU; "
    f"TP 8 × PP 2 × DP 4 reaches {combined['mfu']:.1%}.\n\n"
    f"The planner counts {sum(per_param.values()):.0f} bytes of model states per parameter: "
    f"{per_param['params']:.0f} (bf16 weights) + {per_param['grads']:.0f} (gradients, "
    f"{'fp32 as Megatron-LM accumulates them' if per_param['grads'] == 4 else 'bf16'}) + "
    f"{per_param['optimizer']:.0f} (fp32 master weights and Adam's two moments). The ZeRO "
    f"paper, and exercise 3 below, count bf16 gradients: 2 + 2 + 12 = 16.")

# %% [markdown]
# ## 2 · Run it: the tiny GPT on a 2 × 2 × 2 mesh
#
# `labkit.runs.hybrid.report` starts 8 ranks and lays them out as a mesh (`labkit.Mesh`): **TP
# innermost** (ranks 0-1 share a TP group), then DP, then PP outermost. Each rank builds the same
# GPT, keeps its pipeline stage (`split_into_stages`), splits that stage's matrices over its TP
# group (`parallelize_module`), runs the 1F1B schedule with its stage neighbours (`Schedule1F1B`),
# and after the pipeline flush averages its gradients with the other replica of its stage (one
# all-reduce over the DP group). All of it is `labkit.parallel.hybrid.HybridParallel`, composed from
# the blocks of lessons 01-03. The modelled cluster is 2 nodes of 4 H100s.

# %%
cfg = reference.RunConfig(steps=3)   # Adam, as every lesson's reference run
run = hybrid.report(cfg=cfg, dp=2, tp=2, pp=2, microbatches=2, cluster="2x4xH100-IB")
print(f"loss per step:      {[round(x, 5) for x in run['loss']]}")
print(f"reference (1 CPU):  {[round(x, 5) for x in run['reference_loss']]}")
print(f"parameters after {cfg.steps} steps: {run['agreement']['params']['verdict']}")
fig = mesh_layout(run["mesh_table"], gpus_per_node=4,
                  title="2 x 2 x 2 mesh on 2 modelled nodes: colour = stage, shade = TP shard")

# %% [markdown]
# Same losses, same parameters: the difference is float rounding of sums taken in another
# order, judged as in lesson 01 against the same run in float64 (`labkit.numerics`). Adam
# magnifies it where a gradient is exactly zero but computed as noise; the float32 reference
# makes such noise too (`tests/test_hybrid.py` checks SGD and Adam). The communication, by the
# mesh dimension it ran in (payloads measured; wire bytes are the ring model's, not measured on
# gloo; seconds are modelled on the 2-node cluster):

# %%
comm = pd.DataFrame(run["comm_by_dim"]).rename(columns={
    "bytes": "payload bytes (measured)", "wire_bytes": "ring-model bytes (modelled)",
    "modelled_s": "seconds (modelled)"})
comm

# %% [markdown]
# TP moves the most (4 collectives per layer and micro-batch, on the critical path): that is why
# it sits innermost, on NVLink. PP sends one activation per micro-batch and stage boundary; DP
# reduces each stage's gradients once per step.
#
# **The wrong order.** Put TP outermost instead (`order=("tp", "pp", "dp", "cp")`): ranks 0 and 4
# form a TP group, on different nodes. Same numbers, a slower modelled step:

# %%
wrong = hybrid.report(cfg=cfg, dp=2, tp=2, pp=2, microbatches=2, cluster="2x4xH100-IB",
                      order="tp,pp,dp,cp")
tp_time = {name: sum(r["modelled_s"] for r in rep["comm_by_dim"] if r["dim"] == "tp")
           for name, rep in (("TP inside a node", run), ("TP across nodes", wrong))}
print(f"same parameters as one device: {wrong['agreement']['params']['verdict']}")
for name, rep in (("TP inside a node", run), ("TP across nodes", wrong)):
    print(f"{name:>17}: TP comm {tp_time[name] * 1e6:8.1f} us (modelled, all ranks), "
          f"step {rep['modelled_step_s'] * 1e6:7.1f} us (modelled)")
fig = mesh_layout(wrong["mesh_table"], gpus_per_node=4,
                  title="TP outermost: each TP group spans both nodes (rank r and r + 4)")

# %% [markdown]
# ## 3 · Measured memory beside the planner's
#
# The planner predicts the memory of any layout from the model's shape. Given the tiny GPT's shape
# and this run's settings (fp32 Adam, no dropout, the softmax stored), it should land near what
# the ranks measured. Stage 0 (ranks 0-3) holds the embeddings, stage 1 the head.

# %%
tiny = "layers=2,hidden=64,heads=4,ffn=256,vocab=128,seq=32,arch=gpt,tied=false"
predicted = planner.plan(tiny, 8, "H100", global_batch=cfg.global_batch, seq=32,
                         precision="fp32", dropout=False, flash_attention=False,
                         fix="dp=2,tp=2,pp=2,v=1,micro_batch_size=2,zero_stage=0,"
                             "recompute=none,sequence_parallel=false")["plans"][0]
cats = ["params", "grads", "optimizer", "activations"]
rows = {f"rank {r} (measured)": {c: run["memory"][r][c] for c in cats} for r in (0, 4)}
rows["planner, worst stage (modelled)"] = {c: predicted["memory_bytes"][c] for c in cats}
mem = pd.DataFrame(rows).T / 1e3
mem.columns = [f"{c} (KB)" for c in cats]
worst = {c: max(run["memory"][r][c] for r in (0, 4)) for c in cats}
mem.loc["planner / worst measured"] = [predicted["memory_bytes"][c] / worst[c] for c in cats]
mem

# %% [markdown]
# ### The plan, run in miniature: FSDP × TP × PP
#
# The fsdp2 stack is PyTorch's FSDP2 (ZeRO-3) beside TP and PP, but whether the planner ranks
# ZeRO-3 first depends on the case: for the one section 4 plans (Llama 3 70B, 64 H100s), the cell
# below prints the ZeRO stages of the plans `python -m labkit plan --stack fsdp2` ranks first, and
# where the best ZeRO-3 layout that really shards (dp > 1) stands among them (modelled).

# %%
fsdp2 = planner.plan("llama-3-70b", 64, "H100", global_batch=256, seq=4096, stack="fsdp2")
ranked = [p for p in fsdp2["plans"] if p["fits"]]
top_stages = sorted({p["zero_stage"] for p in ranked[:8]})
rank3, best3 = next((i, p) for i, p in enumerate(ranked, 1)
                    if p["zero_stage"] == 3 and p["dp"] > 1)
print(f"plan --stack fsdp2, Llama 3 70B on 64 H100s (modelled): its top 8 use ZeRO-"
      f"{', '.join(map(str, top_stages))}; best: {plan_label(ranked[0], ' · ')}, step "
      f"{ranked[0]['step_s']:.2f} s")
print(f"the best ZeRO-3 with dp > 1 ranks #{rank3} of {len(ranked)} that fit: "
      f"{plan_label(best3, ' · ')}, step {best3['step_s']:.2f} s")

# %% [markdown]
# Whatever it ranks first, a ZeRO-3 × TP × PP layout is one the planner prices, and the one with
# the most to check. `labkit.runs.miniature` runs any plan's layout on a tiny GPT of the
# planner's GPT family (degrees kept; layers, hidden, heads, ffn, vocab, sequence and batch
# shrunk so that each still divides by tp and pp) and sets
# what the ranks **measured** beside what **the planner's own functions** say for that tiny shape:
# memory of the worst stage by category, and ring-model bytes per rank and step by mesh dimension.
# Where the mesh legitimately differs from the planner's accounting (row-parallel biases and
# norms whole on every TP rank, the embedding and head as pipeline units of their own, the
# pipeline's two ends sending one way only), the module derives the difference and adds it
# (`+derived`); activations are an order-of-magnitude check (the planner counts a fused 16-bit
# kernel's tensors, the tiny fp32 model saves what eager PyTorch saves). `python -m labkit plan
# ... --miniature` does the same for the plan it ranks first.

# %%
from labkit.runs import miniature

small = miniature.miniature(dict(dp=2, tp=2, pp=2, zero_stage=3))
print(miniature.format_rows(small))
print(f"the run against one device: {small['report']['agreement']['params']['verdict']}")
table = pd.DataFrame(small["rows"]).set_index("what")
table.columns = ["planner (modelled)", "planner + derived (modelled)", "measured",
                 "measured / (planner + derived)", "verdict"]
table

# %%
fig, ax = plt.subplots(figsize=(8, 3.2))
names = list(table.index)
x = range(len(names))
for shift, col, label in ((-0.27, "planner (modelled)", "planner alone (modelled)"),
                          (0.0, "planner + derived (modelled)", "planner + derived (modelled)"),
                          (0.27, "measured", "measured on 8 CPU ranks")):
    ax.bar([i + shift for i in x], table[col] / 1e3, 0.27, label=label)
ax.set_xticks(list(x), names, rotation=20)
ax.set_ylabel("KB per rank (bytes: per step)")
ax.set_title("FSDP x TP x PP (ZeRO 3, dp=2, tp=2, pp=2) in miniature: planner vs measured")
ax.legend(frameon=False)
fig.tight_layout()

# %% [markdown]
# Memory and bytes equal the planner's terms to the byte once the derived differences are
# added; the activations land within a few per cent although nothing was fitted.
#
# ### Every dimension in miniature: CP, EP, recompute, and DP × TP × PP × CP on 16 ranks
#
# The same check for the other dimensions. Context parallelism: the planner's K/V ring
# (`plan_terms.cp_ring_bytes`, the bytes its time is priced on) against the `cp` bytes the ring
# attention sent, + one derived hop (the mesh carries dK, dV home). Expert parallelism: the
# planner's dispatch and combine all-to-alls (`plan_terms.ep_all_to_all_bytes`, GShard's
# tokens x top-k x hidden, (ep-1)/ep on the wire) + the routing counts' small all-gather.
# Full recompute: the planner's forward collectives counted twice, of every layer (the
# pipeline rebuilds whole stages) or of k of a stage's L layers (each of k blocks checkpointed;
# a plan's 3 of 12 runs as 1 of 4). Selective recompute (`labkit/parallel/recompute.py`:
# each attention core checkpointed, Korthikanti et al. 2022) repeats no collective, as the
# planner counts. The table counts, per shape, the rows (memory by category, bytes per
# dimension) that equal planner + derived.

# %%
shapes = {
    "cp": dict(cp=2),
    "tp+sp x cp": dict(tp=2, cp=2, sequence_parallel=True),
    "dp x ep": dict(dp=2, ep=2),
    "dp x tp+sp x pp x cp, ZeRO-1": dict(dp=2, tp=2, pp=2, cp=2, zero_stage=1,
                                         sequence_parallel=True),
    "tp x pp x cp, full recompute": dict(tp=2, pp=2, cp=2, recompute="full"),
    "dp x tp, full recompute of 3 of 12": dict(dp=2, tp=2, recompute="full", recompute_layers=3,
                                               layers_per_stage=12),
    "dp x tp x pp, selective recompute": dict(dp=2, tp=2, pp=2, recompute="selective"),
}
summary = {}
for name, fields in shapes.items():
    out = miniature.miniature(fields)
    exact = [r for r in out["rows"] if r["what"] != "activations"]
    acts = next(r for r in out["rows"] if r["what"] == "activations")
    summary[name] = {"CPU ranks": out["run"]["world"],
                     "dimensions": ", ".join(r["what"].split()[0] for r in exact
                                             if r["what"].endswith("bytes") and r["measured"]),
                     "rows equal": f"{sum(r['verdict'] == 'equal' for r in exact)} of {len(exact)}",
                     "activations measured / modelled": round(acts["ratio"], 2),
                     "equals one device": out["report"]["agreement"]["params"]["ok"]}
pd.DataFrame(summary).T

# %% [markdown]
# Recompute is where the mesh and the planner differ most: the planner keeps each layer's input
# and rebuilds one layer at a time, the pipeline keeps each stage's input and rebuilds the whole
# stage. Both say the activations fall with two micro-batches in flight; the ranks measure it.
# Selective recompute drops only the attention scores (a s^2 b of a layer's 16 sbh + a s^2 b
# here): less than full recompute, for one attention core's forward again per layer:

# %%
drop = miniature.recompute_drop(dict(dp=2, pp=2))
print(miniature.format_drop(drop))
print(miniature.format_drop(miniature.recompute_drop(dict(dp=2, pp=2), mode="selective",
                                                     runs=drop["runs"])))

# %% [markdown]
# ## 4 · The planner on real models (modelled)
#
# For a model, a cluster and a batch the planner enumerates every legal layout (dp, tp, pp,
# interleaving v, micro-batch size, ZeRO stage, recompute of k layers per stage, sequence
# parallelism; cp and ep where they apply), predicts memory per GPU on the worst pipeline stage
# and the step time by named terms, and ranks the plans that fit. Its physics is in
# `labkit/theory/` (`planner.py`, `plan_terms.py`, `recompute.py`, `overlap.py`): FLOPs from the
# shapes (`transformer.py`), collectives from the alpha-beta ring model, the bubble of each
# schedule, and per software stack (`stack="megatron"`, `"megatron-2021"`, `"fsdp2"`,
# `"deepspeed"`) which communication hides under compute, each split into exposed and hidden
# time. Interleaving is legal only with whole layers per virtual stage. Model states count
# **18 bytes per parameter** (bf16 weights 2, fp32 gradients 4, fp32 master weights and Adam
# moments 12), the convention of Megatron-LM and FSDP2; ZeRO's paper (and exercise 3) counts
# **16**, with bf16 gradients. The command line gives the same: `python -m labkit plan --model
# llama-3-70b --gpus 64 --global-batch 256` (add `--precision fp8`, `--stack fsdp2`, `--gpu B200`).

# %%
CASES = [("llama-3-8b", 8, 512), ("llama-3-70b", 64, 256), ("llama-3-70b", 512, 1024),
         ("llama-3.1-405b", 16384, 2048), ("mixtral-8x7b", 64, 512)]
best_rows = []
for name, gpus, batch in CASES:
    out = planner.plan(name, gpus, "H100", global_batch=batch, seq=4096 if "405" not in name
                       else 8192, top=1)
    p = out["plans"][0]
    best_rows.append({"model": out["model"]["display_name"], "H100s": gpus,
                      "plans considered": out["considered"],
                      "best plan": plan_label(p, " · "),
                      "GB per GPU": round(p["memory_bytes"]["total"] / GB, 1),
                      "step (s)": round(p["step_s"], 2), "MFU": f"{p['mfu']:.1%}",
                      "tokens/s/GPU": round(p["tokens_per_s_per_gpu"])})
pd.DataFrame(best_rows)

# %%
out70 = planner.plan("llama-3-70b", 64, "H100", global_batch=256, seq=4096, top=4)
fig = plan_figure(out70)
plan_table(out70, 4)

# %% [markdown]
# ## 5 · How good is the model? Published runs
#
# The planner times a step kernel by kernel (`labkit/theory/kernels.py`): each GEMM at the
# GPU's maximum achievable matmul FLOP/s (a public microbenchmark, `data/hardware.csv`, column
# `mamf_*`) lowered by the tile and wave quantization of its shape; fused attention forward and
# backward each at the rate the FlashAttention-3 paper measured for cuDNN's kernel on an H100,
# by head dimension and sequence length (a GPU without such a curve: a stated default fraction
# of its peak); bytes at the share of the HBM bandwidth a model's kernels sustain; and a
# launch cost per kernel (`data/kernels.csv`, each constant with its source). Element-wise
# kernels (norms, rotary, activations, residual adds, dropout, the fp32 loss over the logits)
# move their own bytes, forward and backward; backward GEMMs run at their own (dgrad, wgrad)
# shapes. **One number is fitted, and only to one table.** Built from microbenchmarks alone, the
# model is optimistic on Narayanan et al. 2021, Table 1 (GPT models from 1.7B to 1T parameters
# on 32 to 3,072 A100s) and on every other run (printed below): a GEMM inside a step runs slower
# than the same GEMM timed alone on an idle GPU. So GEMMs run at one factor of the
# microbenchmark's rate, fitted so that Table 1's rows (`calibration`) average no error, and the
# other rows (`check`) test it. The rest are
# datasheets (FLOP/s, HBM, links) and named assumptions, printed below: link efficiency,
# latencies, the allocator's reserve and the SMs overlapped communication takes from compute.
# Then it predicts runs it never looked at while it was designed
# (Korthikanti et al. 2022; Llama 3.1 405B, Dubey et al. 2024; NVIDIA's NeMo and Megatron-Bridge
# performance tables on H100, B200 and GB200, mostly fp8), beside `llm-analysis`, a tool that
# assumes half of peak (`flops_efficiency=0.5`) and no overlap (its column comes from
# `bench/planner.py --write`). Errors are modelled / published - 1, in TFLOP/s per GPU counted
# as 6 N + 12 L h s per token (rows that publish tokens/s are compared in tokens).

# %%
from labkit.theory import hardware, overlap, plan_terms, published as runs_check

other = {}
check_csv = hardware.DATA_DIR / "planner_check.csv"
if check_csv.is_file():
    other = pd.read_csv(check_csv).set_index("name")["llm_analysis"].to_dict()
rows = []
for use in ("calibration", "check"):
    for r in runs_check.check(runs_check.runs(use)):
        theirs = other.get(r["name"], float("nan"))
        rows.append({"use": use, "run": r["name"], "GPUs": int(r["gpus"]), "GPU": r["gpu"],
                     "precision": r["precision"], "published": round(r["published"], 1),
                     "labkit (modelled)": round(r["predicted"], 1),
                     "labkit error": r["error"], "llm-analysis": theirs,
                     "llm-analysis error": theirs / r["published"] - 1})
published = pd.DataFrame(rows)
link = hardware.link("NVLink 4")
from labkit.theory import kernels

h100 = hardware.gpu("H100")
attention_at_8k = {way: kernels.attention_rate(h100, 128, 8192, True, way) / h100.bf16_flops
                   for way in ("forward", "backward")}
for use in ("calibration", "check"):
    alone = runs_check.check(runs_check.runs(use), in_step_gemm_fraction=1.0)
    print(f"microbenchmarks alone (GEMMs at their MAMF rate), {use} rows: mean error "
          f"{sum(r['error'] for r in alone) / len(alone):+.1%} (modelled / published - 1)")
print(f"fitted on the calibration rows only: GEMMs inside a step at "
      f"{kernels.IN_STEP_GEMM_FRACTION:.3f} of the microbenchmark's rate")
print(f"measured, not fitted: H100 GEMM ceiling {kernels.ceiling(h100):.2f} of peak (MAMF), "
      f"HBM {kernels.HBM_FRACTION:.0%} of the datasheet, {kernels.LAUNCH_S * 1e6:g} us per "
      f"kernel launch; causal attention at 8K tokens, head dim 128: forward "
      f"{attention_at_8k['forward']:.0%}, backward {attention_at_8k['backward']:.0%} of peak "
      f"(a GPU without a measured curve: {kernels.DEFAULT_ATTENTION_FRACTION:.0%})")
print(f"assumed: link efficiency {link.efficiency:.0%} of line rate, NVLink latency "
      f"{link.latency * 1e6:.0f} us, allocator reserve {plan_terms.ALLOCATOR_RESERVE / 2**30:.0f} "
      f"GiB, overlapped comm holds {overlap.COMM_SMS} SMs (of an H100's {kernels.sms(h100)})")
for use in ("calibration", "check"):
    part = published[published.use == use]
    print(f"mean absolute error, {use} rows ({len(part)}): labkit "
          f"{part['labkit error'].abs().mean():.1%}, llm-analysis "
          f"{part['llm-analysis error'].abs().mean():.1%}")
published.style.format({"labkit error": "{:+.1%}", "llm-analysis error": "{:+.1%}",
                        "llm-analysis": "{:.1f}"}, na_rep="-")

# %% [markdown]
# ### How far to trust a plan: the expected error band
#
# The check rows are the planner's error bars. Every `python -m labkit plan` prints them under
# its table (and its `--json` carries them as `error_band`): the spread of modelled / published
# - 1 over the check rows, the central 80% of them (so one run with a known cause, below, does
# not set it), the full range, and the rows outside. A real run of a plan is then expected
# near modelled / (1 + error). The figure puts each check row at (published, modelled): on the
# grey line the planner is exact; inside the shaded band lie the rows that set it. The hollow
# circles are the calibration rows, which the one fitted number was fitted on, so they are not
# in the band. Beside it, the training steps that `labkit calibrate` measured on one H200 (a
# 1B-shaped Llama), predicted by the same planner. `plan --serve` prints its own band, from
# published serving runs (lesson 09 draws it), with the decode steps measured on that H200
# beside it.

# %%
from labkit.theory import error_band
from labkit.viz.planner_widgets import error_band_figure

band = error_band.training_band()
signed = sum(r["error"] for r in band["rows"]) / band["n"]
over = sum(r["error"] > 0 for r in band["rows"])
print(f"mean error over the {band['n']} check rows (modelled / published - 1): {signed:+.1%} "
      f"signed, {band['mean_abs']:.1%} absolute")
print(f"which way it errs: {'optimistic (too fast)' if signed > 0 else 'pessimistic (too slow)'}"
      f" on average; {over} of the {band['n']} rows over-predict, {band['n'] - over} under")
print("\n".join(error_band.format_band(band)))
fig = error_band_figure(band, error_band.published_rows(runs_check.runs("calibration")))

# %% [markdown]
# ### Where a step goes: the modelled parts beside published steps
#
# `python -m labkit plan --explain` splits the best plan's step into parts that add up to it
# (every plan carries them as `explain_s`; `planner.format_explain` prints them): GEMMs,
# attention forward and backward, element-wise kernels, kernel launches, recompute, the
# optimizer, the communication each mesh dimension leaves exposed, the pipeline bubble, and
# the compute slowed by the SMs that hidden communication holds. No paper publishes such a split
# of its run, but two publish the step it must add up to. Korthikanti et al. 2022 (Table 5)
# give the iteration time of four GPT models on A100s with full recompute and with their
# selective recompute + sequence parallelism, so each model checks recompute's price as well
# as the total. Dubey et al. 2024 state Llama 3.1 405B's TFLOP/s per GPU (41% MFU), which
# makes a step: tokens x FLOPs per token / (TFLOP/s per GPU x GPUs). The cell below holds each
# run's published layout (the planner searches the rest, as for the check rows), prints the
# modelled step beside the published one and draws two of them part by part.

# %%
from labkit.theory import transformer
from labkit.viz.planner_widgets import step_breakdown_figure

# Korthikanti et al. 2022 (arXiv 2205.05198), Table 5: end-to-end iteration time (s), full
# recompute against the paper's selective recompute + sequence parallelism
TABLE5 = {"GPT 22B (Korthikanti)": {"full": 1.42, "selective": 1.10},
          "GPT 175B (Korthikanti)": {"full": 18.13, "selective": 13.75},
          "GPT 530B (Korthikanti)": {"full": 49.05, "selective": 37.83},
          "GPT 1T (Korthikanti)": {"full": 94.42, "selective": 71.49}}
check_rows = {r["name"]: r for r in runs_check.runs("check")}
table5, table5_plans = [], {}
for name, published_s in TABLE5.items():
    for recompute, seconds in published_s.items():
        # the row's layout with this recompute; under full, sequence parallelism is searched
        row = dict(check_rows[name], recompute=recompute)
        if recompute == "full":
            row["sequence_parallel"] = ""
        p = table5_plans[name, recompute] = runs_check.predict(row)
        table5.append({"run": name.replace(" (Korthikanti)", ""), "recompute": recompute,
                       "layout (modelled best)": plan_label(p, " · "),
                       "published step (s)": seconds,
                       "modelled step (s)": round(p["step_s"], 2),
                       "modelled / published - 1": p["step_s"] / seconds - 1})
table5 = pd.DataFrame(table5)
ratios = [(table5_plans[n, "full"]["step_s"] / table5_plans[n, "selective"]["step_s"],
           TABLE5[n]["full"] / TABLE5[n]["selective"]) for n in TABLE5]
print(f"Table 5, modelled / published step - 1: from "
      f"{table5['modelled / published - 1'].min():+.1%} to "
      f"{table5['modelled / published - 1'].max():+.1%} (negative: the model is too fast)")
print("full / selective recompute step, modelled vs published: " + ", ".join(
    f"{n.split()[1]} {a:.2f}x vs {b:.2f}x" for n, (a, b) in zip(TABLE5, ratios)))

llama = check_rows["Llama 3.1 405B 8K on 16384"]
llama_plan = runs_check.predict(llama)
stated_s = int(llama["global_batch"]) * int(llama["seq"]) * transformer.model_flops_per_token(
    planner.parse_model(llama["model"]), int(llama["seq"])) / (
    float(llama["tflops_per_gpu"]) * 1e12 * int(llama["gpus"]))
print(f"Llama 3.1 405B on {int(llama['gpus']):,} H100s: the stated "
      f"{float(llama['tflops_per_gpu']):.0f} TFLOP/s per GPU make a {stated_s:.2f} s step; "
      f"modelled {llama_plan['step_s']:.2f} s ({llama_plan['step_s'] / stated_s - 1:+.1%})")
gpt175 = {k: table5_plans["GPT 175B (Korthikanti)", k] for k in ("full", "selective")}
print("GEMMs' share of the modelled step: " + ", ".join(
    f"{label} {p['explain_s']['gemm'] / p['step_s']:.0%}" for label, p in (
        ("GPT 175B full", gpt175["full"]), ("GPT 175B selective", gpt175["selective"]),
        ("Llama 3.1 405B", llama_plan))))
print(planner.format_explain(llama_plan))
fig = step_breakdown_figure([
    ("GPT 175B on 64 A100s (TP 8, PP 8): Korthikanti et al. 2022, Table 5", [
        ("full recompute: labkit (modelled)", gpt175["full"]["explain_s"]),
        ("full recompute: published", TABLE5["GPT 175B (Korthikanti)"]["full"]),
        ("selective + SP: labkit (modelled)", gpt175["selective"]["explain_s"]),
        ("selective + SP: published", TABLE5["GPT 175B (Korthikanti)"]["selective"])]),
    (f"Llama 3.1 405B on {int(llama['gpus']):,} H100s (TP 8, PP 16, DP 128): Dubey et al. "
     "2024", [("labkit (modelled)", llama_plan["explain_s"]),
              ("published (from its stated MFU)", stated_s)])])
table5.style.format({"modelled / published - 1": "{:+.1%}"})

# %% [markdown]
# What the model leaves out, so the errors can be read. **Kernels**: every GEMM runs at one
# fitted fraction of the best matmul a microbenchmark found (MAMF), whatever the run's stack,
# and GEMMs are the largest part of every modelled step above, so wherever a run's real GEMMs
# fall further short the model is optimistic, where they come closer it is pessimistic; the
# cells above print which way the check rows err, on average and row by row, and how far each
# published step is from its model. **Conventions**: some runs
# keep bf16 gradients (16 bytes per parameter, not 18), so a layout that fits them needs
# recompute here (GPT3-20B), and the Llama 3 paper does not say whether its MFU halves the
# causal attention FLOPs (at 128K the scores are most of the FLOPs counted).
# **Stragglers and failures**: a slow GPU or a restarted job slows every rank of a synchronous
# step, and long runs lose time to checkpoints; framework overheads beyond a launch cost per
# kernel, network contention between groups that share links and load imbalance between MoE
# experts are left out too. It is good enough to rank layouts and to say which part of a step
# dominates; the check rows show how far to trust an absolute MFU.
#
# ## 6 · Explore
#
# Pick a model, the number and kind of GPUs, the batch (tokens) and the sequence length: the
# four best plans, their memory per GPU and their modelled step.

# %%
planner_explorer()

# %% [markdown]
# ## 7 · Memory-bound or time-bound: what to add next
#
# The source article's closing advice, made concrete: first make it **fit** (memory-bound), then
# make it **fast** (time-bound). For Llama 3 70B on 64 H100s, each row below allows one more
# technique than the row above and takes the planner's best plan:

# %%
LADDER = [("DP", "tp=1,pp=1,zero_stage=0"), ("+ ZeRO", "tp=1,pp=1"),
          ("+ TP inside the node", "pp=1"), ("+ PP", "")]
ladder = []
for name, fix in LADDER:
    out = planner.plan("llama-3-70b", 64, "H100", global_batch=256, seq=4096, fix=fix, top=1)
    p = out["plans"][0]
    ladder.append({"allowed": name, "best plan": plan_label(p, " · "), "fits": p["fits"],
                   "GB per GPU": round(p["memory_bytes"]["total"] / GB, 1),
                   "MFU": f"{p['mfu']:.1%}" if p["fits"] else "-",
                   "what holds it back": max((k for k in p["breakdown_s"] if k != "compute"),
                                             key=lambda k: p["breakdown_s"][k])
                   if p["fits"] else p["reason"]})
pd.DataFrame(ladder)

# %% [markdown]
# Read it as a decision chart: **does not fit** → shard the model states (ZeRO) or the layers
# (TP inside a node, PP across nodes), or keep fewer activations (recompute, sequence
# parallelism). **Fits but slow** → look at the largest overhead: exposed DP/ZeRO traffic
# (fewer replicas across slow links, ZeRO-1 rather than 3), TP traffic (keep TP inside a node),
# the bubble (more micro-batches, interleaving), recomputation (recompute less once it fits).
#
# ## 8 · The source article's claim 3, revisited
#
# The source article says that with model parallelism "the runtime compared to single GPU
# training tends to increase by a similar magnitude to the number of GPUs used". With a fixed
# global batch the planner says (modelled):

# %%
scaling = []
for gpus in (8, 16, 32, 64, 128, 256):
    best = planner.plan("llama-3-70b", gpus, "H100", global_batch=256, seq=4096,
                        top=1)["plans"][0]
    pure = planner.plan("llama-3-70b", gpus, "H100", global_batch=256, seq=4096,
                        fix=f"dp=1,tp={min(gpus, 8)},pp={gpus // min(gpus, 8)}",
                        top=1)["plans"][0]
    scaling.append({"H100s": gpus, "best plan": plan_label(best, " · "), "fits": best["fits"],
                    "best step (s)": best["step_s"],
                    "best GPU-seconds": best["step_s"] * gpus,
                    "dp=1 step (s)": pure["step_s"], "dp=1 fits": pure["fits"],
                    "dp=1 GPU-seconds": pure["step_s"] * gpus})
scaling = pd.DataFrame(scaling)
fit = scaling[scaling["fits"] & scaling["dp=1 fits"]]
a, b = fit.iloc[0], fit.iloc[-1]
display(scaling.round(2))
more = b["H100s"] / a["H100s"]
Markdown(
    f"Where both fit ({a['H100s']} to {b['H100s']} GPUs, {more:.0f}x more), the step does "
    f"not grow, it shrinks: the best plan from {a['best step (s)']:.1f} s to "
    f"{b['best step (s)']:.1f} s, model parallelism alone (dp=1: only TP and PP grow) from "
    f"{a['dp=1 step (s)']:.1f} s to {b['dp=1 step (s)']:.1f} s. What grows is the cost: "
    f"GPU-seconds per step change by {b['best GPU-seconds'] / a['best GPU-seconds']:.2f}x for "
    f"the best plan and by {b['dp=1 GPU-seconds'] / a['dp=1 GPU-seconds']:.2f}x with model "
    f"parallelism alone (ideal scaling: 1.00x). So the claim holds only as a statement about "
    f"efficiency, and only weakly: each GPU does less useful work as the bubble and the "
    f"communication grow, but the runtime does not rise with the number of GPUs.")


# %% [markdown]
# ## Takeaways
#
# - Each technique alone hits a wall: DP copies everything, ZeRO-3 recomputes to fit every
#   layer's activations and gathers across slow links, TP stops at the node, PP idles in the
#   bubble. Combined on a mesh (TP innermost, PP across
#   nodes, DP outermost) they fit models none fits alone.
# - The mesh is the blocks of lessons 01-03 composed, nothing more, and it trains exactly what one
#   device trains.
# - The planner turns "which layout?" into arithmetic, kernel by kernel, from measured and
#   published constants (one factor fitted on a declared table), and it is checked on runs it
#   was not fitted to: trust its ranking,
#   and its absolute MFU within the errors shown.
# - First make it fit (shard states, layers or activations), then make it fast (the largest
#   overhead says what to change).

# %% [markdown]
# ## Exercises
#
# Three exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · Average over the right group.** On a mesh, a gradient must be averaged over the ranks
# that hold copies of the *same* weights, and only those. Write `my_dp_average(ctx, mesh, grad)`
# for a dp = 2 × tp = 2 mesh (4 ranks, TP innermost): return `grad` averaged over this rank's
# data-parallel group. `mesh["dp"]` and `mesh["tp"]` are this rank's groups (`.size`, `.ranks`);
# every collective takes `group=`. The checker gives each rank a different gradient.

# %% tags=["solution"]
def my_dp_average(ctx, mesh, grad):
    ctx.comm.all_reduce(grad, group=mesh["dp"])   # the replicas of my TP shard, nobody else
    return grad / mesh["dp"].size


# %%
check_dp_average(my_dp_average);

# %% [markdown]
# **2 · A layout that fits and is fast.** Llama 3 70B on 96 H100s (12 nodes of 8), a batch
# of 384 sequences of 4,096 tokens: give a layout that **fits** and reaches a modelled **MFU
# of at least 45%**. Give at least `dp`, `tp` and `pp` (their product is 96); you may fix `v`,
# `micro_batch_size`, `zero_stage`, `recompute` and `sequence_parallel` too (the planner searches
# what you leave out). `check_layout` answers in words.

# %% tags=["solution"]
my_layout = dict(dp=24, tp=4, pp=1)     # TP inside a node, ZeRO and the rest left to the planner

# %%
check = check_layout(my_layout)

# %% [markdown]
# **3 · Memory per GPU of a hybrid layout.** Llama 3 70B (70.55 B parameters) on 64 GPUs as
# dp = 2 × tp = 8 × pp = 4, mixed-precision Adam, ZeRO-1 over the data-parallel group. How many
# GB of model states does each GPU hold (equal stages; activations aside)? Write it as an
# expression that shows the derivation.

# %% tags=["solution"]
local_params = 70.55e9 / (8 * 4)                        # TP x PP split every parameter
hybrid_gb_per_gpu = (2 + 2 + 12 / 2) * local_params / 1e9   # ZeRO-1: Adam state / dp

# %%
check_hybrid_memory(hybrid_gb_per_gpu);

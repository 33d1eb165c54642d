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
# # 05 · Mixture of Experts and expert parallelism
#
# An MoE layer replaces a transformer block's MLP by **E expert MLPs** and a **router**: a linear
# gate gives every token a softmax over experts, and the token goes to its **top-k** experts
# (k = 1 in Switch Transformer, k = 2 in Mixtral). A token then costs k experts' FLOPs while the
# model holds E experts' weights: *total* parameters grow with E, *active* parameters per token
# with k.
#
# Each expert has a **capacity**, C = ⌈capacity factor · k · T / E⌉ slots for T tokens (Switch
# Transformer's formula for k = 1). Assignments past C are **dropped**: the token skips that
# expert and passes through the residual connection. A **load-balancing loss**
# E · Σₑ fₑ · Pₑ (fraction of assignments × mean router probability, Fedus et al. 2021) pushes
# the router to spread tokens, and a router z-loss keeps its logits small.
#
# **Expert parallelism** puts E/N experts on each of N GPUs. Every rank routes its own tokens,
# an **all-to-all** sends each token to the rank that holds its expert, the experts run, and a
# second all-to-all brings the outputs home; backward mirrors both. Each all-to-all moves
# (N−1)/N of the T·k·h dispatched values per rank. In labkit this is one building block,
# `labkit.ExpertParallel(moe_layer, group)`: it takes an existing MoE layer (its router and its
# experts), keeps E/N experts on each rank of the group and replicates the router.

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

import labkit
from labkit.exercises.moe import check_capacity_answer, check_top_k_routing, show_solution
from labkit.models import MoEConfig, MoELayer
from labkit.runs import moe
from labkit.runs.reference import RunConfig
from labkit.theory import catalog, moe as tmoe
from labkit.viz.moe_widgets import load_histogram, moe_explorer

pd.set_option("display.precision", 3)
torch.set_num_threads(1)   # this kernel runs only tiny models: one thread beats two here


# %% [markdown]
# ## 0 · The block on one layer, in your own function
#
# `ExpertParallel` wraps a layer that has a `router`, an `experts` list and the top-k and capacity
# settings (labkit's `MoELayer` here; any module of that shape works). Each rank below feeds its
# own 32 of the 64 tokens; the block exchanges the routing counts, sends every kept (token,
# choice) to the rank of its expert and brings the outputs back. Concatenated, the ranks' outputs
# are the single-device layer's, including which assignments the capacity drops.

# %%
def one_layer(ctx):
    torch.manual_seed(0)                                  # the same layer on every rank
    layer = MoELayer(16, 32, MoEConfig(experts=4, top_k=2, capacity_factor=1.0))
    ep = labkit.ExpertParallel(layer)                     # group=None: all ranks
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    out = ep(x.chunk(ctx.world_size)[ctx.rank])           # my share of the tokens
    return dict(out=out.detach(), experts=list(ep.local_experts),
                dropped=ep.routing["dropped"], capacity=ep.routing["capacity"])

ranks = labkit.launch(one_layer, 2)
torch.manual_seed(0)
single = MoELayer(16, 32, MoEConfig(experts=4, top_k=2, capacity_factor=1.0))
reference_out = single(torch.randn(64, 16, generator=torch.Generator().manual_seed(1)))
diff = (torch.cat([r["out"] for r in ranks]) - reference_out).abs().max().item()
for r in ranks:
    print(f"a rank holds experts {r['experts']}, dropped {r['dropped']} of its assignments")
print(f"capacity {ranks[0]['capacity']} slots per expert; dropped on one device: "
      f"{single.last[0].dropped}; max |2 ranks - one device| = {diff:.1e}")

# %% [markdown]
# ## 1 · Run it: 4 experts over 4 ranks, checked against one process
#
# `moe.report` trains the tiny GPT with every MLP replaced by 4 experts (top-2, capacity factor
# 1.0, so some tokens are dropped) on 4 ranks, each MoE layer wrapped in `ExpertParallel` (one
# expert per rank), the rest data-parallel (its gradients averaged by one all-reduce), and trains
# the single-process MoE on the same batches. Capacity and queue order are decided over all the
# group's tokens (each rank all-gathers every rank's routing counts), so the same assignments are
# dropped on 4 ranks as in one process. SGD here: with Adam the attention key bias, whose true
# gradient is exactly zero, gets float rounding noise as its gradient, which Adam turns into
# steps of lr·noise/(|noise| + eps), far above rounding.

# %%
cfg = RunConfig(steps=3, global_batch=8, optimizer="sgd", lr=0.1)
rep = moe.report(4, cfg, experts=4, top_k=2, capacity_factor=1.0)
pd.DataFrame({"loss, 4 ranks": rep["loss"], "loss, one process": rep["reference_loss"],
              "dropped, 4 ranks": rep["tokens_dropped"],
              "dropped, one process": rep["reference_tokens_dropped"]})

# %%
print(f"parameters after {cfg.steps} steps: {rep['agreement']['params']['verdict']}")
layers = len(rep["expert_load"])
print(f"capacity per expert: {rep['config']['capacity']} slots for "
      f"{rep['assignments_per_step'] // layers} assignments per layer")
print("per-expert load at the last step (assignments, layer 0):", rep["expert_load"][0])

# %% [markdown]
# ## 2 · Measure the communication: comm log against the formula
#
# Per rank and per step: 2 layers × (2 forward + 2 backward) all-to-alls, each logging (N−1)/N of
# the rows it is handed; the gradient all-reduce (dense part over all 4 ranks, experts have no
# replica here); and small all-gathers of the k·E + 1 routing counts per layer, plus one gather
# of each layer's experts for the report. The prediction is computed from the routing counts
# with the per-op formulas of `labkit.theory`. Calls and payloads are measured; the wire bytes
# are the ring model's (modelled: gloo does not report its own).

# %%
comm = pd.DataFrame(rep["comm"]).groupby("op")[["calls", "wire_bytes_per_rank"]].sum()
comm = comm.rename(columns={"wire_bytes_per_rank": "ring-model bytes per rank"})
comm["predicted"] = comm.index.map(rep["predicted_comm_by_op"])
comm["logged / predicted"] = comm["ring-model bytes per rank"] / comm["predicted"]
comm

# %% [markdown]
# ## 3 · Dropped tokens: capacity factor and routing skew, measured beside theory
#
# Routing is driven here by synthetic router logits whose top-1 choice follows a Zipf-like share
# qₑ ∝ (e+1)^−skew (Gumbel-max sampling), through the same routing code the model uses. Theory:
# the load nₑ of expert e is Binomial(T·k, qₑ), and the expected drops are Σₑ E[max(0, nₑ − C)].

# %%
tokens, experts, trials = 512, 8, 60
gen = torch.Generator().manual_seed(0)
rows = []
for skew in (0.0, 0.5, 1.0):
    share = torch.tensor(tmoe.skewed_shares(experts, skew))
    for cf in (0.75, 1.0, 1.25, 1.5, 2.0, 3.0):
        cap = tmoe.capacity(tokens, experts, 1, cf)
        drops = []
        for _ in range(trials):
            gumbel = -torch.log(-torch.log(torch.rand(tokens, experts, generator=gen)))
            load = torch.bincount((share.log() + gumbel).argmax(-1), minlength=experts)
            drops.append(int((load - cap).clamp(min=0).sum()))   # top-1: past capacity
        theory = tmoe.expected_tokens_dropped(tokens, experts, 1, cf, skew)["dropped"]
        rows.append(dict(skew=skew, capacity_factor=cf, measured=np.mean(drops), theory=theory))
drops = pd.DataFrame(rows)
fig, ax = plt.subplots(figsize=(7, 3.4))
for skew, g in drops.groupby("skew"):
    line, = ax.plot(g.capacity_factor, g.measured / tokens, "o", label=f"skew {skew}: measured")
    ax.plot(g.capacity_factor, g.theory / tokens, "-", color=line.get_color(),
            label=f"skew {skew}: theory (binomial)")
ax.set_xlabel("capacity factor"); ax.set_ylabel("fraction of tokens dropped")
ax.set_title(f"top-1, {experts} experts, {tokens} tokens per group"); ax.legend(fontsize=7)
plt.show()
drops.pivot(index="capacity_factor", columns="skew", values=["measured", "theory"]).round(1)

# %% [markdown]
# ## 4 · The load-balancing loss evens out the experts (a seeded training run)
#
# The same tiny MoE (8 experts, top-1) trained for 60 steps with and without the Switch loss
# (coefficient 1.0; capacity factor 4 so that drops do not hide the imbalance). Without it the
# router drifts away from an even load; with it the load stays nearer even. "Before" is step 0
# (the same model and batch for both runs), "after" the loads summed over the last 10 steps;
# `tests/test_moe.py` asserts this run.

# %%
small = dict(layers=1, hidden=32, ffn=64, seq=16, heads=2)
train_cfg = RunConfig(steps=60, lr=3e-2, global_batch=16, seed=0, model_kwargs=small)
runs = {coef: moe.reference_train(train_cfg, MoEConfig(experts=8, top_k=1, capacity_factor=4.0,
                                                       aux_loss_coef=coef))
        for coef in (0.0, 1.0)}
before = runs[0.0]["routing"][0]["load"][0]
after = {c: tmoe.load_over_steps(r["routing"], range(50, 60)) for c, r in runs.items()}
load_histogram([before, after[0.0], after[1.0]],
               ["before (step 0)", "after, no aux loss", "after, aux loss 1.0"])
plt.show()
print(f"max/mean load: step 0 {tmoe.load_imbalance(before):.2f}; steps 50-59 without the aux "
      f"loss {tmoe.load_imbalance(after[0.0]):.2f}, with it {tmoe.load_imbalance(after[1.0]):.2f}")

# %% [markdown]
# ## 5 · Total against active parameters, FLOPs and memory: Mixtral 8x7B
#
# From the catalog's Mixtral shapes (32 layers, hidden 4096, 8 SwiGLU experts of width 14336,
# top-2): every token runs the dense part (attention, embeddings, norms) and 2 of the 8 experts.
# Weights per GPU under expert parallelism: the dense part on every GPU, the experts split E/ep.

# %%
# NBVAL_CHECK_OUTPUT
split = tmoe.param_split("mixtral-8x7b")
flops = tmoe.flops_per_token("mixtral-8x7b")
print(f"total {split['total'] / 1e9:.1f}B, active {split['active'] / 1e9:.1f}B per token "
      f"({split['active_fraction']:.0%}); experts {split['experts'] / 1e9:.1f}B, "
      f"dense {split['dense'] / 1e9:.2f}B")
print(f"forward FLOPs per token: {flops['active'] / 1e9:.1f} GFLOP active "
      f"(a dense 46.7B model: {flops['total'] / 1e9:.1f}), ratio {flops['ratio']:.2f}")
dense_70b = 2 * catalog.model("llama-3-70b").param_count()   # Llama 2 70B has the same size
print(f"a dense 70B model (Llama 3 70B's shapes): {dense_70b / 1e9:.0f} GFLOP per token, "
      f"{dense_70b / flops['active']:.1f}x Mixtral's active FLOPs")
for ep in (1, 2, 4, 8):
    m = tmoe.memory_per_gpu("mixtral-8x7b", ep)
    print(f"  EP {ep}: bf16 weights per GPU {m['total'] / 1e9:5.1f} GB "
          f"(dense {m['dense'] / 1e9:.1f} + experts {m['experts'] / 1e9:.1f})")

# %% [markdown]
# **Claim 7.** The source article calls the model "Mixtral 8B" and says it outperforms Llama 2
# 70B "with significantly lower compute requirements". The model is **Mixtral 8x7B**: 46.7B
# parameters in all, 12.9B active per token (Mistral AI's figures; the cell above recomputes them
# from the shapes). The compute claim holds per token: the active FLOPs are a fraction of a dense
# 70B model's (the ratio above). Memory does not shrink: every weight (EP 1 above) must be held
# somewhere, more than one 80 GB H100 holds; expert parallelism divides the experts' share.
#
# ## 6 · Claim 8: "16 experts on 16 GPUs ... about eightfold inference throughput"
#
# The source article: distributing the 16 experts of a hypothetical model one per GPU could raise
# inference throughput "about eightfold", 10,000 → 80,000 tokens a day. The model below
# (`theory.moe.moe_step`) takes Mixtral's shapes with 16 experts, puts one expert per H100 and
# the dense part on every GPU, and charges compute (2 × active params per token at the in-step
# GEMM rate), weight reads (the weights any token touches, at HBM bandwidth) and two all-to-alls
# per layer.
# It compares against the same model on one GPU (as if it fitted: it does not) and against a
# dense model with the same total parameters on the same 16 GPUs. All numbers are modelled.

# %%
# NBVAL_CHECK_OUTPUT
claim8 = pd.DataFrame(tmoe.claim_8_table())
claim8[["top_k", "phase", "link", "bound", "tokens_per_gpu", "all_to_all_share", "vs_one_gpu",
        "vs_dense_same_total"]].round(2)


# %%
def row(k, phase, link):
    return claim8[(claim8.top_k == k) & (claim8.phase == phase)
                  & claim8.link.str.startswith(link)].iloc[0]

batch = int(row(1, "decode", "NVLink").tokens_per_gpu)
touched = {k: tmoe.experts_touched(16, 16, k, batch) for k in (1, 2)}
display(Markdown(f'''
What the model says (every number modelled). (1) 16 GPUs give at most about 16× one GPU's
*compute*; in compute-bound prefill (top-2) the spread model reaches
{row(2, "prefill", "NVLink").vs_one_gpu:.1f}× over NVLink and
{row(2, "prefill", "InfiniBand").vs_one_gpu:.1f}× over InfiniBand, where the all-to-all takes
{row(2, "prefill", "InfiniBand").all_to_all_share:.0%} of the step. No "eight" comes out of the
GPU count. (2) The factor 8 is E/k = 16/2: against a dense model of the same total size, top-2
of 16 experts does about 1/8 of the MLP work, but the dense part (attention, embeddings) is
shared, so the modelled gain in prefill is
{row(2, "prefill", "NVLink").vs_dense_same_total:.1f}× for top-2
({row(1, "prefill", "NVLink").vs_dense_same_total:.1f}× for top-1) over NVLink and
{row(2, "prefill", "InfiniBand").vs_dense_same_total:.1f}× over InfiniBand. (3) Memory-bound
decode depends on the batch: with {batch} sequences per GPU, one GPU reads the weights of the
experts its tokens touch, on average {touched[1]:.2f} of the 16 for top-1 and
{touched[2]:.1f} for top-2 (`experts_touched`: 16 (1 − (1 − k/16)^{batch})), while each of the
16 GPUs reads at most its one expert; so the ratio against one GPU exceeds 16:
{row(1, "decode", "NVLink").vs_one_gpu:.0f}× for top-1 and
{row(2, "decode", "NVLink").vs_one_gpu:.0f}× for top-2 over NVLink. Against the dense model it
is {row(2, "decode", "NVLink").vs_dense_same_total:.1f}× over NVLink and
{row(2, "decode", "InfiniBand").vs_dense_same_total:.1f}× over InfiniBand (top-2). A
"16-expert model on 16 GPUs" also spans two 8-GPU nodes, so its all-to-all really runs over
InfiniBand. And a daily token count (10,000 → 80,000) is a throughput figure; latency per
token does not fall 8×.
'''))

# %% [markdown]
# ## 7 · Explore: experts, top-k, capacity, EP degree, skew and link
#
# Expected per-expert load against capacity: kept (blue), dropped (red, over capacity) and
# **padding** (grey). Implementations with fixed shapes (GShard, Switch Transformer) give every
# expert exactly C slots, used or not, so a capacity factor above 1 buys fewer drops with empty
# slots that are computed and communicated: the expert FLOPs and the all-to-all bytes grow about
# with the capacity factor. The line below the sliders prices it against the same step without a
# capacity. labkit's own layer sends and computes only the kept rows (no padding); the explorer
# models the fixed-shape kind. Everything here comes from `labkit.theory.moe` (modelled,
# Mixtral-like shapes, H100).

# %%
moe_explorer()

# %% [markdown]
# ## Takeaway
#
# - An MoE layer holds E experts but runs k per token: Mixtral 8x7B holds 46.7B parameters and
#   spends 12.9B per token. Compute falls with k/E; memory does not.
# - Capacity turns routing imbalance into dropped tokens; the load-balancing loss keeps the load
#   even, and the capacity factor buys headroom at the cost of padding.
# - Expert parallelism moves (N−1)/N of the dispatched tokens in each of 4 all-to-alls per layer
#   and step; `labkit.ExpertParallel` reproduces the single-device MoE layer exactly because
#   capacity is decided over the whole routing group.
#
# `bench/moe.py` runs `ExpertParallel` beside the same expert parallelism written directly on
# `torch.distributed` (PyTorch has no MoE layer of its own), on the same layer, alternating the
# two in rounds. Its latest rows in `data/bench.csv` (`labkit_over_torch`: labkit's number over
# PyTorch's; the notes give the spread over rounds; measured on a shared CPU machine):

# %%
bench = pd.read_csv(labkit.theory.hardware.DATA_DIR / "bench.csv")
ratio = "labkit_over_torch" if "labkit_over_torch" in bench else "ratio"
bench[(bench.benchmark == "moe") & (bench.labkit_impl == "ExpertParallel")].drop_duplicates(
    ["world_size", "metric"], keep="last")[["world_size", "metric", "labkit", "torch", ratio,
                                            "date"]]


# %% [markdown]
# ## Exercises
#
# Two exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · Top-k routing with capacity.** Write `route(logits, k, capacity)` for logits of shape (T,
# E). Return `expert` (T, k: each token's k experts with the highest softmax probability, best
# first), `weight` (T, k: for k = 1 the probability, for k = 2 the two probabilities divided by
# their sum) and `kept` (T, k: False for assignments past an expert's capacity, filling each
# expert with all first choices in token order before any second choice). `check_top_k_routing`
# compares your function with labkit's routing on several cases and says what is wrong (a router
# that never drops is the usual first try).

# %% tags=["solution"]
def route(logits, k, capacity):
    probs = logits.softmax(dim=-1)
    weight, expert = probs.topk(k, dim=-1)
    if k > 1:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    kept = torch.zeros_like(expert, dtype=torch.bool)
    used = [0] * logits.shape[-1]                 # slots taken, per expert
    for choice in range(k):                       # all first choices before any second choice
        for t in range(logits.shape[0]):          # in token order
            e = int(expert[t, choice])
            kept[t, choice] = used[e] < capacity
            used[e] += int(kept[t, choice])
    return expert, weight, kept


# %%
check_top_k_routing(route);

# %% [markdown]
# **2 · Capacity in tokens.** A layer routes a batch of T = 6,000 tokens to E = 64 experts with
# top-k = 2 and a capacity factor of 1.25. How many slots (tokens) does each expert get? Write it
# as an expression that shows the derivation.

# %% tags=["solution"]
import math

slots_per_expert = math.ceil(1.25 * 2 * 6000 / 64)   # factor x k x T / E, rounded up

# %%
check_capacity_answer(slots_per_expert);

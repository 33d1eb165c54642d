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
# # 08 · Context parallelism: sequences too long for one GPU
#
# Long contexts are where most other techniques stop helping. Activations grow with the sequence
# length s (and naive attention's with s²); data parallelism and ZeRO do not split a sequence.
# Tensor parallelism with sequence parallelism (lesson 03) does divide the activations, by t, but
# only over the GPUs of one node, and each rank's attention heads still see the *whole*
# sequence. **Context parallelism (CP)** splits every sequence across N GPUs, s/N tokens each,
# for *every* layer, attention included, and across nodes as well.
#
# Attention needs every query to meet every key. The trick (**Ring Attention**, Liu et al. 2023):
# softmax can be computed block by block. Rank r keeps its queries Q_r; the key/value blocks of
# all ranks travel around a ring (send to r+1, receive from r-1), and after N steps every query
# has met every key. Each block gives a *partial* result, its softmax output O_b normalised over
# that block only, and its **log-sum-exp** lse_b = log Σ_j exp(s_j). Two partial results of the
# same queries merge exactly:
#
# lse = log(e^lse_a + e^lse_b),   O = e^(lse_a − lse) · O_a + e^(lse_b − lse) · O_b
#
# (the online softmax FlashAttention uses inside one GPU). Backward passes K, V around the ring
# again, and the gradients dK, dV of each block, partial sums over every rank's queries, travel
# with it and come home after N hops.
#
# - **Memory per rank**: activations of s/N tokens; attention keeps q, k, v, out (+ one fp32 lse
#   per query) and never the s × s scores.
# - **Communication per rank and layer**: forward (N−1) · KV, backward (N−1) · KV + N · dKV, where
#   KV = 2·b·h_kv·(s/N)·d values: it *overlaps* with the block computation when a block is large.
# - **The causal pitfall**: with a causal mask, the rank holding the last chunk does ~2× the
#   average work. The **zigzag** layout (2N chunks, rank r holds chunks r and 2N−1−r) balances it.
# - **Llama 3's choice** (Dubey et al. 2024): all-gather K and V (cheap with grouped-query
#   attention, whose K and V have a fraction of the query heads: printed below), then attend;
#   also with the load-balanced 2N-chunk layout.
#
# labkit's block: `ring_attention(q, k, v, group, causal, layout)`, `all_gather_attention(...)`,
# `ContextParallel(attention_module, group, layout)`, and `shard_sequence` / `gather_sequence`.

# %%
import inspect

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F
from IPython.display import Markdown, display

import labkit
from labkit.exercises.context_parallel import (check_merge, check_ring_attention,
                                               check_ring_bytes, partial_attention,
                                               show_solution)
from labkit.parallel import context_parallelism as cp, ring_attention
from labkit.runs import context_parallel as run_cp
from labkit.runs.reference import RunConfig
from labkit.theory import catalog, hardware
from labkit.theory import context_parallel as tcp
from labkit.theory import transformer
from labkit.viz import gantt
from labkit.viz.cp_widgets import cp_explorer, cp_memory, memory_vs_seq, ring_gantt, work_bars

pd.set_option("display.precision", 3)
pd.set_option("display.width", 120)

# %% [markdown]
# ## Which blocks a rank computes
#
# The whole forward is the merge above, once per ring step (you write it, and a ring around
# it, in the exercises at the end). `_block_plan` says what rank `me` does with
# the block of rank `src`: with a causal mask and the contiguous layout a block from a *later*
# rank is entirely hidden (skipped); in the zigzag layout every off-diagonal block costs exactly
# half a block: all my queries against the early half of an earlier rank's block, or only my late
# chunk against a later rank's whole block.

# %%
print(inspect.getsource(ring_attention._block_plan))


# %% [markdown]
# ## Your own attention module on 4 ranks
#
# `ContextParallel` wraps a module that calls `F.scaled_dot_product_attention`: during its forward
# the call is routed to `ring_attention` over the group. Everything else in the module must be
# position-wise (here: linear projections), and **the input must be this rank's shard of the
# sequence**: `shard_sequence` does it. We check the output (gathered back in global order) and
# the weight gradients (summed over ranks: the weights are replicated) against the module run on
# the whole sequence on one device, and then show the pitfall: a rank handed the whole sequence.

# %%
class MyAttention(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


def my_module(ctx, layout):
    torch.manual_seed(0)
    module, x = MyAttention(), torch.randn(2, 64, 32)
    expected = module(x)                        # one device, whole sequence
    expected.sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    wrapped = cp.ContextParallel(module, layout=layout)
    y = wrapped(cp.shard_sequence(x, layout=layout))        # this rank's 64/4 tokens
    y.sum().backward()
    comm = ctx.comm.summary(by=("op", "tag"))
    with ctx.off_the_record():                  # checks, kept out of the log
        out_diff = (cp.gather_sequence(y.detach(), layout=layout) - expected).abs().max().item()
        grad_diff = max(((ctx.comm.all_reduce(p.grad.clone()) - grads[n]).abs().max()
                         / grads[n].abs().max()).item() for n, p in module.named_parameters())
        unsharded = wrapped(x)                  # the pitfall: the whole sequence on every rank
        wrong = (cp.gather_sequence(unsharded.detach(), layout=layout)[:, :64]
                 - expected).abs().max().item()
    return dict(out=out_diff, grad=grad_diff, local=tuple(y.shape), wrong=wrong, comm=comm)


mine = labkit.launch(my_module, 4, "zigzag")
print(f"rank 0 computed {mine[0]['local']} of the (2, 64, 32) output")
print(f"max |output - one device| {max(r['out'] for r in mine):.1e}; summed weight gradients: "
      f"max relative difference {max(r['grad'] for r in mine):.1e}")
print(f"pitfall, the whole sequence fed to every rank: no error, but the 4 ranks now hold one "
      f"sequence of 4 x 64 tokens, and the output differs by up to {mine[0]['wrong']:.2f}")
pd.DataFrame(mine[0]["comm"])[["op", "tag", "calls", "bytes"]]

# %% [markdown]
# Each rank sent its K|V block 3 times in forward and 3 times in backward (the ring of 4), and
# its dK|dV partial sums 4 times; a `recv` row for each. The unsharded input does not raise
# (a rank cannot know its input is not a shard), which is why this pitfall is so common.
#
# ## Run it: the tiny GPT on 4 ranks, against one device
#
# `run_cp.report` trains labkit's GPT with every sequence split over 4 ranks (each rank embeds
# its tokens at their global positions, every block's attention is wrapped in `ContextParallel`,
# the replicated weights' gradients are averaged by one all-reduce), and compares the parameters
# with the single-device run. Then an **attention check**: one ring attention forward and
# backward on random q, k, v, against single-device fp64 attention, with each rank's FLOPs as its
# clock counted them.

# %%
cfg = RunConfig(steps=3)
runs = {layout: run_cp.report(4, cfg, layout=layout) for layout in ("contiguous", "zigzag")}
for layout, r in runs.items():
    a = r["attention_check"]
    print(f"{layout:>10}: loss {[round(x, 4) for x in r['loss']]} reference "
          f"{[round(x, 4) for x in r['reference_loss']]}\n  parameters vs the float64 run: "
          f"{r['agreement']['params']['verdict']}\n  attention check vs fp64: {a['verdict']}")

# %% [markdown]
# "Equal" cannot mean bit for bit: 4 ranks add the same numbers in another order, and float32
# rounds each order differently (and each CPU's kernels differently again). So labkit runs the
# single-device reference twice, in float32 and in float64 (nearly exact), and calls a parallel
# run equal when its distance to the float64 run is at most a few times the float32 run's own
# distance to it (`labkit.numerics`): the verdict below holds on any CPU.

# %%
# NBVAL_CHECK_OUTPUT
for layout, r in runs.items():
    a = r["attention_check"]
    print(f"{layout}: parameters and loss equal one device's (within float32 rounding): "
          f"{r['agreement']['params']['ok'] and r['agreement']['loss']['ok']}; attention "
          f"output and q, k, v gradients equal (within rounding): {a['within_rounding']}")

# %% [markdown]
# Adam makes the parameter errors above larger than plain SGD's would be. Its step is
# lr·m/(√v + eps). The attention key bias has a true gradient of exactly 0 (softmax does not
# change when a whole row of scores moves together), so what backward computes for it is
# rounding noise, different on one device and on 4 ranks. Where that noise is far below eps (here
# eps = 1e-6, `build_optimizer`) the step is about lr·noise/eps: small, but far above rounding.
# Were eps below the noise, Adam would turn pure noise into steps of up to lr. The float32
# reference makes the same kind of noise, which is why the verdict measures both against float64.
#
# ## The causal imbalance, measured
#
# Each rank's clock counted the matmul FLOPs of its attention blocks. With the contiguous layout
# rank r computes blocks 0..r: the FLOPs climb with the rank. With zigzag every rank computes the
# same. Below, the counted FLOPs against `tcp.attention_flops_per_rank` (the formula for what
# labkit's blocks compute: the diagonal block is computed whole, masked).

# %%
rows = []
for layout, r in runs.items():
    a = r["attention_check"]
    for rank, (got, want) in enumerate(zip(a["flops_per_rank"], a["predicted_flops_per_rank"])):
        rows.append(dict(layout=layout, rank=rank, flops_counted=got, formula=int(want),
                         over_mean=got / (sum(a["flops_per_rank"]) / 4)))
flops = pd.DataFrame(rows)
fig, ax = plt.subplots(figsize=(7, 3.4))
for i, (layout, group) in enumerate(flops.groupby("layout", sort=False)):
    ax.bar(group["rank"] + (i - 0.5) * 0.38, group["over_mean"], 0.38, label=layout)
ax.axhline(1, color="black", ls="--", lw=1)
ax.set_xticks(range(4), [f"rank {r}" for r in range(4)])
ax.set_ylabel("attention FLOPs / mean (counted)")
ax.set_title("attention FLOPs per rank, causal, 4 ranks (measured by the clock's counter)")
ax.legend()
ax.grid(axis="y", alpha=0.3)
plt.show()
flops

# %%
# NBVAL_CHECK_OUTPUT
for layout, r in runs.items():
    a = r["attention_check"]
    print(f"{layout}: counted FLOPs equal the formula: "
          f"{a['flops_per_rank'] == a['predicted_flops_per_rank']}; slowest rank / mean = "
          f"{a['imbalance']:.2f}")

# %% [markdown]
# With the whole diagonal block computed, the contiguous imbalance is 2N/(N+1) (1.6 at N = 4);
# counting only the query-key pairs the mask keeps it is (2N−1)/N, 1.75 at N = 4 and → 2 as N
# grows: the last rank does ~2x the average and every other rank waits for it.
#
# ### On the modelled clock
#
# The run's attention check on the modelled H100 clock. At this tiny size (8 tokens per rank)
# each block computes in nanoseconds while a message costs microseconds of latency: the ring
# transfers fill the timeline (grey: waiting for them) and the imbalance does not show. Ring
# attention only pays off when a block is large enough to hide its transfer:

# %%
fig, ax = plt.subplots(figsize=(11, 3.4))
gantt(runs["contiguous"]["attention_timeline"], ax=ax,
      title="the run's attention check, contiguous, 4 ranks x 8 tokens (modelled clock)")
plt.show()
a = runs["contiguous"]["attention_check"]
busy = sum(e["end"] - e["start"] for e in runs["contiguous"]["attention_timeline"]
           if e["rank"] == 3 and e["kind"] == "compute")
print(f"modelled: {a['modelled_s'] * 1e6:.1f} us for forward + backward, of which rank 3 (the "
      f"busiest) computes {busy * 1e9:.1f} ns")
for name in ("Llama 3 8B", "Llama 3 70B", "Llama 3.1 405B"):
    m = catalog.model(name)
    print(f"{name}: {m.kv_heads} KV heads for {m.heads} query heads (K and V are "
          f"1/{m.heads // m.kv_heads} of Q)")
llama = catalog.model("Llama 3 8B")
tokens = tcp.min_block_tokens(llama.heads, llama.hidden // llama.heads, kv_heads=llama.kv_heads)
print(f"Llama 3 8B ({llama.heads} query heads, {llama.kv_heads} KV heads, "
      f"d={llama.hidden // llama.heads}), causal: a block hides its KV transfer over NVLink "
      f"from about {tokens:,.0f} tokens per rank (modelled, bandwidth term only)")

# %% [markdown]
# At realistic sizes compute dominates and the imbalance *is* the step time. One attention layer
# of Llama 3 8B at 128K tokens over CP = 8 H100s (modelled by `tcp.ring_schedule`: each step a
# rank computes its share of a block while its KV block travels on):

# %%
fig, axes = plt.subplots(2, 1, figsize=(11, 7.5))
for ax, layout in zip(axes, ("contiguous", "zigzag")):
    ring_gantt(ax, "Llama 3 8B", 131072, 8, layout)
plt.show()
rows = []
for layout in ("contiguous", "zigzag"):
    for overlap in (True, False):
        s = tcp.ring_schedule(1, llama.heads, 131072, 128, 8, layout, kv_heads=llama.kv_heads,
                              overlap=overlap)
        rows.append(dict(layout=layout, overlap=overlap, forward_ms=s["time_s"] * 1e3,
                         block_ms=s["block_s"] * 1e3, send_ms=s["send_s"] * 1e3,
                         busiest_rank_ms=max(s["busy_s"]) * 1e3))
display(pd.DataFrame(rows))
nvlink, infiniband = hardware.link("NVLink 4"), hardware.link("InfiniBand NDR")
Markdown(f"Zigzag nearly halves the layer's attention time: the same total work, spread evenly. "
         f"Overlap matters little *here* because one {131072 // 8:,}-token block computes in "
         f"{s['block_s'] * 1e3:.1f} ms while its KV block crosses {nvlink.name} in "
         f"{s['send_s'] * 1e3:.2f} ms; across nodes ({infiniband.name}, "
         f"{nvlink.bandwidth / infiniband.bandwidth:.0f}x less bandwidth) or with smaller blocks "
         "it decides.")

# %% [markdown]
# ## Bytes: communication and memory against the formulas

# %%
run2 = run_cp.report(2, RunConfig(steps=1), layout="zigzag")

# %%
# NBVAL_CHECK_OUTPUT
for r in (run2, runs["zigzag"]):
    a, n = r["attention_check"], r["world_size"]
    print(f"N={n}: comm bytes per rank {a['comm_bytes_per_rank']} (formula "
          f"{a['predicted_comm_bytes_per_rank']:.0f}); saved for backward per rank "
          f"{a['saved_bytes_per_rank']} (formula {a['predicted_saved_bytes_per_rank']:.0f})")

# %% [markdown]
# The bytes a rank *saves* halve from N = 2 to N = 4: activation memory goes as s/N. The bytes it
# *sends* per attention call are (N−1)·KV + (N−1)·KV + N·dKV with KV = 2·b·h·(s/N)·d. Here
# everything is fp32, so dKV has the bytes of KV: (3N−2)/N times the K and V of the whole
# sequence (2 at N = 2, 2.5 at N = 4, → 3). In a bf16 run whose dK, dV sums travel in fp32 (the
# takeaway below), dKV is twice KV: (4N−2)/N, → 4. Either way the traffic per rank hardly
# changes with N while each rank's compute falls as 1/N, which is why a block must stay large
# (long sequences) for the transfer to hide.
#
# ## Llama 3 8B: when does 128K fit on 8 H100s?
#
# The planner (`labkit.theory.planner`, which knows a `cp` dimension) on one sequence held by a CP
# group, tensor and pipeline parallelism off, ZeRO-1 over the CP ranks, FlashAttention (so no
# s² scores), with and without full activation recomputation (all modelled):

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
memory_vs_seq(axes[0], recompute="none")
memory_vs_seq(axes[1], recompute="full")
plt.show()
rows = []
for recompute in ("none", "selective", "full"):
    for n in (1, 2, 4, 8):
        parts, p = cp_memory("Llama 3 8B", 131072, n, recompute)
        rows.append(dict(cp=n, recompute=recompute, GB_per_GPU=sum(parts.values()) / 1e9,
                         activations_GB=parts["activations"] / 1e9, fits=p["fits"],
                         step_s=p["step_s"]))
table = pd.DataFrame(rows)
table

# %%
fit = table[(table.cp == 8) & table.fits]
act = transformer.activation_bytes(llama, 131072, 1, cp=8, flash=True) * llama.layers
rows_of = {r: table[table.recompute == r].GB_per_GPU.to_numpy() for r in ("none", "selective")}
print("selective recompute keeps what no recompute keeps here (FlashAttention stores no scores "
      f"for it to drop): {bool((rows_of['none'] == rows_of['selective']).all())}")
print(f"128K tokens, CP=8 on 8 H100s fits with recompute = {', '.join(fit.recompute)} "
      f"(modelled); without recompute the layers' activations alone are {act / 1e9:.0f} GB per "
      "GPU (transformer.activation_bytes x 32 layers), before the logits")
for n in (1, 2, 4, 8):
    longest = max((s for s in (8192 * 2 ** k for k in range(8))
                   if cp_memory("Llama 3 8B", s, n, "full")[1]["fits"]), default=None)
    print(f"CP={n}: the longest sequence (8K ... 1M) that fits with full recompute: "
          + (f"{longest // 1024}K tokens" if longest else "none: the model states alone do not "
             "fit") + " (modelled)")

# %% [markdown]
# Recomputation is what makes room: without it each layer keeps its activations of s/N tokens
# and 128K tokens over 8 GPUs do not fit; with it, only each layer's input. Real long-context
# runs combine CP with the rest: Llama 3.1 405B at 128K used TP 8, CP 16, PP 16, DP 8 (Dubey et
# al. 2024), and lesson 06's mesh has the `cp` dimension for it (`ctx.mesh(dp=, tp=, pp=, cp=)`,
# `mesh["cp"]` is the group to hand to `ContextParallel`). `run hybrid --cp` composes them on 8
# CPU ranks: TP 2 x CP 2 x PP 2 (`HybridParallel` wraps each attention in `ContextParallel`
# after TP, before the pipeline; the gradients are averaged over dp x cp):

# %%
from labkit.runs import hybrid as run_hybrid   # noqa: E402  (used from here on only)

mesh_run = run_hybrid.report(cfg=RunConfig(steps=1), dp=1, tp=2, pp=2, cp=2)
cp_sent = sum(r["wire_bytes"] for r in mesh_run["comm_by_dim"] if r["dim"] == "cp")
print(f"tp 2 x cp 2 x pp 2 on {mesh_run['world_size']} ranks: parameters "
      f"{mesh_run['agreement']['params']['verdict']}; loss "
      f"{mesh_run['agreement']['loss']['verdict']}")
print(f"bytes on cp: {cp_sent:.0f} sent, the ring formula {mesh_run['predicted_cp_wire_bytes']:.0f}"
      " (theory/hybrid.cp_wire_bytes)")

# %% [markdown]
#
# ## Explore: sequence length, CP degree, layout
#
# All modelled by `labkit.theory`: memory per GPU for one sequence (with and without recompute),
# each rank's share of the causal work, and one attention layer's forward ring.

# %%
cp_explorer()


# %% [markdown]
# ## Three ways to share attention: ring, all-gather, Ulysses
#
# Ring and all-gather both move **keys and values** and keep every head on every rank.
# **DeepSpeed-Ulysses** (Jacobs et al. 2023, arXiv 2309.14509) moves the other way: an
# all-to-all trades each rank's s/N tokens of *all* heads for *all* s tokens of h/N heads;
# attention then runs as on one device (each head sees its whole sequence), and a second
# all-to-all trades the output back to sequence shards. Per rank and call it sends (N−1)/N of
# its q, k, v and output shards forward and the same of their gradients backward:
# (N−1)/N·(2h + 2h_kv)·b·(s/N)·d values, which **falls as 1/N**, where ring and all-gather send
# about the whole sequence's K and V whatever N. The price: a rank must hold whole heads, so
# **N ≤ h_kv** (the K/V heads, dividing them): 8 for Llama 3 8B.
#
# `ulysses_attention(q, k, v, group, causal, layout)`, or `ContextParallel(module,
# method="ulysses")`. Below, all three (and `all_gather_attention`, Llama 3's way) on 4 ranks on
# the same inputs, 8 query heads sharing 4 K/V heads (grouped-query attention), causal, zigzag:
# each rank's output and q, k, v gradients against one device in float64, and the bytes each
# rank sent (the comm log) against theory/context_parallel.py.

# %%
def three_ways(ctx):
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(2, 8, 64, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(2))
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*exact, is_causal=True, enable_gqa=True)
    ref.backward(do.double())
    out = {}
    for method in ("ring", "all_gather", "ulysses"):
        mine = [cp.shard_sequence(t, layout="zigzag", dim=2).requires_grad_() for t in (q, k, v)]
        ctx.comm.reset()
        y = cp.CORES[method](*mine, causal=True, layout="zigzag")
        y.backward(cp.shard_sequence(do, layout="zigzag", dim=2))
        pairs = [(y, ref)] + [(m.grad, e.grad) for m, e in zip(mine, exact)]
        error = max(((a.double() - cp.shard_sequence(b.detach(), layout="zigzag", dim=2)).abs()
                     .max() / b.abs().max()).item() for a, b in pairs)
        out[method] = dict(error=error, bytes=ctx.comm.wire_bytes())
    try:      # 4 ranks cannot share 2 K/V heads
        cp.ulysses_attention(*(torch.zeros(1, h, 8, 16) for h in (4, 2, 2)), causal=True)
    except ValueError as e:
        out["limit"] = str(e)
    return out


def fp32_own_error():
    """One device's float32 attention against float64 (the Numbers rule's yardstick)."""
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(2, 8, 64, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(2))
    worst = 0.0
    ts = {}
    for dtype in (torch.float64, torch.float32):
        t = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        y = F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True)
        y.backward(do.to(dtype))
        ts[dtype] = [y] + [x.grad for x in t]
    return max(((a.double() - b).abs().max() / b.abs().max()).item()
               for a, b in zip(ts[torch.float32], ts[torch.float64]))


three = labkit.launch(three_ways, 4)
own = fp32_own_error()
rows = []
for method in ("ring", "all_gather", "ulysses"):
    error = max(r[method]["error"] for r in three)
    rows.append(dict(method=method, max_relative_error=error,
                     verdict="equal to one device" if error <= 4 * own + 1e-7 else "DIFFERENT",
                     bytes_per_rank_measured=three[0][method]["bytes"],
                     bytes_per_rank_formula=tcp.comm_bytes_per_rank(
                         2, 8, 64, 16, 4, dtype_bytes=4, grad_bytes=4, method=method,
                         kv_heads=4)["total"]))
print(f"one device's float32 attention differs from float64 by {own:.1e} (relative)")
print(f"ulysses on 4 ranks with 2 K/V heads: {three[0]['limit']}")
pd.DataFrame(rows)

# %% [markdown]
# All three equal one device; Ulysses already sends the least at N = 4 here. How the bytes go
# with N for one Llama 3 8B layer at 128K tokens (32 query heads, 8 K/V heads, d = 128, bf16;
# all modelled by theory/context_parallel.py; Ulysses stops at N = 8 = h_kv):

# %%
degrees = [2, 4, 8, 16, 32, 64]
fig, ax = plt.subplots(figsize=(8, 4.2))
for method, style in (("ring", "o-"), ("all_gather", "s--"), ("ulysses", "^-")):
    ns = [n for n in degrees if method != "ulysses" or n <= 8]
    gb = [tcp.comm_bytes_per_rank(1, 32, 131072, 128, n, kv_heads=8, method=method)["total"]
          / 1e9 for n in ns]
    ax.plot(ns, gb, style, label=method)
ax.set_xscale("log", base=2)
ax.set_xticks(degrees, [str(n) for n in degrees])
ax.set_ylim(0, None)
ax.axvline(8, color="0.5", ls=":", lw=1)
ax.text(8.5, 0.15, "N = h_kv = 8:\nUlysses' limit", fontsize=8, color="0.35")
ax.set_xlabel("CP degree N (ranks sharing one sequence)")
ax.set_ylabel("GB sent per rank, one layer\n(forward + backward, modelled)")
ax.set_title("Llama 3 8B, 128K tokens: bytes per rank vs N (modelled)")
ax.legend(frameon=False)
ax.grid(alpha=0.3, which="both", lw=0.4)
fig.tight_layout()
plt.show()
for n in (2, 4, 8):
    per = {m: tcp.comm_bytes_per_rank(1, 32, 131072, 128, n, kv_heads=8, method=m)["total"]
           for m in ("ring", "all_gather", "ulysses")}
    print(f"N={n}: " + ", ".join(f"{m} {b / 1e9:.2f} GB" for m, b in per.items())
          + f" per rank and layer (modelled); the least: {min(per, key=per.get)}")

# %% [markdown]
# Ring and all-gather level off near the whole sequence's K and V per rank whatever N (ring
# higher: its dK, dV partial sums travel in fp32), so their share of a step grows as each rank's
# compute shrinks; Ulysses' bytes shrink with the compute. With grouped-query attention K and V
# are small (8 heads of 32), so at small N all-gather still sends less than Ulysses, which also
# moves q and the output (the lines printed above say from which N Ulysses sends the least).
# Ulysses cannot go past h_kv ranks, and its all-to-alls cannot
# overlap the attention they feed, where the ring's transfers hide behind its blocks: long
# contexts on many GPUs combine them (Ulysses inside a node, a ring across nodes, as in
# USP, Fang & Zhao 2024, arXiv 2405.07719).

# %% [markdown]
# ## Takeaways
#
# - CP splits **every** layer's tokens, attention included: activation memory per GPU falls as
#   s/N, across nodes too. TP with sequence parallelism also divides activations, by t inside a
#   node; for very long sequences CP (with recomputation) keeps dividing past it.
# - Ring attention is exact: partial results merge by their log-sum-exp (checked above against one
#   device, outputs and gradients). Keep the travelling dK/dV sums in fp32: in bf16 their rounding
#   grows with the ring size (measured in `tests/test_context_parallel.py`).
# - Per rank and layer the ring moves under 3x the whole sequence's K and V whatever N (under 4x
#   when bf16 K, V travel with fp32 dK, dV sums), hidden under compute once a block holds about
#   a thousand tokens or more on H100s.
# - A causal mask with contiguous chunks makes the last rank do ~2x the average: use **zigzag**
#   (2N chunks, r and 2N−1−r). And shard the inputs: a wrapped module fed the whole sequence
#   does not fail, it is silently wrong.

# %% [markdown]
# ## Exercises
#
# Three exercises; each answer goes in its own cell (in the student edition it raises
# `NotImplementedError` or is `None`), and the cell after it checks it and says what is wrong.
# A first wrong answer gets a hint; the code (or the formula) comes with the second, or at
# once with `show_solution(n)` for exercise n.
#
# **1 · The log-sum-exp merge.** Write `merge(out_a, lse_a, out_b, lse_b) -> (out, lse)`: the
# attention of the same queries over the keys of block a *and* block b, from the two partial
# results (out: (batch, queries, d), lse: (batch, queries)), with the formula at the top of the
# lesson. The checker builds the parts from real attention and tries three cases: ordinary
# scores, scores of a few hundred (where `exp(lse)` overflows float32), and a query that has seen
# no key yet (lse = −inf on both sides, as a causal mask makes at the start of the ring). A first
# try that averages the two outputs is wrong: each is normalised over its own keys only.

# %% tags=["solution"]
def merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)                        # never exp() of an lse itself
    w_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)  # <= 1; a key-less side: 0
    w_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return w_a * out_a + w_b * out_b, lse


# %%
check_merge(merge);


# %% [markdown]
# **2 · A ring of your own.** Write `my_ring_attention(ctx, q, k, v)`: each rank holds its
# contiguous quarter of a sequence (q, k, v of shape (batch, s/N, d)) and returns its queries'
# attention over the **whole** sequence (no mask). Start from `partial_attention(q, k, v)`
# (returns out and lse for these keys only); then pass the K and V blocks around the ring with
# `ctx.comm.send(t, dst, async_op=True)` (a handle with `.wait()`) and `ctx.comm.recv(t, src)`,
# and merge each block's partial result into yours with your `merge`. The checker runs it on 4
# ranks against attention on one device, and reads the comm log: the bytes each rank sends, and
# which ops it used (an all-gather of K and V gives the right values, but it is not a ring).

# %% tags=["solution"]
def my_ring_attention(ctx, q, k, v):
    n, r = ctx.world_size, ctx.rank
    out, lse = partial_attention(q, k, v)                  # my own block first
    for _ in range(n - 1):                                 # N-1 passes: every block visits
        k_in, v_in = torch.empty_like(k), torch.empty_like(v)
        sends = [ctx.comm.send(t, (r + 1) % n, async_op=True) for t in (k, v)]
        ctx.comm.recv(k_in, (r - 1) % n)                   # the left neighbour's block
        ctx.comm.recv(v_in, (r - 1) % n)
        for handle in sends:
            handle.wait()
        k, v = k_in, v_in                                  # pass it on at the next step
        out, lse = merge(out, lse, *partial_attention(q, k, v))
    return out


# %%
check_ring_attention(my_ring_attention);

# %% [markdown]
# **3 · The bytes of the forward ring.** Llama 3 70B (64 query heads, 8 KV heads, head_dim
# d = 128) runs one sequence (b = 1) of s = 65,536 tokens with context parallelism over CP = 16
# GPUs, K and V in bf16. How many bytes does **each rank send** in the forward ring of one
# attention layer? Write it as an expression that shows the derivation.

# %% tags=["solution"]
kv_block = 2 * 1 * 8 * (65536 // 16) * 128 * 2   # K and V of s/N tokens, 8 KV heads, bf16
ring_forward_bytes = (16 - 1) * kv_block         # N-1 passes bring every other block

# %%
check_ring_bytes(ring_forward_bytes);

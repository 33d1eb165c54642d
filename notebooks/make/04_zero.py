"""Build notebooks/04_zero.ipynb from the cells below, then execute it in place.

Run from anywhere: `.venv/bin/python notebooks/make/04_zero.py`. Edit the lesson here, not in
the .ipynb: the notebook is regenerated (with its outputs) from this list.
"""
from nbmake import code, md, write_and_execute

CELLS = [
    md(r"""
# 04 · ZeRO: data parallelism without the redundant copies

**The idea** (Rajbhandari et al. 2020, *ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models*, arXiv 1910.02054). Data parallelism (lesson 01) keeps a *full* copy of the
model states on each of the N GPUs. With Ψ parameters and mixed-precision Adam that is 2Ψ bytes
of bf16 weights, 2Ψ of bf16 gradients and KΨ of optimizer state, K = 12 (the fp32 master
weights, momentum and variance, 4 + 4 + 4): **(2 + 2 + K)Ψ = 16Ψ bytes per GPU, N times over**.
Each GPU only *updates* 1/N of the parameters if the work is split, so most of that memory is
redundant. ZeRO cuts the states into N shards, one per GPU, in three stages:

| | per GPU | 7.5B params, N = 64 |
|---|---|---|
| baseline DP | (2 + 2 + K)Ψ | 120 GB |
| stage 1: shard the optimizer state | 2Ψ + 2Ψ + KΨ/N | 31.4 GB |
| stage 2: ... and the gradients | 2Ψ + (2 + K)Ψ/N | 16.6 GB |
| stage 3: ... and the parameters | (2 + 2 + K)Ψ/N | 1.9 GB |

(in fp32 without mixed precision the 2s become 4s and K = 8: momentum and variance only).

**Communication.** DP all-reduces the gradients: a ring all-reduce sends 2(N−1)/N·Ψ elements
per GPU, ≈ 2Ψ. Stages 1 and 2 replace it by a *reduce-scatter* of the gradients (each GPU gets
the sum of its own shard, Ψ) and, after each GPU has updated its shard, an *all-gather* of the
new weights (Ψ): **the same ≈ 2Ψ as DP**. Stage 3 has no full weights anywhere, so it
all-gathers each layer just before its forward and again before its backward (2Ψ) besides the
reduce-scatter: **≈ 3Ψ, 1.5× DP**. This lesson runs all three stages on 4 CPU ranks, measures
both the memory and the bytes, and checks them against these formulas.
"""),
    code(r"""
import inspect

import matplotlib.pyplot as plt
import pandas as pd

from labkit import data_parallel as dp
from labkit import zero
from labkit.runs.reference import RunConfig, build_model
from labkit.theory import hardware, memory as tm
from labkit.viz import memory_stack
from labkit.viz import zero_widgets as zw

pd.set_option("display.precision", 3)
pd.set_option("display.width", 120)
"""),
    md(r"""
## How it is built

`labkit/zero.py` puts each layer's parameters into **one flat buffer** (`FlatUnit`), padded to
a multiple of N, so that rank r owns the contiguous elements [r·S, (r+1)·S); the module's
parameters are views into the buffer, so the model runs unchanged. Gradients are reduced layer
by layer as backward finishes them, asynchronously (`GradReducer`), and stage 3 gathers a
layer's weights just before it computes and frees them right after (`ParamGatherer`), one layer
ahead by prefetch. The stage-3 hook that runs before each layer's forward:
"""),
    code(r"""
print(inspect.getsource(zero.ParamGatherer.before_forward))
print(inspect.getsource(zero.ParamGatherer.ensure))
"""),
    md(r"""
## Run it: baseline and three stages on 4 ranks, against one device

Four runs of the tiny GPT (118,528 parameters), 2 steps of a global batch of 8 sequences split
over 4 ranks. `zero.py` has no stage 0, so the **baseline** is lesson 01's data parallelism
(`labkit.data_parallel`, bucketed all-reduce): a full replica per rank, measured the same way.

We train with **fp32 Adam** (K = 8): ZeRO is about the optimizer state, so plain SGD (K = 0)
would leave stage 1 nothing to shard. Adam's update divides by √v, which can amplify a rounding
difference in a gradient that is pure noise: the attention *key* bias has a true gradient of 0
(softmax ignores a constant shift of a row of scores). `labkit.runs.reference.build_optimizer` uses
eps = 1e-6 instead of 1e-8 so that this noise stays ~1e-6 of the learning rate; then every
parameter, the key bias included, agrees with the single-device reference to float32 rounding.
Each report runs that reference itself.
"""),
    code(r"""
cfg = RunConfig(steps=2, global_batch=8, optimizer="adam")
N = 4
runs = {"baseline DP": dp.report(N, cfg)}
for stage in zero.STAGES:
    runs[f"ZeRO-{stage}"] = zero.report(N, cfg, stage=stage)
for label, r in runs.items():
    print(f"{label:12s} loss {[round(x, 4) for x in r['loss']]}  reference "
          f"{[round(x, 4) for x in r['reference_loss']]}  max |param - reference| "
          f"{r['max_param_diff_vs_reference']:.1e}")
"""),
    code(r"""
# NBVAL_CHECK_OUTPUT
for label, r in runs.items():
    same = all(abs(a - b) < 1e-5 for a, b in zip(r["loss"], r["reference_loss"]))
    print(f"{label:12s} losses equal the reference: {same}; parameters equal the "
          f"reference's (< 1e-5): {r['max_param_diff_vs_reference'] < 1e-5}")
"""),
    md(r"""
## Measure it: bytes per rank, against the paper's formulas

Each rank's memory tracker counts what it holds: the parameter buffers (full, or the shard in
stage 3), the gradients (full in stage 1, the reduced shard in 2 and 3), the optimizer state
(Adam's two moments of the shard), and what autograd saves for backward. The formula column is
`labkit.theory.memory.model_state_bytes` in fp32: 4Ψ + 4Ψ + 8Ψ divided as the stage says.
"""),
    code(r"""
psi = runs["ZeRO-1"]["config"]["param_count"]
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
memory_table
"""),
    code(r"""
fig = memory_stack(zw.measured_beside_predicted(runs), unit="MB",
                   title=f"tiny GPT, fp32 Adam, {N} ranks: memory of rank 0 (measured beside "
                   "modelled)")
plt.show()
"""),
    md(r"""
The model states shrink exactly as the formulas say: 1.90 MB per rank for DP, 1.19 MB in
stage 1, 0.83 MB in stage 2, 0.47 MB in stage 3, a factor of N = 4 overall. The optimizer
state goes first (stage 1), then the gradients (stage 2), then the weights (stage 3). The
activations do not change: every rank still runs forward and backward on its 2 sequences.
With a model this small they dominate, which is why real ZeRO runs care about activations too
(checkpointing, ZeRO-R).

**Padding.** A shard must be the same size on every rank, so each layer's flat buffer is padded
up to a multiple of N: fewer than N extra elements per layer. All the tiny GPT's layers divide
by 4, so the ratios above are exactly 1. A small MLP with layers of 33·65+65, 65·31+31 and
31·7+7 parameters does not divide, and shows the remainder:
"""),
    code(r"""
odd_cfg = RunConfig(model="mlp", steps=2, global_batch=8, optimizer="adam",
                    model_kwargs=dict(dims=(33, 65, 31, 7)))
odd = zero.report(N, odd_cfg, stage=3)
layers = [sum(p.numel() for p in m.parameters())
          for _, m in zero.layer_units(build_model(odd_cfg))]
print("layer sizes:", layers, "-> padded to a multiple of 4:", [-(-u // N) * N for u in layers])
odd_formula = tm.model_state_bytes(sum(layers), mixed_precision=False, zero_stage=3,
                                   world_size=N)
print(pd.DataFrame({"measured": {c: odd["memory"][0][c] for c in zw.STATE_CATEGORIES},
                    "formula (unpadded Ψ)": {c: odd_formula[c] for c in zw.STATE_CATEGORIES}}))
"""),
    code(r"""
# NBVAL_CHECK_OUTPUT
def padded_layout_bytes(unit_numels, n, stage, w=4, k=8):
    # what the flat layout holds: full buffers padded to a multiple of n, shards padded / n
    padded = sum(-(-u // n) * n for u in unit_numels)
    return dict(params=w * (padded // n if stage == 3 else padded),
                grads=w * (padded // n if stage >= 2 else padded), optimizer=k * padded // n)


gpt_layers = [sum(p.numel() for p in m.parameters()) for _, m in zero.layer_units(build_model(cfg))]
for stage in zero.STAGES:
    mem = runs[f"ZeRO-{stage}"]["memory"]
    exact = padded_layout_bytes(gpt_layers, N, stage)
    print(f"ZeRO-{stage}: every rank's params/grads/optimizer bytes equal the padded layout:",
          all(mem[r][c] == exact[c] for r in range(N) for c in zw.STATE_CATEGORIES))
exact = padded_layout_bytes(layers, N, 3)
print("odd MLP, ZeRO-3: equal to the padded layout:",
      all(odd["memory"][0][c] == exact[c] for c in zw.STATE_CATEGORIES))
print("padding elements in the odd MLP:", odd["config"]["padded_param_count"] - sum(layers),
      "=", [-u % N for u in layers])
print("tiny GPT padding elements:", runs["ZeRO-3"]["config"]["padded_param_count"] - psi)
"""),
    md(r"""
Four padding elements on 4,480 parameters: the measured stage-3 bytes are 0.09% above Ψ/N
(1,121 elements per rank instead of 1,120). For a
real model the remainder is under N elements per layer against millions per layer: invisible.

## Communication per step: the comm log against 2Ψ and 3Ψ

Every collective goes through `ctx.comm` and is logged with its payload; the wire bytes are the
ring algorithm's (N−1)/N per all-gather or reduce-scatter and 2(N−1)/N per all-reduce.
"""),
    code(r"""
def wire_per_step(report):
    return sum(row["wire_bytes_per_rank"] for row in report["comm"]) / report["steps"]


comm_rows, table = {}, []
dp_formula = 2 * (N - 1) / N * psi * 4        # ring all-reduce of 4Ψ bytes of fp32 gradients
for stage, (label, r) in enumerate(runs.items()):
    formula = dp_formula if stage == 0 else zero.formula_wire_bytes(psi, N, stage, 4)
    comm_rows[label] = dict(measured=wire_per_step(r), formula=formula)
    ops = ", ".join(f"{row['calls'] // cfg.steps} {row['op']}" for row in r["comm"])
    table.append(dict(run=label, collectives_per_step=ops, wire_bytes=wire_per_step(r),
                      formula=formula, vs_DP=wire_per_step(r) / wire_per_step(runs["baseline DP"])))
fig = zw.comm_per_step_figure(comm_rows, title=f"tiny GPT, fp32, {N} ranks: bytes sent per rank "
                              "and step")
plt.show()
pd.DataFrame(table).set_index("run")
"""),
    code(r"""
# NBVAL_CHECK_OUTPUT
dp_bytes = wire_per_step(runs["baseline DP"])
for label in ("ZeRO-1", "ZeRO-2", "ZeRO-3"):
    r = runs[label]
    logged = sum(row["wire_bytes_per_rank"] for row in r["comm"])
    print(f"{label}: bytes / DP's = {wire_per_step(r) / dp_bytes:.3f}; log equals the per-layer "
          f"plan: {logged == r['predicted_comm_bytes_per_rank']}")
"""),
    md(r"""
Stages 1 and 2 move exactly DP's bytes (a ring all-reduce *is* a reduce-scatter followed by an
all-gather: ZeRO just does the optimizer step in between, on the shard). Stage 3 moves 1.5×:
the extra Ψ is the second gather of every layer before its backward. Here it costs 3 MB per
step; on a real model the price is paid only if the gathers cannot hide behind compute, which
is what the prefetch is for.

## The peak over a step, not only the steady state

The table above is what a rank holds *between* steps. During a step there is more: activations
build up in forward and drain in backward; stage 2 holds each layer's full gradient in a
transient bucket until its reduce-scatter lands; stage 3 holds the layer it is computing
*gathered* and the next one already arriving (prefetch). The tracker samples memory whenever a
buffer comes or goes (rank 0, the last step):
"""),
    code(r"""
fig = zw.step_memory_compare({name: runs[name]["step_memory"][0] for name in ("ZeRO-2", "ZeRO-3")},
                             unit="KB")
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
"""),
    code(r"""
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
"""),
    md(r"""
In stage 3 rank 0 keeps only its 119 KB shard of the weights, but while block 0 computes, its
full weights (49,984 parameters, 200 KB in fp32) and block 1's incoming prefetch (another
200 KB) are there as well: the brown bumps in forward. The modelled `buffers` (the two largest
layers, 400 KB) count exactly these. In backward the measured buffers go higher, 633 KB: the
gathered block and the prefetched one, plus the gradient bucket of the block just finished
while its reduce-scatter is in flight. That moment, with the activations not yet freed, is the
measured peak. A real ZeRO-3 budgets for "a few full layers" on top of Ψ/N for the same reason.

In stage 2 the bumps are the gradient buckets in backward and, after the optimizer step, the
receive buffers of the all-gathers of the updated weights: labkit issues every layer's gather at
once, so for a moment they add up to a full fp32 copy of the weights (474 KB). An
implementation short of memory gathers in buckets, or straight into the weight buffer.

## Real models: the paper's 7.5B on 64 GPUs

The same formulas for a 7.5B-parameter model, mixed-precision Adam, 64 GPUs, against the 32 GB
of the V100s the paper used:
"""),
    code(r"""
# NBVAL_CHECK_OUTPUT
paper = tm.zero_stage_table(7.5e9, 64, mixed_precision=True)
print("GB per GPU of model states, 7.5B params, 64 GPUs, mixed-precision Adam (K = 12):")
print((paper[["params", "grads", "optimizer", "total"]] / 1e9).round(2).to_string())
"""),
    code(r"""
fig = memory_stack(zw.stage_bars(7.5e9, 64), capacity={"32 GB (V100)": 32e9}, unit="GB",
                   title="7.5B params on 64 GPUs, mixed-precision Adam: model states per GPU "
                   "(modelled)")
plt.show()
"""),
    md(r"""
120 GB → 31.4 → 16.6 → 1.9 GB: the paper's Figure 1. Without ZeRO the model states alone are
almost four times a 32 GB GPU; stage 1 gets them just under it (with no room for activations),
stage 2 leaves half the GPU free, stage 3 leaves nearly all of it.

## Explore: which stages fit?

Pick a model from the catalog, a GPU and the number of data-parallel GPUs. The bars are model
states only (activations come on top), modelled by `labkit.theory.memory`. Try Llama 3 8B on
8 H100s (128 GB per GPU in DP; every ZeRO stage fits), then Llama 3 70B: nothing fits on 8,
stage 3 from 16 GPUs on, and stages 1 and 2 never, whatever N (their replicated bf16 weights,
141 GB, are larger than the GPU). Llama 3.1 405B needs 128 GPUs even with stage 3.
"""),
    code(r"""
zw.zero_explorer()
"""),
    md(r"""
## The source article's "tenfold"

The source article says of ZeRO that "the authors demonstrated tenfold increases in training
efficiency over state-of-the-art methods". What the paper reports: its implementation (stages
1 and 2, "ZeRO-100B") trained models of over 100B parameters on 400 GPUs, with "an 8x increase
in model size and 10x increase in achievable performance over state-of-the-art", the baseline
being Megatron-LM model parallelism. So the claim holds in the sense the paper measured:
throughput for 100B-parameter models on that cluster. It is not a tenfold gain in general:
at sizes that already fit with plain data parallelism, ZeRO-1/2 send the same bytes as DP
(measured above) and do not make a step faster (at best the freed memory allows a larger batch
per GPU); the speed-up comes from *not* having to split a large model across nodes with
tensor parallelism, whose communication on the critical path is slow over InfiniBand
(lesson 03).

What the memory saving buys is easier to state: the largest model whose states fit. Per GPU,
mixed-precision Adam needs 16 bytes per parameter in DP, 4 + 12/N in stage 1, 2 + 14/N in
stage 2, 16/N in stage 3:
"""),
    code(r"""
# NBVAL_CHECK_OUTPUT
h100 = hardware.gpu("H100 SXM")
counts = (1, 8, 64, 1024)
largest = pd.DataFrame({f"{n} GPUs": [tm.largest_trainable_params(h100, n, s) / 1e9
                                      for s in range(4)] for n in counts},
                       index=zw.STAGE_LABELS)
print("largest model (billions of parameters) whose states fit in an 80 GB H100:")
print(largest.round(1).to_string())
print("stage 2 / DP as N grows:", round(tm.largest_trainable_params(h100, 10**6, 2)
                                       / tm.largest_trainable_params(h100, 1, 0), 2))
"""),
    code(r"""
fig = zw.largest_model_figure("H100 SXM", gpu_counts=(1, 4, 16, 64, 256, 1024))
plt.show()
"""),
    md(r"""
DP stays at 5B parameters however many GPUs are added. Stages 1 and 2 approach a limit of 4× and
8× that (the replicated 4 or 2 bytes per parameter remain): 19.1B and 36.1B at 64 GPUs. The
paper's "8x increase in model size" is the same factor as this stage-2 ceiling, 16/2 (its
implementation sharded the optimizer state and gradients, not yet the weights). Only stage 3
grows with N without limit: 320B on 64 H100s, 5.1T on 1,024, before activations. So "tenfold"
is the right order for the paper's throughput measurement at 100B parameters; for the memory
it is too little for stage 3 at scale and too much for stage 1.

## Offload: the optimizer state in host memory

ZeRO-Offload (Ren et al. 2021) keeps the fp32 master weights and Adam moments in CPU memory
and runs the optimizer step there. The GPU then holds only the bf16 weights and its gradient
shard; each step pays two PCIe copies: the gradient shard down and the updated weight shard
back. One stage-2 run in mixed precision (K = 12) with `offload=True`:
"""),
    code(r"""
off = zero.report(N, cfg, stage=2, mixed_precision=True, offload=True)
mem = off["memory"][0]
print(f"on the device (rank 0): params {mem['params']:,} B = 2Ψ, grads {mem['grads']:,} B = 2Ψ/N,"
      f" optimizer {mem['optimizer']:,} B")
print(f"in host memory: {off['offloaded_bytes']:,} B = 12Ψ/N = {12 * psi // N:,}")
print(f"max |param - mixed-precision reference| {off['max_param_diff_vs_reference']:.1e} "
      "(bf16 rounding of the gradient average)")
print("losses", [round(x, 3) for x in off["loss"]], "reference",
      [round(x, 3) for x in off["reference_loss"]])
pcie = [e for e in off["timeline"] if e["rank"] == 0 and e["name"].startswith("offload")]
pcie_s = sum(e["end"] - e["start"] for e in pcie) / cfg.steps
print(f"modelled PCIe copies per step: {pcie_s * 1e6:.1f} µs of a "
      f"{off['modelled_step_s'] * 1e6:.1f} µs step (modelled, 8xH100 node)")
"""),
    code(r"""
# NBVAL_CHECK_OUTPUT
print("optimizer bytes on the device:", off["memory"][0]["optimizer"])
print("host bytes = 12 x padded Ψ / N:", off["offloaded_bytes"] == 12 * psi // N)
print("PCIe copies on the timeline per rank:", len(pcie))
"""),
    code(r"""
fig = zw.offload_gantt(off["timeline"], ranks=(0, 1),
                       title="ZeRO-2 + offload, ranks 0 and 1 of 4, 2 steps, modelled 8xH100 node")
plt.show()
"""),
    md(r"""
The two PCIe copies (pink, on the compute lane: the step waits for them) sit between backward's
reduce-scatters and the all-gathers of the updated weights; the host's optimizer step between
them is not timed by the model (its FLOPs are elementwise and uncounted). On this tiny model
every transfer is mostly latency, so the collectives of 6 layers take most of the modelled
step and forward and backward are slivers. On a real model the copies are 2Ψ/N bytes each way
per step over PCIe and the CPU's Adam step adds to them: the price of training a model whose
optimizer state would not fit on the GPUs.

The loss matches the mixed-precision single-device reference within bf16's resolution (bf16
numbers between 4 and 8 are 0.03 apart, and the 4 shard losses are rounded separately); the
parameters differ by ~1e-2, about one learning rate: Adam divides by √v, so a bf16 rounding
difference in a small gradient becomes a step of up to ~lr. (The tests check the same algorithm
with SGD, where the difference stays below 1e-3, and that offload changes nothing bit for bit
against the same run without it.)

## Exercise: stage 2 for Llama 3 8B on 8 GPUs

How many bytes of model states does each GPU hold when Llama 3 8B (8.03B parameters) is trained
with mixed-precision Adam and ZeRO stage 2 on 8 GPUs? Replace `None` with your answer in bytes
(a number or an expression). The checker says what is wrong, if anything.
"""),
    code(r"""
llama_params = 8.03e9
my_answer = None   # TODO: bytes per GPU for ZeRO stage 2, N = 8

zw.check_stage_memory_answer(my_answer, params=llama_params, world_size=8, stage=2);
"""),
    md(r"""
## Takeaways

- Data parallelism keeps N copies of (2 + 2 + K)Ψ bytes of model states. ZeRO keeps one,
  spread: stage 1 shards the optimizer state, stage 2 the gradients as well, stage 3 the
  weights too. Measured here byte for byte: 1.90 → 1.19 → 0.83 → 0.47 MB per rank on 4 ranks,
  equal to the formula up to padding of fewer than N elements per layer.
- Stages 1 and 2 cost nothing extra on the wire: reduce-scatter + all-gather is what DP's
  all-reduce is made of (measured: 1.00× DP). Stage 3 re-gathers every layer for backward:
  1.5× DP.
- The steady state is not the peak: stage 3 holds one gathered layer and one prefetched layer
  while it computes, stage 2 a few gradient buckets, and the activations come on top of it all.
- The paper's 7.5B-parameter model on 64 GPUs: 120 → 31.4 → 16.6 → 1.9 GB per GPU. Stages 1
  and 2 raise the largest trainable model by at most 4× and 8×; only stage 3 grows with N.
- The source article's "tenfold" is the paper's throughput result for 100B-parameter models
  against Megatron-LM, not a general speed-up: below that scale ZeRO-1/2 move the same bytes
  as DP.
"""),
]


if __name__ == "__main__":
    write_and_execute(CELLS, "04_zero.ipynb")

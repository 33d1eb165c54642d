"""Build notebooks/04_zero.ipynb from the cells below, then execute it in place.

Run from anywhere: `.venv/bin/python notebooks/make/04_zero.py`. Edit the lesson here, not in
the .ipynb: the notebook is regenerated (with its outputs) from this list.
"""
from nbmake import code, md, write_and_execute

CELLS = [
    md(r"""
# 04 · ZeRO: stop keeping N copies of everything

**The idea.** Data parallelism keeps a full copy of the *model states* on every GPU: weights,
gradients and optimizer state. With mixed-precision Adam that is 2Ψ (bf16 weights) + 2Ψ (bf16
gradients) + KΨ optimizer state (K = 12: fp32 master weights, momentum and variance) bytes
for Ψ parameters — on each of N GPUs. ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054)
removes the redundancy step by step, each rank keeping only its 1/N shard:

| | per GPU | communication per step |
|---|---|---|
| baseline DP | (2 + 2 + K)Ψ | all-reduce of the gradients ≈ 2Ψ elements |
| stage 1: optimizer state sharded | 2Ψ + 2Ψ + KΨ/N | reduce-scatter grads + all-gather params ≈ 2Ψ |
| stage 2: + gradients sharded | 2Ψ + (2 + K)Ψ/N | the same ≈ 2Ψ |
| stage 3: + parameters sharded | (2 + 2 + K)Ψ/N | + one more all-gather of the params in backward ≈ 3Ψ |

Stages 1 and 2 are free in communication; stage 3 costs 1.5× data parallelism's volume. In
fp32 (what the CPU run below uses) the same table reads 4Ψ + 4Ψ + 8Ψ.
"""),
    code(r"""
import matplotlib.pyplot as plt
import pandas as pd
import labkit
from labkit import data_parallel, zero
from labkit.reference import RunConfig
from labkit.theory import memory as tm
from labkit.viz import plots, zero_widgets
"""),
    md(r"""
## Run it: stages 1, 2, 3 on four ranks, checked against one device

Each run trains the tiny GPT for two steps on 4 CPU ranks and compares the final (gathered)
parameters with the single-device reference. We use plain SGD here so that the comparison is
exact to float32 rounding (see `labkit.reference.build_optimizer` for why Adam amplifies
rounding noise in gradients that are truly zero). The baseline is plain data parallelism.
"""),
    code(r"""
cfg = RunConfig(steps=2, optimizer="sgd", lr=0.05)
N = 4
reports = {"baseline DP": data_parallel.report(world_size=N, cfg=cfg)}
for stage in (1, 2, 3):
    reports[f"ZeRO-{stage}"] = zero.report(world_size=N, cfg=cfg, stage=stage)
for label, rep in reports.items():
    print(f"{label:12} loss {rep['loss'][-1]:.5f} (reference {rep['reference_loss'][-1]:.5f})"
          f"  max |param - reference| = {rep['max_param_diff_vs_reference']:.1e}")
"""),
    md(r"""
## Measure it: bytes per rank, measured beside the formula

The memory tracker counts the tensors each rank really holds (its flat shards, its gradient
shard, its optimizer shard). The predicted bars are `zero.predict_memory` (the ZeRO formulas
on the padded layout). With SGD there is no optimizer state, so watch the parameters and
gradients shrink instead; the Adam columns follow in the table after.
"""),
    code(r"""
fig = plots.memory_stack(zero_widgets.measured_beside_predicted(reports), unit="MB",
                         title=f"tiny GPT, {N} ranks, fp32 SGD: bytes on rank 0")
fig.set_size_inches(11, 4.5)
plt.show()
rows = []
for label, rep in reports.items():
    measured, predicted = rep["memory"][0], rep["predicted_memory"]
    for c in ("params", "grads", "optimizer"):
        rows.append(dict(run=label, category=c, measured=measured[c], predicted=predicted[c],
                         ratio=measured[c] / predicted[c] if predicted[c] else float("nan")))
pd.DataFrame(rows).pivot(index="run", columns="category", values="ratio").round(3)
"""),
    code(r"""
# NBVAL_CHECK_OUTPUT
for label, rep in reports.items():
    m, p = rep["memory"][0], rep["predicted_memory"]
    print(label, all(m[c] == p[c] for c in ("params", "grads", "optimizer")))
"""),
    md(r"""
The tiny GPT's layers divide evenly by 4, so there is no padding and measured equals
predicted to the byte. With a layer of, say, 2210 parameters on 4 ranks, the flat buffer is
padded to 2212 so every shard is equal: a remainder of at most N-1 elements per layer.

The same with Adam, where the optimizer state (8Ψ in fp32) is what stage 1 shards:
"""),
    code(r"""
adam = RunConfig(steps=1, optimizer="adam")
adam_reports = {f"ZeRO-{s}": zero.report(world_size=N, cfg=adam, stage=s) for s in (1, 2, 3)}
psi = adam_reports["ZeRO-1"]["config"]["param_count"]
table = tm.zero_stage_table(psi, N, mixed_precision=False)
pd.DataFrame({label: {c: rep["memory"][0][c] for c in ("params", "grads", "optimizer")}
              for label, rep in adam_reports.items()}).T.assign(
    formula_total=[table.loc[f"stage {s}", "total"] for s in (1, 2, 3)])
"""),
    md(r"""
## Communication per step, from the comm log

Bytes each rank sends on the wire (ring algorithm) over the run, against the plan from the
formulas. Stages 1 and 2 move what data parallelism moves; stage 3 half as much again.
"""),
    code(r"""
rows = []
for label, rep in reports.items():
    wire = sum(r["wire_bytes_per_rank"] for r in rep["comm"])
    rows.append(dict(run=label, wire_bytes_per_rank=wire,
                     predicted=rep["predicted_comm_bytes_per_rank"]))
comm = pd.DataFrame(rows).set_index("run")
comm["ratio_to_DP"] = comm["wire_bytes_per_rank"] / comm.loc["baseline DP", "wire_bytes_per_rank"]
comm["measured / predicted"] = comm["wire_bytes_per_rank"] / comm["predicted"]
comm.round(3)
"""),
    md(r"""
## The peak over a step

Stage 3 gathers each layer's full weights just before they are used (and prefetches the next
layer), then frees them. Those transient buffers are real memory: the measured curve of one
step shows them as bumps above the steady state.
"""),
    code(r"""
fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), sharey=True)
for ax, label in zip(axes, ("ZeRO-2", "ZeRO-3")):
    zero_widgets.step_memory_figure(reports[label]["step_memory"][0], ax=ax, unit="MB",
                                    title=f"{label}: memory over one step (measured, rank 0)")
plt.show()
"""),
    md(r"""
## Real models: the ZeRO paper's example, and which stages fit

The paper's Figure 1: a 7.5B-parameter model with mixed-precision Adam on 64 GPUs.
"""),
    code(r"""
example = tm.zero_stage_table(7.5e9, 64) / 1e9
example.round(2)[["params", "grads", "optimizer", "total"]]
"""),
    code(r"""
zero_widgets.zero_explorer()
"""),
    md(r"""
## The source article's claim, in context

The source article says the ZeRO authors "demonstrated tenfold increases in training
efficiency over state-of-the-art methods". The paper reports up to about 10× higher
throughput for 100B-parameter models against its Megatron-LM baseline — a speed-up that comes
from being able to use data parallelism (and bigger batches) where the baseline had to split
the model across nodes. What the memory model here shows directly is the other half: how
large a model's states fit at all, per GPU count and stage (activations ignored):
"""),
    code(r"""
zero_widgets.largest_model_figure(gpu="A100 SXM 40GB")
plt.show()
for n in (1, 64, 1024):
    sizes = [tm.largest_trainable_params(40e9, n, s) / 1e9 for s in range(4)]
    print(f"{n:5d} x A100 40 GB: " + ", ".join(f"{lab} {v:,.1f}B" for lab, v in
                                                zip(zero_widgets.STAGE_LABELS, sizes)))
"""),
    md(r"""
So the "tenfold" is a throughput result measured at one scale; the memory saving itself
grows with N (stage 3 scales the trainable size linearly in the GPU count), while the
communication cost of stage 3 is a fixed 1.5×.

## Offload: optimizer state on the host

ZeRO-Offload keeps the optimizer state in CPU memory; each step sends the gradient shard down
and the updated parameters back over PCIe. The device then holds no optimizer state, and the
modelled timeline gains two PCIe copies per step (the long bars on the compute lane).
"""),
    code(r"""
off = zero.report(world_size=2, cfg=RunConfig(steps=1), stage=2, offload=True)
print("optimizer bytes on the device:", off["memory"][0]["optimizer"],
      "| held on the host:", off["offloaded_bytes"])
plots.gantt([e for e in off["timeline"] if e["rank"] == 0], clock="modelled",
            title="ZeRO-2 with offload, rank 0")
plt.show()
"""),
    md(r"""
## Exercise

Llama 3 8B, mixed-precision Adam, ZeRO stage 2 on 8 GPUs: how many GB of model states does
each GPU hold? Fill in `answer_gb` (the formula is in the table at the top).
"""),
    code(r"""
answer_gb = None   # your answer, in GB (1e9 bytes)

from labkit.theory import catalog
psi_8b = catalog.model("llama-3-8b").param_count()
truth = tm.model_state_bytes(psi_8b, zero_stage=2, world_size=8)["total"] / 1e9
if answer_gb is None:
    print("Hint: 2Ψ for the bf16 weights stays whole; gradients (2Ψ) and optimizer (12Ψ) "
          "are divided by N.")
elif abs(answer_gb - truth) / truth < 0.05:
    print(f"Right: {truth:.1f} GB.")
else:
    print(f"Not quite: {answer_gb} GB. Check which terms are divided by N.")
"""),
    md(r"""
## Takeaway

- Data parallelism wastes memory: every GPU holds the same (2 + 2 + K)Ψ bytes.
- ZeRO-1 and ZeRO-2 shard the optimizer state and gradients at no extra communication;
  ZeRO-3 shards the weights too for 1.5× the traffic, and gathered layers appear in the peak.
- Measured bytes per rank match the paper's formulas exactly on the tiny model; the
  parameters after training match a single device.
- The memory saving grows with the number of GPUs; the paper's "10×" is a throughput figure
  at 100B scale, not a constant.
"""),
]

if __name__ == "__main__":
    write_and_execute(CELLS, "04_zero.ipynb")

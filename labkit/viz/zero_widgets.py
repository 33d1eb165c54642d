"""Figures and the explorer of the ZeRO lesson (04): memory per rank by stage, measured beside
modelled; which stages let a real model fit on N GPUs; memory over one step; the largest
trainable model per GPU count. Everything modelled comes from `labkit.theory.memory`.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..theory import catalog, hardware
from ..theory import memory as tm
from .plots import MEMORY_COLORS, MEMORY_LABELS, UNITS, fmt, memory_stack

STAGE_LABELS = ["baseline DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
STATE_CATEGORIES = ("params", "grads", "optimizer")
STEP_CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


def stage_bars(params, world_size, mixed_precision=True, optimizer="adam"):
    """{stage label: {params, grads, optimizer}} bytes per rank (theory.memory.zero_stage_table)."""
    table = tm.zero_stage_table(params, world_size, mixed_precision=mixed_precision,
                                optimizer=optimizer)
    return {label: {c: float(table.iloc[i][c]) for c in STATE_CATEGORIES}
            for i, label in enumerate(STAGE_LABELS)}


def measured_beside_predicted(reports, keys=STATE_CATEGORIES + ("activations",)):
    """Bars for memory_stack from run reports ({label: report}): measured (rank 0) and
    modelled side by side for each label."""
    bars = {}
    for label, rep in reports.items():
        measured = rep["memory"][0] if 0 in rep["memory"] else rep["memory"]["0"]
        bars[f"{label}\nmeasured"] = {k: measured[k] for k in keys}
        bars[f"{label}\nmodelled"] = {k: rep["predicted_memory"][k] for k in keys}
    return bars


def zero_fit_figure(model, gpus, gpu="H100 SXM", mixed_precision=True, ax=None):
    """Model-state bytes per GPU for baseline and ZeRO 1-3 against one GPU's capacity.

    Activations and buffers are left out (they come on top); the summary line in
    `fig.labkit_summary` says which stages fit.
    """
    m = catalog.model(model)
    g = hardware.gpu(gpu)
    bars = stage_bars(m.param_count(), gpus, mixed_precision)
    totals = {k: sum(v.values()) for k, v in bars.items()}
    unit = "TB" if max(totals.values()) >= 10e12 else "GB"
    fits = [k for k, t in totals.items() if t <= g.memory_bytes]
    title = (f"{m.display_name} on {gpus} x {g.name}: model states per GPU (modelled, "
             f"{'bf16 mixed' if mixed_precision else 'fp32'} Adam)")
    fig = memory_stack(bars, capacity={f"{g.name} {fmt(g.memory_bytes / 1e9)} GB":
                                       g.memory_bytes}, title=title, unit=unit, ax=ax)
    verdict = ", ".join(fits) if fits else "none"
    fig.labkit_summary = (f"{m.display_name}, {m.param_count() / 1e9:.1f}B params on {gpus} GPUs:"
                          f" model states fit in {fmt(g.memory_bytes / 1e9)} GB for "
                          f"<b>{verdict}</b> (before activations)")
    return fig


def zero_explorer():
    """Model (catalog), GPU kind, number of GPUs, precision -> bars and which stages fit."""
    import ipywidgets as widgets

    from .widgets import explorer
    names = [mm.display_name for mm in catalog.models()]
    controls = dict(
        model=widgets.Dropdown(options=names, value="Llama 3 70B" if "Llama 3 70B" in names
                               else names[0], description="model"),
        gpu=widgets.Dropdown(options=[g.name for g in hardware.gpus()], value="H100 SXM",
                             description="GPU"),
        gpus=widgets.SelectionSlider(options=[2 ** k for k in range(0, 11)], value=8,
                                     description="GPUs"),
        precision=widgets.Dropdown(options=["bf16 mixed", "fp32"], value="bf16 mixed",
                                   description="precision"),
    )

    def draw(ax, model, gpu, gpus, precision):
        fig = zero_fit_figure(model, gpus, gpu, precision == "bf16 mixed", ax=ax)
        return fig.labkit_summary

    return explorer(controls, draw, figsize=(9, 4.6))


def step_memory_figure(step_memory, ax=None, title="", unit="MB"):
    """Bytes by category at each sample point of one step (a rank's `step_memory`), stacked.

    Samples are taken at phase boundaries and whenever a buffer (gathered layer, prefetch,
    gradient bucket) appears or goes, so stage 3's transient buffers show as bumps.
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=(10, 4))
    fig = ax.figure
    scale = UNITS[unit]
    xs = list(range(len(step_memory)))
    ys = [[snap.get(c, 0) / scale for _, snap in step_memory] for c in STEP_CATEGORIES]
    ax.stackplot(xs, ys, labels=[MEMORY_LABELS.get(c, c) for c in STEP_CATEGORIES],
                 colors=[MEMORY_COLORS[c] for c in STEP_CATEGORIES], step="post", alpha=0.9)
    totals = [sum(col) for col in zip(*ys)]
    peak = max(range(len(totals)), key=totals.__getitem__)
    ax.annotate(f"peak {fmt(totals[peak])} {unit}\n({step_memory[peak][0]})",
                (peak, totals[peak]), xytext=(10, 0), textcoords="offset points", fontsize=8,
                va="bottom")
    marks = [i for i, (phase, _) in enumerate(step_memory)
             if phase in ("after forward", "after backward") or phase.startswith("after step")]
    for i in marks:
        ax.axvline(i, color="0.3", linestyle=":", linewidth=1)
        ax.text(i, max(totals) * 1.02, step_memory[i][0], fontsize=7, ha="center")
    ax.set_xlim(0, max(1, len(xs) - 1))
    ax.set_ylim(0, max(totals) * 1.15)
    ax.set_xlabel("sample point within one step (measured; phase boundaries dotted)")
    ax.set_ylabel(f"bytes on rank 0 ({unit})")
    ax.set_title(title or "memory over one step (measured)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def largest_model_figure(gpu="A100 SXM 40GB", gpu_counts=(1, 4, 16, 64, 256, 1024), ax=None):
    """Largest Ψ whose mixed-precision Adam model states fit, per GPU count and stage
    (theory.memory.largest_trainable_params, ZeRO paper Table 1; activations ignored)."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
    fig = ax.figure
    g = hardware.gpu(gpu)
    for stage, label in enumerate(STAGE_LABELS):
        values = [tm.largest_trainable_params(g, n, stage) / 1e9 for n in gpu_counts]
        ax.plot(gpu_counts, values, marker="osD^"[stage], label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(gpu_counts, [str(n) for n in gpu_counts])
    ax.minorticks_off()
    ax.set_xlabel("data-parallel GPUs (log2 scale)")
    ax.set_ylabel("largest model (billions of params, log)")
    ax.set_title(f"model states that fit in {fmt(g.memory_bytes / 1e9)} GB {g.name} (modelled)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig

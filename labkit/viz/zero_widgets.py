"""Figures and the explorer of the ZeRO lesson (04): memory per rank by stage, measured beside
modelled; which stages let a real model fit on N GPUs; memory over one step; the largest
trainable model per GPU count. Everything modelled comes from `labkit.theory.memory`.
Also: comm per step beside the formula and the offload timeline. (The exercise's checker is
`labkit.exercises.zero`.)
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..theory import catalog, hardware
from ..theory import memory as tm
from .live import Drawing
from .plots import (MEMORY_COLORS, MEMORY_LABELS, TIME_UNITS, UNITS, fmt, memory_stack,
                    pick_time_unit, restack, stack_shape)
from .timeline import gantt

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


def _zero_view(model, gpus, gpu="H100 SXM", mixed_precision=True):
    """memory_stack's arguments for zero_fit_figure, and its summary line."""
    m = catalog.model(model)
    g = hardware.gpu(gpu)
    bars = stage_bars(m.param_count(), gpus, mixed_precision)
    totals = {k: sum(v.values()) for k, v in bars.items()}
    unit = "TB" if max(totals.values()) >= 10e12 else "GB"
    fits = [k for k, t in totals.items() if t <= g.memory_bytes]
    title = (f"{m.display_name} on {gpus} x {g.name}: model states per GPU (modelled, "
             f"{'bf16 mixed' if mixed_precision else 'fp32'} Adam)")
    verdict = ", ".join(fits) if fits else "none"
    summary = (f"{m.display_name}, {m.param_count() / 1e9:.1f}B params on {gpus} GPUs:"
               f" model states fit in {fmt(g.memory_bytes / 1e9)} GB for "
               f"<b>{verdict}</b> (before activations)")
    capacity = {f"{g.name} {fmt(g.memory_bytes / 1e9)} GB": g.memory_bytes}
    return dict(bars=bars, capacity=capacity, title=title, unit=unit), summary


def zero_fit_figure(model, gpus, gpu="H100 SXM", mixed_precision=True, ax=None):
    """Model-state bytes per GPU for baseline and ZeRO 1-3 against one GPU's capacity.

    Activations and buffers are left out (they come on top); the summary line in
    `fig.labkit_summary` says which stages fit.
    """
    stack, summary = _zero_view(model, gpus, gpu, mixed_precision)
    fig = memory_stack(ax=ax, **stack)
    fig.labkit_summary = summary
    return fig


class ZeroDrawing(Drawing):
    """zero_fit_figure in place: another GPU count or model moves the bars."""

    def shape(self, model, gpu, gpus, precision):
        self.view = _zero_view(model, gpus, gpu, precision == "bf16 mixed")
        stack = self.view[0]
        return stack_shape(stack["bars"], stack["capacity"], stack["unit"])

    def build(self, fig, **values):
        memory_stack(ax=fig.add_subplot(), **self.view[0])

    def update(self, fig, **values):
        restack(fig.axes[0], **self.view[0])
        return self.view[1]


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
    return explorer(controls, ZeroDrawing(), figsize=(9, 4.6))


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
    last, width = None, max(1, len(xs) - 1)
    level = 0
    for i in marks:   # phase names above the stack; close neighbours on a second line
        ax.axvline(i, color="0.3", linestyle=":", linewidth=1)
        level = 1 - level if last is not None and i - last < 0.12 * width else 0
        ha = "left" if i < 0.05 * width else "right" if i > 0.95 * width else "center"
        ax.text(i, max(totals) * (1.03 + 0.07 * level), step_memory[i][0], fontsize=7, ha=ha)
        last = i
    ax.set_xlim(0, width)
    ax.set_ylim(0, max(totals) * 1.2)
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


def step_memory_compare(step_memories, unit="MB", title=""):
    """One `step_memory_figure` panel per entry of {label: step_memory}, stacked vertically
    with a shared y range, so that stage 3's transient buffers compare at a glance."""
    fig, axes = plt.subplots(len(step_memories), 1, figsize=(10, 3.3 * len(step_memories)))
    axes = [axes] if len(step_memories) == 1 else list(axes)
    for k, (ax, (label, samples)) in enumerate(zip(axes, step_memories.items())):
        step_memory_figure(samples, ax=ax, title=label, unit=unit)
        if k:   # one legend is enough
            ax.get_legend().remove()
    top = max(ax.get_ylim()[1] for ax in axes)
    for ax in axes:
        ax.set_ylim(0, top)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def comm_per_step_figure(rows, ax=None, title="", unit="MB"):
    """Wire bytes per rank and step: measured (comm log) beside the formula, per run.

    `rows` is {label: {"measured": bytes, "formula": bytes}}; the ratio to the first row
    (baseline DP) is written above each measured bar.
    """
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
    fig = ax.figure
    scale = UNITS[unit]
    labels = list(rows)
    x = range(len(labels))
    measured = [rows[k]["measured"] / scale for k in labels]
    formula = [rows[k]["formula"] / scale for k in labels]
    ax.bar([i - 0.2 for i in x], measured, 0.4, color="#9467bd",
           label="measured: wire bytes from the comm log")
    ax.bar([i + 0.2 for i in x], formula, 0.4, color="#c5b0d5", hatch="//", edgecolor="white",
           label="formula: (N-1)/N x {2, 3} x Ψ x bytes")
    for i, m in enumerate(measured):
        ax.text(i - 0.2, m, f"{m / measured[0]:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel(f"bytes sent per rank per step ({unit})")
    ax.set_ylim(0, max(measured + formula) * 1.2)
    ax.set_title(title or "communication per step and rank")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


PCIE_COLOR = "#e377c2"


def offload_gantt(timeline, ranks=(0, 1), title=""):
    """`timeline.gantt` of some ranks (modelled clock) with ZeRO-Offload's PCIe copies (events named
    'offload: ...') drawn over in their own colour, so they stand out from the collectives."""
    events = [e for e in timeline if int(e["rank"]) in ranks]
    fig = gantt(events, clock="modelled", title=title)
    ax = fig.axes[0]
    order = sorted({int(e["rank"]) for e in events})
    t_max = max(float(e["end"]) for e in events)
    unit = pick_time_unit(t_max)
    scale = TIME_UNITS[unit]
    for e in events:
        if str(e["name"]).startswith("offload"):
            ax.barh(-order.index(int(e["rank"])), (e["end"] - e["start"]) / scale,
                    left=e["start"] / scale, height=0.5, color=PCIE_COLOR, edgecolor="black",
                    linewidth=0.6)
    legend = ax.get_legend()
    handles = list(legend.legend_handles) + [Patch(color=PCIE_COLOR,
                                                   label="PCIe copy (offload, modelled)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    fig.tight_layout()
    return fig

"""Lesson 02's figures and explorer: pipeline schedules as Gantt charts, bubble, memory per stage.

The explorer simulates a schedule in pure Python (`labkit.theory.pipeline.simulate_schedule`,
the executor's timing rules; checked against real runs in tests/test_pipeline.py), so it redraws in
milliseconds. Assumed times: one stage's forward of one micro-batch takes 1 ms (modelled),
backward 2 ms (twice the FLOPs), a message 1 ms / (compute/comm ratio).
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..theory import pipeline as pp
from .plots import GANTT_COLORS, fmt, gantt

T_FORWARD = 1e-3  # modelled seconds for one stage's forward of one micro-batch (an assumption)
MANY_BARS = 300   # above this, draw the Gantt chart as one bar collection per rank and kind


def simulated_timeline(stages, microbatches, schedule="1f1b", virtual=1, ratio=float("inf")):
    """The simulated timeline of a schedule; chunks take 1/V of a stage's time each."""
    v = virtual if schedule == "interleaved" else 1
    ops = pp.make_schedule(schedule, stages, microbatches, v)
    t_comm = 0.0 if ratio == float("inf") else T_FORWARD / ratio
    return ops, pp.simulate_schedule(ops, T_FORWARD / v, 2 * T_FORWARD / v, t_comm)


def memory_per_stage(ops, virtual=1):
    """Activations each rank holds at its peak, in units of one micro-batch through one
    whole stage (a chunk is 1/V of that)."""
    return [pp.microbatches_in_flight(rank_ops) / virtual for rank_ops in ops]


def draw_pipeline(fig, stages, microbatches, schedule, virtual, ratio):
    """Gantt chart (top) and activation memory per stage (bottom) on `fig`; returns a line."""
    if schedule == "interleaved" and microbatches % stages:
        microbatches = stages * max(1, round(microbatches / stages))
        note = f" (interleaved needs M a multiple of P: M = {microbatches})"
    else:
        note = ""
    if schedule == "naive":
        microbatches = 1
    v = virtual if schedule == "interleaved" else 1
    ops, timeline = simulated_timeline(stages, microbatches, schedule, v, ratio)
    grid = fig.add_gridspec(2, 1, height_ratios=[2.2, 1])
    ax_gantt, ax_mem = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
    title = (f"{schedule}, P={stages}, M={microbatches}" + (f", V={v}" if v > 1 else "")
             + " (simulated, modelled times)")
    if len(timeline) <= MANY_BARS:
        gantt(timeline, ax=ax_gantt, title=title)
    else:
        quick_gantt(timeline, ax_gantt, title)
    _pad(ax_gantt)
    held = memory_per_stage(ops, v)
    ax_mem.bar(range(stages), held, color="#c44e52")
    ax_mem.set_xticks(range(stages), [f"rank {r}" for r in range(stages)])
    ax_mem.set_ylabel("activations held\n(micro-batch x stage)")
    ax_mem.set_title("peak activation memory per stage (from the schedule)", fontsize=10)
    for r, h in enumerate(held):
        ax_mem.text(r, h, fmt(h), ha="center", va="bottom", fontsize=8)
    ax_mem.set_ylim(0, max(held) * 1.3)
    fig.tight_layout()
    simulated = pp.timeline_bubble_fraction(timeline)
    formula = pp.bubble_formula(stages, microbatches, v)
    return (f"bubble (simulated): <b>{simulated:.3f}</b> &nbsp; formula "
            f"{pp.bubble_formula_text(schedule, v)} = {formula:.3f} (no comm time); step "
            f"{max(e['end'] for e in timeline) * 1e3:.1f} ms modelled{note}")


def quick_gantt(timeline, ax, title):
    """plots.gantt's look without per-bar labels, one broken_barh per rank and kind: fast for
    thousands of ops."""
    ranks = sorted({e["rank"] for e in timeline})
    for r in ranks:
        for key in ("forward", "backward", "idle"):
            bars = [(e["start"] * 1e3, (e["end"] - e["start"]) * 1e3) for e in timeline
                    if e["rank"] == r and (e["name"] == key if key != "idle"
                                           else e["kind"] == "idle")]
            ax.broken_barh(bars, (-r - 0.25, 0.5), facecolors=GANTT_COLORS[key],
                           edgecolor="white", linewidth=0.3, label=key if r == 0 else None)
    ax.set_yticks([-r for r in ranks], [f"rank {r}" for r in ranks])
    ax.set_xlabel("modelled time (ms)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)


def pipeline_explorer():
    """Sliders: stages, micro-batches, schedule, chunks per rank V (interleaved only),
    compute/comm ratio. V is greyed out unless the schedule is interleaved, M under naive."""
    import ipywidgets as widgets
    from .widgets import figure_explorer

    wide = dict(style={"description_width": "initial"})
    controls = dict(
        stages=widgets.IntSlider(4, 2, 8, description="stages P", **wide),
        microbatches=widgets.IntSlider(8, 1, 24, description="micro-batches M", **wide),
        schedule=widgets.Dropdown(options=list(pp.SCHEDULES), value="1f1b",
                                  description="schedule", layout=widgets.Layout(width="200px"),
                                  **wide),
        virtual=widgets.IntSlider(2, 1, 4, description="chunks per rank V", **wide),
        ratio=widgets.FloatLogSlider(value=100, base=10, min=-1, max=3,
                                     description="compute/comm ratio", **wide),
    )

    def grey_out(_change=None):
        name = controls["schedule"].value
        controls["virtual"].disabled = name != "interleaved"
        controls["microbatches"].disabled = name == "naive"

    controls["schedule"].observe(grey_out, names="value")
    grey_out()
    return figure_explorer(controls, draw_pipeline, figsize=(10, 6))


def run_gantts(timeline, title=""):
    """A real run's timeline twice: modelled clock (top) and measured wall clock (bottom).

    The wall panel starts at the first op (times shifted to 0), shows the forward and backward
    bars (a wait on the virtual clock has no wall length) and numbers every bar: inside, or
    above it in the bar's colour when it is too thin."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5))
    compute = [e for e in timeline if e["lane"] == "compute"]
    gantt(compute, ax=top, clock="modelled", title=f"{title} - modelled")
    _pad(top)
    busy = pp.pipeline_ops(compute)
    t0 = min(e["wall_start"] for e in busy)
    wall = [dict(e, wall_start=e["wall_start"] - t0, wall_end=e["wall_end"] - t0) for e in busy]
    gantt(wall, ax=bottom, clock="wall", title=f"{title} - measured")
    span = max(e["wall_end"] for e in wall)
    _pad(bottom)
    ranks = sorted({e["rank"] for e in wall})
    for e in wall:   # gantt numbers bars over 2.5% of the span; the thinner ones get it above
        width = e["wall_end"] - e["wall_start"]
        if width <= 0.025 * span:
            bottom.text(e["wall_start"] + width / 2, -ranks.index(e["rank"]) + 0.27,
                        str(e["meta"]["microbatch"]), ha="center", va="bottom", fontsize=6,
                        color=GANTT_COLORS[e["name"]])
    bottom.set_xlabel("measured wall-clock time (s) since the first op, on this machine")
    fig.tight_layout()
    return fig


def _pad(ax):
    """Room on both sides, so that the first and last bars are not cut by the frame."""
    left, right = ax.get_xlim()
    ax.set_xlim(left - 0.02 * (right - left), right + 0.02 * (right - left))


def stage0_memory_plot(rows, ax=None):
    """Measured first-stage activation bytes vs M for each schedule beside the formula.

    rows: dicts with schedule, microbatches, measured, formula (bytes)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    for i, name in enumerate(sorted({r["schedule"] for r in rows})):
        mine = sorted((r for r in rows if r["schedule"] == name), key=lambda r: r["microbatches"])
        m = [r["microbatches"] for r in mine]
        ax.plot(m, [r["measured"] / 1e3 for r in mine], "o-", color=f"C{i}",
                label=f"{name}: measured")
        ax.plot(m, [r["formula"] / 1e3 for r in mine], "x--", color=f"C{i}",
                label=f"{name}: formula (in flight x one micro-batch)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(m, [str(x) for x in m])
    ax.set_xlabel("micro-batches M (global batch fixed)")
    ax.set_ylabel("stage-0 peak activations (KB = 10³ bytes)")
    ax.set_ylim(bottom=0)
    ax.set_title("first stage: activations saved for backward at once")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.figure.tight_layout()
    return ax.figure

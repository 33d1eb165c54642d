"""Lesson 02's figures and explorer: pipeline schedules as Gantt charts, bubble, memory per stage.

The explorer simulates a schedule in pure Python (`labkit.theory.pipeline.simulate_schedule`,
the executor's timing rules; checked against real runs in tests/test_pipeline.py), so it redraws in
milliseconds. Assumed times: one stage's forward of one micro-batch takes 1 ms (modelled),
backward 2 ms (twice the FLOPs), a message 1 ms / (compute/comm ratio).
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch

from ..theory import pipeline as pp
from .live import Drawing
from .plots import TIME_UNITS, fmt, pick_time_unit
from .timeline import GANTT_COLORS, GANTT_LABELS, gantt, gantt_style

T_FORWARD = 1e-3  # modelled seconds for one stage's forward of one micro-batch (an assumption)
MANY_BARS = 300   # above this, the Gantt bars carry no micro-batch numbers, thinner edges


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


def _pipeline_numbers(stages, microbatches, schedule, virtual, ratio):
    """The simulated timeline, the activations held per rank, the title and the text line."""
    if schedule == "interleaved" and microbatches % stages:
        microbatches = stages * max(1, round(microbatches / stages))
        note = f" (interleaved needs M a multiple of P: M = {microbatches})"
    else:
        note = ""
    if schedule == "naive":
        microbatches = 1
    v = virtual if schedule == "interleaved" else 1
    ops, timeline = simulated_timeline(stages, microbatches, schedule, v, ratio)
    simulated = pp.timeline_bubble_fraction(timeline)
    formula = pp.bubble_formula(stages, microbatches, v)
    return dict(
        stages=stages, timeline=timeline, held=memory_per_stage(ops, v),
        title=(f"{schedule}, P={stages}, M={microbatches}" + (f", V={v}" if v > 1 else "")
               + " (simulated, modelled times)"),
        text=(f"bubble (simulated): <b>{simulated:.3f}</b> &nbsp; formula "
              f"{pp.bubble_formula_text(schedule, v)} = {formula:.3f} (no comm time); step "
              f"{max(e['end'] for e in timeline) * 1e3:.1f} ms modelled{note}"))


class PipelineDrawing(Drawing):
    """The Gantt chart (top) and activation memory per stage (bottom), built once and moved in
    place: the Gantt bars are one PolyCollection whose rectangles are replaced, the
    micro-batch numbers and memory bars come from pools that grow to the most ever shown
    and hide what a step does not use. The figure is built again only when the legend
    changes: which kinds of bars, and above MANY_BARS bars (no numbers, thinner edges)."""

    def shape(self, **values):
        self.d = _pipeline_numbers(**values)
        used = {gantt_style(e) for e in self.d["timeline"]}
        self.key = len(self.d["timeline"]) > MANY_BARS, tuple(k for k in GANTT_COLORS
                                                               if k in used)
        return self.key

    def build(self, fig, **values):
        many, used = self.key
        grid = fig.add_gridspec(2, 1, height_ratios=[2.2, 1])
        ax_gantt, ax_mem = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
        self.bars = PolyCollection([], edgecolors="white", linewidths=0.3 if many else 0.4)
        ax_gantt.add_collection(self.bars, autolim=False)
        self.numbers, self.mem_bars, self.mem_texts = [], [], []
        if many:   # quick_gantt's legend: no numbers on the bars, no comm lane
            handles = [Patch(facecolor=GANTT_COLORS[k], edgecolor="white", linewidth=0.3,
                             label=k) for k in used]
        else:      # timeline.gantt's legend
            handles = [Patch(color=GANTT_COLORS[k], label=GANTT_LABELS[k]) for k in used]
            handles.append(Patch(color="none", label="thin bar: comm lane (async)"))
        ax_gantt.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                        fontsize=8, frameon=False)
        ax_gantt.grid(axis="x", alpha=0.3)
        ax_mem.set_ylabel("activations held\n(micro-batch x stage)")
        ax_mem.set_title("peak activation memory per stage (from the schedule)", fontsize=10)
        fig.tight_layout()

    def update(self, fig, **values):
        d = self.d
        ax_gantt, ax_mem = fig.axes[:2]
        self._gantt(ax_gantt, d["timeline"], d["stages"], d["title"])
        self._memory(ax_mem, d["held"])
        return d["text"]

    def _gantt(self, ax, timeline, stages, title):
        """timeline.gantt's bars, numbers, ticks and limits (then _pad) for `timeline`."""
        t_max = max([e["end"] for e in timeline] + [0.0])
        t_min = min([e["start"] for e in timeline] + [0.0])
        unit = pick_time_unit(t_max)
        scale = TIME_UNITS[unit]
        span = max(t_max - t_min, 1e-30) / scale
        labelled = len(timeline) <= MANY_BARS
        verts, colors, numbers = np.empty((len(timeline), 4, 2)), [], []
        for i, e in enumerate(timeline):
            key = gantt_style(e)
            y, height = ((-e["rank"] - 0.38, 0.16) if e.get("lane", "compute") == "comm"
                         else (-e["rank"], 0.5))
            left, width = e["start"] / scale, (e["end"] - e["start"]) / scale
            bottom, top = y - height / 2, y + height / 2
            verts[i] = ((left, bottom), (left + width, bottom), (left + width, top),
                        (left, top))
            colors.append(GANTT_COLORS[key])
            mb = (e.get("meta") or {}).get("microbatch")
            if labelled and mb is not None and width > 0.025 * span and height > 0.3:
                numbers.append((left + width / 2, y, str(mb),
                                "white" if key in ("forward", "comm") else "black"))
        self.bars.set_verts(verts)
        self.bars.set_facecolors(colors)
        while len(self.numbers) < len(numbers):
            self.numbers.append(ax.text(0, 0, "", ha="center", va="center", fontsize=7))
        for text, (x, y, words, color) in zip(self.numbers, numbers):
            text.set_position((x, y))
            text.set_text(words)
            text.set_color(color)
            text.set_visible(True)
        for text in self.numbers[len(numbers):]:
            text.set_visible(False)
        ax.set_yticks([-r for r in range(stages)], [f"rank {r}" for r in range(stages)])
        # barh's limits: no margin left of the first bar (a sticky edge), 5% right of the
        # last; the y limits as gantt sets them (quick_gantt's: autoscaled, 5% margins)
        lo, hi = verts[:, 0, 0].min(), verts[:, 1, 0].max()
        margin = ax.margins()[0] * (hi - lo)
        if labelled:
            ax.set_xlim(lo, hi + margin)
            ax.set_ylim(-stages + 0.4, 0.5)
        else:
            ax.set_xlim(lo - margin, hi + margin)
            margin = ax.margins()[1] * (stages - 0.5)
            ax.set_ylim(-stages + 0.75 - margin, 0.25 + margin)
        ax.set_xlabel(f"modelled time ({unit})")
        ax.set_title(title)
        _pad(ax)

    def _memory(self, ax, held):
        """The bar per rank of activations held, with its number on top."""
        while len(self.mem_bars) < len(held):
            r = len(self.mem_bars)
            self.mem_bars.append(ax.bar([r], [0], color="#c44e52")[0])
            self.mem_texts.append(ax.text(r, 0, "", ha="center", va="bottom", fontsize=8))
        for r, (bar, text) in enumerate(zip(self.mem_bars, self.mem_texts)):
            shown = r < len(held)
            bar.set_visible(shown)
            text.set_visible(shown)
            if shown:
                bar.set_height(held[r])
                text.set_y(held[r])
                text.set_text(fmt(held[r]))
        ax.set_xticks(range(len(held)), [f"rank {r}" for r in range(len(held))])
        # ax.bar's autoscaled x limits for these bars (width 0.8, 5% margins)
        margin = ax.margins()[0] * (len(held) - 0.2)
        ax.set_xlim(-0.4 - margin, len(held) - 0.6 + margin)
        ax.set_ylim(0, max(held) * 1.3)


def draw_pipeline(fig, stages, microbatches, schedule, virtual, ratio):
    """Gantt chart (top) and activation memory per stage (bottom) on `fig`; returns a line."""
    return PipelineDrawing().draw_on(fig, stages=stages, microbatches=microbatches,
                                     schedule=schedule, virtual=virtual, ratio=ratio)


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
    return figure_explorer(controls, PipelineDrawing(), figsize=(10, 6))


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

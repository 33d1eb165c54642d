"""Lesson 02's zero-bubble explorer: 1F1B, ZB-H1 and DualPipe as Gantt charts, with the
simulated idle time beside the formulas of the DeepSeek-V3 report's Table 2, and the
activations and parameters each rank holds.

Simulated in pure Python (`labkit.theory.pipeline_layouts`, the executor's timing rules, free
links). Assumed times (modelled): one stage's forward of one micro-batch 1 ms, its whole
backward 2 ms, of which a share is the weight gradient W and the rest the input gradient B.
"""
from __future__ import annotations

from ..theory import pipeline as pp
from ..theory import pipeline_layouts as lay
import numpy as np
from matplotlib.collections import PolyCollection
from matplotlib.patches import Patch

from .pipeline_widgets import MANY_BARS, T_FORWARD, PipelineDrawing
from .plots import TIME_UNITS, pick_time_unit
from .timeline import GANTT_COLORS, gantt_style

SCHEDULES = {"1F1B": "1f1b", "ZB-H1": "zb1p", "DualPipe": "dualpipe"}
PARAMETERS = {"1F1B": 1, "ZB-H1": 1, "DualPipe": 2}     # copies of a stage's weights per rank


def laid_out(schedule, stages, microbatches):
    """The schedule's data as a `LaidOut` (1F1B's backward unsplit: full-backward slots)."""
    if schedule == "1F1B":
        return lay.from_loop(pp.one_f_one_b_schedule(stages, microbatches))
    if schedule == "ZB-H1":
        return lay.from_loop(pp.zb_h1_schedule(stages, microbatches))
    if schedule == "DualPipe":
        return lay.dualpipe_schedule(stages, microbatches)
    raise ValueError(f"schedule must be one of {list(SCHEDULES)}, not {schedule!r}")


def op_times(weight_share):
    """(T_F, T_B, T_W) in modelled seconds: forward 1 ms, backward 2 ms split B + W."""
    t_w = 2 * T_FORWARD * weight_share
    return T_FORWARD, 2 * T_FORWARD - t_w, t_w


def zero_bubble_numbers(schedule, stages, microbatches, weight_share=0.5):
    """Timeline, activations per rank, title and text line for one setting. DualPipe's P and
    M are moved to the nearest it runs (P even, M even and >= 2P), said in the text."""
    note = ""
    if schedule == "DualPipe":
        p = stages + stages % 2
        m = max(microbatches + microbatches % 2, 2 * p)
        if (p, m) != (stages, microbatches):
            note = f" (DualPipe needs P even, M even and >= 2P: P = {p}, M = {m})"
        stages, microbatches = p, m
    times = op_times(weight_share)
    sched = laid_out(schedule, stages, microbatches)
    timeline = lay.simulate_laid_out(sched, *times)
    idle = max(lay.idle_per_rank(timeline))
    formula = lay.table2_idle(SCHEDULES[schedule], stages, *times)
    step = max(e["end"] for e in timeline)
    enters = (f"; micro-batches 0-{microbatches // 2 - 1} enter at rank 0, "
              f"{microbatches // 2}-{microbatches - 1} at rank {stages - 1}"
              if schedule == "DualPipe" else "")
    return dict(
        stages=stages, timeline=timeline, held=lay.activations_held(sched),
        overlapped=overlapped_spans(sched, timeline),
        title=f"{schedule}, P={stages}, M={microbatches} (simulated, modelled times){enters}",
        text=(f"idle per rank (simulated): <b>{idle * 1e3:.2f} ms</b> &nbsp; Table 2 formula "
              f"{formula * 1e3:.2f} ms &nbsp; bubble {pp.timeline_bubble_fraction(timeline):.3f}"
              f" &nbsp; step {step * 1e3:.1f} ms &nbsp; weights per rank "
              f"{PARAMETERS[schedule]}x a stage{note}"))


def overlapped_spans(sched, timeline):
    """(rank, start, end) of every F&B slot (three ops: F, then a full backward B, W)."""
    spans = []
    for rank, slots in enumerate(sched.slots or [()] * len(sched.ops)):
        bars = [e for e in timeline if e["rank"] == rank and e["kind"] == "compute"]
        spans += [(rank, bars[i]["start"], bars[i + n - 1]["end"]) for i, n in slots if n == 3]
    return spans


class ZeroBubbleDrawing(PipelineDrawing):
    """The pipeline explorer's two panels (Gantt, activations per rank) for these schedules."""

    def shape(self, **values):
        self.d = zero_bubble_numbers(**values)
        used = {gantt_style(e) for e in self.d["timeline"]}
        self.key = len(self.d["timeline"]) > MANY_BARS, tuple(k for k in GANTT_COLORS
                                                               if k in used)
        return self.key

    def build(self, fig, **values):
        super().build(fig, **values)
        ax_gantt = fig.axes[0]
        self.outlines = PolyCollection([], facecolors="none", edgecolors="black",
                                       linewidths=1.2)
        ax_gantt.add_collection(self.outlines, autolim=False)
        old = ax_gantt.get_legend()
        handles = [h for h in old.legend_handles if "comm lane" not in h.get_label()]
        handles.append(Patch(facecolor="none", edgecolor="black",
                             label="outline: one F&B slot\n(a forward overlapped\nwith a "
                                   "full backward)"))
        ax_gantt.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                        fontsize=8, frameon=False)
        fig.axes[1].set_title("peak activations per rank: micro-batches whose F is done and W "
                              "not yet (x one stage)", fontsize=10)

    def update(self, fig, **values):
        text = super().update(fig, **values)
        scale = TIME_UNITS[pick_time_unit(max(e["end"] for e in self.d["timeline"]))]
        verts = np.array([((a / scale, -r - 0.3), (b / scale, -r - 0.3), (b / scale, -r + 0.3),
                           (a / scale, -r + 0.3)) for r, a, b in self.d["overlapped"]]
                         ).reshape(-1, 4, 2)
        self.outlines.set_verts(verts)
        return text


def draw_zero_bubble(fig, schedule, stages, microbatches, weight_share=0.5):
    """One setting on `fig` (a lesson's static figure); returns the text line."""
    return ZeroBubbleDrawing().draw_on(fig, schedule=schedule, stages=stages,
                                       microbatches=microbatches, weight_share=weight_share)


def zero_bubble_explorer():
    """Dropdown: schedule; sliders: P, M, the weight gradient's share of the backward."""
    import ipywidgets as widgets
    from .widgets import figure_explorer

    wide = dict(style={"description_width": "initial"})
    controls = dict(
        schedule=widgets.Dropdown(options=list(SCHEDULES), value="DualPipe",
                                  description="schedule", layout=widgets.Layout(width="200px"),
                                  **wide),
        stages=widgets.IntSlider(4, 2, 8, description="stages P", **wide),
        microbatches=widgets.IntSlider(8, 2, 24, description="micro-batches M", **wide),
        weight_share=widgets.FloatSlider(0.5, min=0.1, max=0.9, step=0.05,
                                         description="W share of the backward", **wide),
    )
    return figure_explorer(controls, ZeroBubbleDrawing(), figsize=(10, 6))

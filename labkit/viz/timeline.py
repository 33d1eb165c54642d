"""Per-rank Gantt timelines: each rank a lane of compute bars, its communication a thin lane.

`gantt(timeline)` draws the event dicts a run's clock records (rank, kind, name, start/end in
modelled seconds, wall_start/wall_end measured) and returns the Figure; `gantt_style` and
`GANTT_COLORS`/`GANTT_LABELS` are its colour key, shared with the explorers that redraw it
(pipeline_widgets, cp_widgets). The axes say whether the clock is modelled or measured.
"""
from __future__ import annotations

from matplotlib.patches import Patch

from .plots import TIME_UNITS, figure_and_axes, pick_time_unit

GANTT_COLORS = {"forward": "#1f77b4", "backward": "#ff7f0e", "weight grad": "#ffbb78",
                "compute": "#2ca02c", "comm": "#9467bd", "p2p": "#c5b0d5", "idle": "#dcdcdc"}
GANTT_LABELS = {"forward": "forward", "backward": "backward",
                "weight grad": "weight grad (W)", "compute": "other compute",
                "comm": "collective (comm)", "p2p": "send / recv", "idle": "idle (waiting)"}


def gantt_style(event):
    """Which colour key an event gets: by kind, and for compute by its name."""
    kind = event["kind"]
    if kind == "compute":
        name = str(event.get("name", "")).lower()
        if "forward" in name:
            return "forward"
        if "weight grad" in name:
            return "weight grad"
        if "backward" in name:
            return "backward"
        return "compute"
    if kind in ("send", "recv"):
        return "p2p"
    return "idle" if kind == "idle" else "comm"


def gantt(timeline, *, clock="modelled", ax=None, title=""):
    """Per-rank timeline: rank 0 on top, its comm lane as a thin bar under its compute lane.

    clock='modelled' draws start/end (modelled seconds on the run's cluster); clock='wall' draws
    wall_start/wall_end (seconds measured on this machine). Bars show meta['microbatch'].
    """
    if clock not in ("modelled", "wall"):
        raise ValueError(f"clock must be 'modelled' or 'wall', not {clock!r}")
    lo, hi = ("start", "end") if clock == "modelled" else ("wall_start", "wall_end")
    ranks = sorted({int(e["rank"]) for e in timeline})
    fig, ax = figure_and_axes(ax, (10, 0.9 * len(ranks) + 1.6))
    t_max = max([float(e[hi]) for e in timeline] + [0.0])
    t_min = min([float(e[lo]) for e in timeline] + [0.0])
    unit = pick_time_unit(t_max) if clock == "modelled" else "s"
    scale = TIME_UNITS[unit]
    span = max(t_max - t_min, 1e-30) / scale

    used, bars = [], []
    for e in timeline:
        row = -ranks.index(int(e["rank"]))
        key = gantt_style(e)
        used.append(key)
        if e.get("lane", "compute") == "comm":
            y, height = row - 0.38, 0.16
        else:
            y, height = row, 0.5
        left, width = float(e[lo]) / scale, (float(e[hi]) - float(e[lo])) / scale
        bars.append((y, width, left, height, GANTT_COLORS[key]))
        mb = (e.get("meta") or {}).get("microbatch")
        if mb is not None and width > 0.025 * span and height > 0.3:
            ax.text(left + width / 2, y, str(mb), ha="center", va="center", fontsize=7,
                    color="white" if key in ("forward", "comm") else "black")
    if bars:   # one call for all the bars, in the events' order: hundreds of calls are slow
        y, width, left, height, color = zip(*bars)
        ax.barh(y, width, left=left, height=height, color=color, edgecolor="white",
                linewidth=0.4)

    ax.set_yticks([-i for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_ylim(-len(ranks) + 0.4, 0.5)
    if clock == "modelled":
        ax.set_xlabel(f"modelled time ({unit})")
    else:
        ax.set_xlabel("measured wall-clock time (s) on this machine")
    word = "modelled" if clock == "modelled" else "measured"
    if not title:
        title = ("per-rank timeline, modelled clock" if clock == "modelled"
                 else "per-rank timeline, measured wall clock")
    elif word not in title.lower():
        title = f"{title} ({word})"
    ax.set_title(title)
    order = [k for k in GANTT_COLORS if k in used]
    handles = [Patch(color=GANTT_COLORS[k], label=GANTT_LABELS[k]) for k in order]
    handles.append(Patch(color="none", label="thin bar: comm lane (async)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig

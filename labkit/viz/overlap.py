"""Overlap you can watch: per-rank compute and communication lanes of runs side by side, with
the exposed part of each collective marked, and gradient accumulation's saved traffic as bars.

`overlap_timeline` draws runs' timelines (the clock's events, `ctx.clock.timeline()`): per rank a
compute lane (forward, backward, waits) and under it the comm lane (the async collectives, one
at a time: the comm stream), each collective coloured by op. On the modelled clock the last
`exposed_s` of a collective, the part the compute lane waited for, is hatched; the rest ran
under compute (hidden). On the wall clock the bars are what this machine measured, from the
issue of each collective to the moment its result was there. `accumulation_bars` compares
gradient accumulation with and without `no_sync`: bytes per optimizer step (measured, with the
formula) and the modelled exposed communication.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

COMPUTE_COLORS = {"forward": "#1f77b4", "backward": "#ff7f0e", "compute": "#2ca02c",
                  "idle": "#dcdcdc"}
COMM_COLORS = {"all_gather": "#9467bd", "reduce_scatter": "#d62728", "all_reduce": "#8c564b",
               "comm": "#7f7f7f"}
LABELS = {"forward": "forward", "backward": "backward", "compute": "other compute",
          "idle": "waiting for a collective", "all_gather": "all-gather (weights)",
          "reduce_scatter": "reduce-scatter (gradients)", "all_reduce": "all-reduce",
          "comm": "other communication"}
TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))


def _unit(seconds):
    return next(((u, s) for u, s in TIME_UNITS if seconds >= s), TIME_UNITS[-1])


def _key(event):
    """The colour key of an event: compute by its name, communication by its op."""
    if event["kind"] == "idle":
        return "idle"
    if event["kind"] == "compute":
        name = str(event.get("name", "")).lower()
        return next((k for k in ("forward", "backward") if k in name), "compute")
    return event["name"] if event["name"] in COMM_COLORS else "comm"


def overlap_timeline(runs, ranks=(0, 1), clock="modelled", summaries=None, summary_of="rank 0",
                     title="", size=None):
    """One panel per run ({label: timeline}), sharing the time axis: per rank, compute on top
    and the comm lane under it. clock='modelled' uses start/end and hatches each collective's
    exposed part; clock='wall' uses wall_start/wall_end (each run's first event at 0).
    summaries: {label: `trace.overlap_by_op` rows} of `summary_of` (e.g. rank 0), printed as
    exposed/hidden seconds under each run's title."""
    if clock not in ("modelled", "wall"):
        raise ValueError(f"clock must be 'modelled' or 'wall', not {clock!r}")
    lo, hi = ("start", "end") if clock == "modelled" else ("wall_start", "wall_end")
    shown = {label: [e for e in tl if int(e["rank"]) in ranks
                     and not (clock == "wall" and e["kind"] == "idle")]
             for label, tl in runs.items()}
    offsets = {label: min((float(e[lo]) for e in tl), default=0.0) for label, tl in shown.items()}
    longest = max((float(e[hi]) - offsets[label] for label, tl in shown.items() for e in tl),
                  default=0.0)
    unit, scale = _unit(longest)
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=size or (11, 1.25 * len(ranks) * len(runs) + 1.2))
    used = set()
    for ax, (label, events) in zip(axes[:, 0], shown.items()):
        used |= _draw_panel(ax, events, ranks, lo, hi, offsets[label], scale, clock)
        line = _summary_line((summaries or {}).get(label), unit, scale)
        ax.set_title(label + (f"\n{summary_of}: {line}" if line else ""), fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    word = "modelled" if clock == "modelled" else "measured wall-clock"
    axes[-1, 0].set_xlabel(f"{word} time ({unit})"
                           + ("" if clock == "modelled" else " on this machine's CPUs"))
    order = [k for k in (*COMPUTE_COLORS, *COMM_COLORS) if k in used]
    handles = [Patch(color={**COMPUTE_COLORS, **COMM_COLORS}[k], label=LABELS[k])
               for k in order]
    if clock == "modelled":
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////",
                             label="exposed: compute waited for it"))
    axes[0, 0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def _draw_panel(ax, events, ranks, lo, hi, offset, scale, clock):
    """The bars of one run; returns the colour keys it used."""
    used, bars, hatched = set(), [], []
    for e in events:
        row = -2 * list(ranks).index(int(e["rank"]))
        key = _key(e)
        used.add(key)
        left = (float(e[lo]) - offset) / scale
        width = (float(e[hi]) - float(e[lo])) / scale
        on_comm_lane = e.get("lane") == "comm"
        y = row - 0.9 if on_comm_lane else row
        color = COMM_COLORS.get(key) or COMPUTE_COLORS[key]
        bars.append((y, width, left, 0.7 if not on_comm_lane else 0.55, color))
        exposed = (e.get("meta") or {}).get("exposed_s", 0.0)
        if clock == "modelled" and key in COMM_COLORS and exposed > 0:
            hatched.append((y, exposed / scale, left + width - exposed / scale,
                            0.7 if not on_comm_lane else 0.55))
    if bars:   # one call for all the bars: hundreds of calls are slow
        y, width, left, height, color = zip(*bars)
        ax.barh(y, width, left=left, height=height, color=color, edgecolor="white",
                linewidth=0.3)
    if hatched:
        y, width, left, height = zip(*hatched)
        ax.barh(y, width, left=left, height=height, color="none", edgecolor="black",
                hatch="////", linewidth=0.0)
    ticks = [t for i in range(len(ranks)) for t in (-2 * i, -2 * i - 0.9)]
    names = [n for r in ranks for n in (f"rank {r} compute", f"rank {r} comm")]
    ax.set_yticks(ticks, names, fontsize=8)
    ax.set_ylim(-2 * len(ranks) + 0.6, 0.6)
    return used


def _summary_line(rows, unit, scale):
    """'all-gather: 18.0 µs exposed, 23.2 µs hidden (56%) · ...' from overlap_by_op rows."""
    if not rows:
        return ""
    parts = []
    for op, r in rows.items():
        share = r["hidden_s"] / r["modelled_s"] if r["modelled_s"] else 0.0
        parts.append(f"{LABELS.get(op, op).split(' (')[0]} ×{r['calls']}: "
                     f"{r['exposed_s'] / scale:.1f} {unit} exposed, "
                     f"{r['hidden_s'] / scale:.1f} {unit} hidden ({share:.0%})")
    return " · ".join(parts)


def accumulation_bars(rows, title=""):
    """Gradient accumulation with and without no_sync, two panels of bars:
    rows = {label: {"bytes_per_step", "formula_bytes", "exposed_s", "calls_per_step"}}, the
    bytes measured from the comm log (the formula drawn as a black tick on each bar) and the
    exposed communication per optimizer step on the modelled clock."""
    labels = list(rows)
    fig, (ax_bytes, ax_time) = plt.subplots(1, 2, figsize=(11, 0.7 * len(labels) + 1.8))
    colors = ["#8c564b", "#2ca02c", "#1f77b4", "#9467bd"][:len(labels)]
    mb = [rows[k]["bytes_per_step"] / 1e6 for k in labels]
    ax_bytes.barh(labels, mb, color=colors)
    for i, k in enumerate(labels):
        f = rows[k]["formula_bytes"] / 1e6
        ax_bytes.plot([f, f], [i - 0.4, i + 0.4], color="black", lw=2,
                      label="formula (bytes per step)" if i == 0 else None)
        calls = rows[k]["calls_per_step"]
        ax_bytes.text(mb[i], i, f" {mb[i]:.2f} MB in {calls:g} bucket all-reduces",
                      va="center", fontsize=8)
    ax_bytes.set_xlabel("MB all-reduced per optimizer step\n(measured: payloads in the comm log)")
    ax_bytes.set_xlim(0, 1.8 * max(mb))
    ax_bytes.legend(fontsize=8, loc="lower right")
    ax_bytes.invert_yaxis()
    exposed = [rows[k]["exposed_s"] for k in labels]
    unit, scale = _unit(max(exposed) or 1e-9)
    ax_time.barh(labels, [x / scale for x in exposed], color=colors)
    for i, x in enumerate(exposed):
        ax_time.text(x / scale, i, f" {x / scale:.1f} {unit}", va="center", fontsize=8)
    ax_time.set_xlabel(f"exposed all-reduce time per optimizer step, {unit}\n(modelled: the "
                       "compute waited for it)")
    ax_time.set_xlim(0, 1.3 * max(exposed) / scale)
    ax_time.set_yticks([])
    ax_time.invert_yaxis()
    for ax in (ax_bytes, ax_time):
        ax.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig

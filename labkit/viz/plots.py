"""The lab's figures: memory stacks, speedup curves, comm bars, time splits (Gantt: timeline.py).

Every function takes plain data (dicts of bytes, lists of event dicts, summary rows), draws on
a given `ax` or on a new figure, and returns the matplotlib Figure. Nothing is saved. Numbers
from `labkit.theory` are *modelled*, numbers from a run are *measured*: the caller's labels say
which, and the axes always carry units.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.artist import Artist
from matplotlib.ticker import FuncFormatter

from .live import show_legend_entries

# --------------------------------------------------------------------------------- shared bits

UNITS = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1.0}
UNIT_NOTES = {"TB": "TB = 10¹² bytes", "GB": "GB = 10⁹ bytes", "MB": "MB = 10⁶ bytes",
              "KB": "KB = 10³ bytes", "B": "bytes"}
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}

# Memory categories, bottom to top, with one colour each (the same in every lesson).
MEMORY_ORDER = ("params", "grads", "optimizer", "activations", "kv_cache", "weights", "buffers")
MEMORY_COLORS = {
    "params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
    "kv_cache": "#8172b3", "weights": "#64b5cd", "buffers": "#937860",
}
MEMORY_LABELS = {"params": "parameters", "grads": "gradients", "weights": "weights (served)",
                 "optimizer": "optimizer state", "kv_cache": "KV cache"}
NOT_STACKED = ("total", "peak", "peak_phase", "peak_allocator")
EXTRA_COLORS = ("#da8bc3", "#8c8c8c", "#ccb974", "#17becf")


def figure_and_axes(ax, size):
    """The axes to draw on: the given one, or a fresh figure of `size` inches."""
    if ax is None:
        fig, ax = plt.subplots(figsize=size)
    return ax.figure, ax


def fmt(value):
    """A readable number: 1,129 / 38.0 / 4.53 / 0.0811 (no scientific notation)."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def pick_byte_unit(max_bytes):
    """'GB', 'MB', 'KB' or 'B' so that the largest value reads as 1 ... 999."""
    for unit in ("TB", "GB", "MB", "KB"):
        if max_bytes >= UNITS[unit]:
            return unit
    return "B"


def pick_time_unit(max_seconds):
    """'s', 'ms', 'µs' or 'ns' for an axis whose largest value is `max_seconds`."""
    if max_seconds >= 1:
        return "s"
    if max_seconds >= 1e-3:
        return "ms"
    if max_seconds >= 1e-6:
        return "µs"
    return "ns"


def _spread(values, gap):
    """Push sorted label positions apart so that neighbours are at least `gap` apart."""
    out = []
    for v in sorted(values):
        out.append(max(v, out[-1] + gap) if out else v)
    return out


# ------------------------------------------------------------------------------- memory_stack

def _stack_layout(bars, capacity, unit, keep=()):
    """What memory_stack draws, as numbers: categories, heights, totals, capacity lines
    (categories in `keep` are drawn even where zero everywhere: `restack` hides them)."""
    scale = UNITS[unit]
    labels = list(bars)
    seen = [k for k in keep]
    for values in bars.values():
        seen += [k for k, v in values.items() if k not in NOT_STACKED and k not in seen and v]
    cats = [c for c in MEMORY_ORDER if c in seen] + [c for c in seen if c not in MEMORY_ORDER]
    heights = [[float(bars[label].get(cat) or 0) / scale for label in labels] for cat in cats]
    bottoms, totals = [], [0.0] * len(labels)
    for row in heights:
        bottoms.append(totals)
        totals = [b + h for b, h in zip(totals, row)]
    peaks = [(xi, bars[label]["peak"] / scale) for xi, label in enumerate(labels)
             if bars[label].get("peak") is not None]
    top = max(totals + [p[1] for p in peaks] + [0.0])
    by_value = {}
    for name, cap in (capacity or {}).items():
        by_value.setdefault(float(cap) / scale, []).append(name)
    top = max([top] + list(by_value))
    ys = sorted(by_value)
    lines = [(y, ty, " / ".join(by_value[y])) for y, ty in zip(ys, _spread(ys, 0.055 * top))]
    return dict(labels=labels, cats=cats, heights=heights, bottoms=bottoms, totals=totals,
                peaks=peaks, top=top, lines=lines)


def stack_shape(bars, capacity=None, unit="GB", keep=()):
    """What decides memory_stack's artists: labels' count, categories, peaks, capacity lines.
    Two calls with the same shape can share artists: `restack` moves them. A fixed pool of
    categories (`keep`) keeps the shape while the nonzero categories change."""
    lay = _stack_layout(bars, capacity, unit, keep)
    return len(lay["labels"]), tuple(lay["cats"]), len(lay["peaks"]), len(lay["lines"]), unit


def memory_stack(bars, capacity=None, title="", unit="GB", ax=None, keep=()):
    """One stacked bar per label of `bars` ({label: {category: bytes}}), dashed capacity lines.

    Categories stack in MEMORY_ORDER (unknown ones after, in the order met; zero everywhere:
    left out); 'total', 'peak' and 'peak_phase' are not stacked, but a 'peak' is drawn as a
    black marker at its height.
    `capacity` is {name: bytes}, e.g. {'H100 80 GB': 80e9}; equal capacities share one line.
    `restack(ax, ...)` moves the artists to new bytes of the same `stack_shape`; categories
    in `keep` get bars and a legend entry, hidden while zero everywhere.
    """
    lay = _stack_layout(bars, capacity, unit, keep)
    labels = lay["labels"]
    fig, ax = figure_and_axes(ax, (max(5.5, 1.3 * len(labels) + 4.5), 4.6))
    x = list(range(len(labels)))
    drawn = dict(bars=[], totals=[], peaks=None, lines=[])
    for i, cat in enumerate(lay["cats"]):
        color = MEMORY_COLORS.get(cat, EXTRA_COLORS[i % len(EXTRA_COLORS)])
        drawn["bars"].append(ax.bar(x, lay["heights"][i], 0.6, bottom=lay["bottoms"][i],
                                    color=color, label=MEMORY_LABELS.get(cat, cat),
                                    edgecolor="white", linewidth=0.5))
    for xi in x:   # the stack's total above each bar
        drawn["totals"].append(ax.text(xi, 0, "", ha="center", va="bottom", fontsize=9,
                               bbox=dict(facecolor="white", edgecolor="none", pad=1,
                                         alpha=0.8)))
    if lay["peaks"]:
        drawn["peaks"], = ax.plot([], [], "<", color="black", markersize=7, linestyle="none",
                                  label="peak")
    right = len(labels) - 0.5           # capacity lines end here; their names sit to the right
    for _ in lay["lines"]:
        drawn["lines"].append((ax.plot([-0.6, right], [0, 0], color="0.35", linestyle="--",
                                       linewidth=1)[0],
                               ax.plot([right, right + 0.12], [0, 0], color="0.35",
                                       linewidth=0.7)[0],
                               ax.text(right + 0.14, 0, "", va="center", fontsize=8,
                                       color="0.2")))
    ax.set_xlim(-0.6, len(labels) + 0.9 if lay["lines"] else right + 0.1)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1000
                                               else f"{v:g}"))
    ax.set_ylabel(f"memory ({UNIT_NOTES[unit]})")
    entries = list(zip(*ax.get_legend_handles_labels()))
    stack = [e for e in entries if e[1] != "peak"][::-1]   # top of the stack first, like the bars
    if stack:
        handles, names = zip(*([e for e in entries if e[1] == "peak"] + stack))
        ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                  frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.labkit_stack = drawn
    ax.add_artist(_TotalsFitter(ax))
    restack(ax, bars, capacity, title, unit, keep)
    fig.tight_layout()
    fit_labels(ax)      # the axes' final width decides whether totals and title fit
    fig.tight_layout()  # room for a title wrapped onto more lines
    return fig


def _points_wide(text, fontsize):
    """About how wide `text` is in points (DejaVu Sans: ~0.6 em a character)."""
    return 0.6 * fontsize * max((len(line) for line in text.split("\n")), default=0)


def _fit_totals(ax):
    """A total wider than its bar's slot (at the axes' width now) puts its unit on a second
    line ("65.4\nGB"); `restack` keeps the choice until the next fit."""
    drawn = ax.labkit_stack
    width_pt = ax.get_window_extent().width * 72 / ax.figure.dpi
    left, right = ax.get_xlim()
    slot_pt = width_pt / max(right - left, 1e-9)
    one_line = [t.get_text().replace("\n", " ") for t in drawn["totals"]]
    drawn["wrap_totals"] = any(_points_wide(t, 9) > 0.9 * slot_pt for t in one_line)
    for text, words in zip(drawn["totals"], one_line):
        wanted = words.replace(" ", "\n", 1) if drawn["wrap_totals"] else words
        if text.get_text() != wanted:
            text.set_text(wanted)
    _set_top(ax)


def _set_top(ax):
    """The y limit: room above the tallest bar for its total, two lines of it if wrapped."""
    drawn = ax.labkit_stack
    top = drawn.get("top", 0)
    wanted = (0, top * (1.24 if drawn.get("wrap_totals") else 1.12) if top > 0 else 1)
    if tuple(ax.get_ylim()) != wanted:
        ax.set_ylim(*wanted)


class _TotalsFitter(Artist):
    """Drawn first on memory_stack's axes: fits the totals to the width the axes have when
    painted, whatever layout ran after memory_stack (an explorer lays out once, at the end)."""

    def __init__(self, ax):
        super().__init__()
        self.stack_ax = ax
        self.set_zorder(-1e9)
        self.set_in_layout(False)

    def draw(self, renderer):
        _fit_totals(self.stack_ax)


def fit_labels(ax):
    """Make memory_stack's totals and title fit the axes as laid out now: a total wider than
    its bar's slot puts its unit on a second line ("65.4\nGB") (again at each paint), and a
    title is wrapped where it would pass the figure's edge (it is centred on the axes)."""
    drawn = ax.labkit_stack
    _fit_totals(ax)
    # a title is centred on the axes: it may pass their edges, not the figure's
    box, fig_width = ax.get_window_extent(), ax.figure.bbox.width
    room_pt = 2 * min(box.x0 + box.width / 2, fig_width - box.x0 - box.width / 2) \
        * 72 / ax.figure.dpi
    drawn["title_chars"] = max(20, int(0.95 * room_pt / (0.6 * ax.title.get_fontsize())))
    ax.set_title(_wrapped(ax.get_title(), drawn["title_chars"]))


def _wrapped(title, chars):
    """Each line of `title` longer than `chars` characters wrapped; shorter ones kept."""
    import textwrap
    return "\n".join(textwrap.fill(line, chars) if len(line) > chars else line
                     for line in title.split("\n"))


def restack(ax, bars, capacity=None, title="", unit="GB", keep=()):
    """Set memory_stack's artists on `ax` to new bytes (same `stack_shape`): bar heights,
    totals, peaks, capacity lines, limits, tick labels and title; a kept category that is
    zero everywhere is hidden, bars and legend entry."""
    lay, drawn = _stack_layout(bars, capacity, unit, keep), ax.labkit_stack
    shown = {}
    for cat, container, heights, bottoms in zip(lay["cats"], drawn["bars"], lay["heights"],
                                                lay["bottoms"]):
        shown[MEMORY_LABELS.get(cat, cat)] = visible = any(heights)
        for rect, h, b in zip(container, heights, bottoms):
            rect.set_y(b)
            rect.set_height(h)
            rect.set_visible(visible)
    if keep:
        show_legend_entries(ax, shown)
    for text, total in zip(drawn["totals"], lay["totals"]):
        text.set_y(total)
        text.set_text(f"{fmt(total)}{chr(10) if drawn.get('wrap_totals') else ' '}{unit}")
    if drawn["peaks"] is not None:
        drawn["peaks"].set_data([p[0] + 0.36 for p in lay["peaks"]], [p[1] for p in lay["peaks"]])
    for (line, link, name), (y, ty, words) in zip(drawn["lines"], lay["lines"]):
        line.set_ydata([y, y])
        link.set_ydata([y, ty])
        name.set_y(ty)
        name.set_text(words)
    drawn["top"] = lay["top"]
    _set_top(ax)
    ax.set_xticks(range(len(lay["labels"])), lay["labels"])
    wrap = drawn.get("title_chars")          # set by fit_labels once the axes were laid out
    ax.set_title(_wrapped(title, wrap) if wrap else title)


# -------------------------------------------------------------------------------- speedup_curve

def speedup_curve(gpus, series, *, ideal=True, ax=None, title="", ylabel="speedup"):
    """One line with markers per series ({label: [value per GPU count]}) over a log2 x axis.

    Label each series 'modelled ...' or 'measured ...'. ideal=True adds y = x, dashed.
    """
    fig, ax = figure_and_axes(ax, (6, 4.2))
    gpus = list(gpus)
    markers = "osD^vP*X"
    for i, (label, values) in enumerate(series.items()):
        ax.plot(gpus, list(values), marker=markers[i % len(markers)], label=label)
    if ideal:
        ax.plot(gpus, gpus, "k--", linewidth=1, label="ideal (y = x)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.minorticks_off()
    ax.set_xlabel("GPUs (log2 scale)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------ comm_bars

def comm_bars(summary, ax=None, title=""):
    """Payload bytes and wire bytes per rank for each op (`ctx.comm.summary()` rows).

    Rows may carry a 'rank' key (one summary per rank): then each op gets one group per rank.
    Payload bytes come from the logged tensors (measured); wire bytes from the ring model
    (modelled: gloo does not report what it sends).
    """
    rows = summary.to_dict("records") if hasattr(summary, "to_dict") else list(summary)
    fig, ax = figure_and_axes(ax, (max(5.0, 1.1 * len(rows) + 3), 4.2))
    largest = max([float(r["bytes"]) for r in rows] +
                  [float(r["wire_bytes_per_rank"]) for r in rows] + [1.0])
    unit = pick_byte_unit(largest)
    scale = UNITS[unit]
    x = list(range(len(rows)))
    names = [r["op"] if "rank" not in r else f"{r['op']}\nrank {r['rank']}" for r in rows]
    payload = [float(r["bytes"]) / scale for r in rows]
    wire = [float(r["wire_bytes_per_rank"]) / scale for r in rows]
    ax.bar([i - 0.2 for i in x], payload, 0.4, color="#4c72b0",
           label="payload bytes handed to the op (measured)")
    ax.bar([i + 0.2 for i in x], wire, 0.4, color="#9467bd",
           label="ring-model bytes sent per rank (modelled)")
    for i, r in enumerate(rows):
        if "calls" in r:
            calls = f"{r['calls']} call" + ("s" if r["calls"] != 1 else "")
            ax.text(i, max(payload[i], wire[i]), calls, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names)
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_ylim(0, max(payload + wire + [1e-9]) * 1.18)
    ax.set_title(title or "communication per op")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------ time_split

TIME_ORDER = ("compute", "exposed_comm", "bubble", "other")
TIME_COLORS = {"compute": "#2ca02c", "exposed_comm": "#9467bd", "bubble": "#dcdcdc",
               "other": "#8c8c8c"}
TIME_LABELS = {"exposed_comm": "exposed comm"}


def _time_layout(rows, unit):
    scale = TIME_UNITS[unit]
    labels = list(rows)
    seen = []
    for parts in rows.values():
        seen += [k for k in parts if k != "total" and k not in seen]
    cats = [c for c in TIME_ORDER if c in seen] + [c for c in seen if c not in TIME_ORDER]
    widths, lefts, ends = [], [], [0.0] * len(labels)
    for cat in cats:
        widths.append([float(rows[label].get(cat) or 0) / scale for label in labels])
        lefts.append(ends)
        ends = [a + w for a, w in zip(ends, widths[-1])]
    return dict(labels=labels, cats=cats, widths=widths, lefts=lefts, ends=ends)


def time_shape(rows):
    """What decides time_split's artists (rows' count, categories): `retime` keeps them."""
    lay = _time_layout(rows, "s")
    return len(lay["labels"]), tuple(lay["cats"])


def time_split(rows, ax=None, title="", unit="ms", colors=None, hide_zero=False):
    """Stacked horizontal bars per label ({label: {compute, exposed_comm, bubble, other}}, s).

    Keys other than those four (except 'total') are stacked after them; `colors` ({key:
    colour}) colours them. Say 'modelled' or 'measured' in the labels or title.
    `retime(ax, ...)` moves the bars to new times of the same `time_shape`. `hide_zero`:
    a category zero in every row is hidden (bars and legend entry), so a fixed pool of
    categories keeps the shape.
    """
    colors = dict(TIME_COLORS, **(colors or {}))
    lay = _time_layout(rows, unit)
    fig, ax = figure_and_axes(ax, (7.5, 0.6 * len(lay["labels"]) + 2))
    y = [-i for i in range(len(lay["labels"]))]
    ax.labkit_split = [
        ax.barh(y, widths, 0.6, left=lefts, label=TIME_LABELS.get(cat, cat),
                color=colors.get(cat, EXTRA_COLORS[i % len(EXTRA_COLORS)]),
                edgecolor="white", linewidth=0.5)
        for i, (cat, widths, lefts) in enumerate(zip(lay["cats"], lay["widths"], lay["lefts"]))]
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    retime(ax, rows, title, unit, hide_zero)
    fig.tight_layout()
    return fig


def retime(ax, rows, title="", unit="ms", hide_zero=False):
    """Set time_split's bars on `ax` to new times (same `time_shape`), with labels, unit,
    limits and title."""
    lay = _time_layout(rows, unit)
    shown = {}
    for cat, container, widths, lefts in zip(lay["cats"], ax.labkit_split, lay["widths"],
                                             lay["lefts"]):
        shown[TIME_LABELS.get(cat, cat)] = visible = any(widths) or not hide_zero
        for rect, w, left in zip(container, widths, lefts):
            rect.set_x(left)
            rect.set_width(w)
            rect.set_visible(visible)
    if hide_zero:
        show_legend_entries(ax, shown)
    ax.set_yticks([-i for i in range(len(lay["labels"]))], lay["labels"])
    ax.set_xlabel(f"time per step ({unit})")
    ax.set_xlim(0, max(lay["ends"] + [0.0]) * 1.05 or 1)
    ax.set_title(title)

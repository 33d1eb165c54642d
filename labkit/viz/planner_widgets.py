"""The planner drawn (lesson 06): the best plans' memory per GPU and modelled step time, an
explorer over model, GPU count, GPU kind, batch and sequence length, the planner against
published runs with its expected error band (theory/error_band.py), and a modelled step split
into its parts (`plan --explain`) beside a published step time. Everything here is
*modelled* by `labkit.theory.planner` unless labelled published; the labels say so.
"""
from __future__ import annotations

import functools
import math

import matplotlib.pyplot as plt

from ..theory import catalog, error_band, planner
from .live import Drawing, neighbours, prefetch
from .plots import (fit_labels, memory_stack, restack, retime, stack_shape, time_shape,
                    time_split)

BREAKDOWN_LABELS = {"compute": "compute", "recompute": "recompute (incl. FlashAttention's)",
                    "tp_comm": "TP comm", "cp_comm": "CP ring (exposed)",
                    "ep_comm": "EP all-to-all",
                    "pp_bubble": "pipeline bubble", "pp_comm": "PP sends",
                    "dp_comm": "DP/ZeRO comm (exposed)", "optimizer": "optimizer step",
                    "overlap_slowdown": "compute slowed by overlapped comm"}
BREAKDOWN_COLORS = {"compute": "#2ca02c", "recompute (incl. FlashAttention's)": "#98df8a",
                    "TP comm": "#9467bd", "CP ring (exposed)": "#e377c2",
                    "EP all-to-all": "#17becf",
                    "pipeline bubble": "#dcdcdc", "PP sends": "#c5b0d5",
                    "DP/ZeRO comm (exposed)": "#d62728", "optimizer step": "#8c564b",
                    "compute slowed by overlapped comm": "#bcbd22"}
# every memory category the planner reports: a fixed pool of bars, hidden while zero, keeps the
# figure's shape (and its artists) when the top plans' categories change
MEMORY_POOL = ("params", "grads", "optimizer", "activations", "buffers", "reserved")
EXPLORER_GPUS = {"H100 SXM": "H100", "H200 SXM": "H200", "A100 SXM 80GB": "A100", "B200": "B200"}


def plan_label(p, sep="\n"):
    """A short name for a plan: 'dp4 tp4 pp4', then 'v2 ZeRO-1 full' (joined by `sep`)."""
    parts = [f"dp{p['dp']}", f"tp{p['tp']}", f"pp{p['pp']}"]
    parts += [f"cp{p['cp']}"] if p["cp"] > 1 else []
    parts += [f"ep{p['ep']}"] if p["ep"] > 1 else []
    extra = [f"v{p['v']}"] if p["v"] > 1 else []
    extra += [f"ZeRO-{p['zero_stage']}"] if p["zero_stage"] else []
    extra += [f"{planner.recompute_label(p)} recompute"] if p["recompute"] != "none" else []
    extra += [f"mbs {p['micro_batch_size']}"] if p["micro_batch_size"] > 1 else []
    return " ".join(parts) + (sep + " ".join(extra) if extra else "")


def plan_table(out, k=8):
    """The top `k` plans as a DataFrame (modelled numbers)."""
    import pandas as pd
    rows = []
    for p in out["plans"][:k]:
        rows.append({"plan": plan_label(p, " · "),
                     "GB per GPU": round(p["memory_bytes"]["total"] / 1e9, 1),
                     "step (s)": round(p["step_s"], 3), "MFU": f"{p['mfu']:.1%}",
                     "tokens/s/GPU": round(p["tokens_per_s_per_gpu"]),
                     "fits": "yes" if p["fits"] else p["reason"]})
    return pd.DataFrame(rows)


def _plan_panels(out, k=4):
    """memory_stack's and time_split's arguments for the top `k` plans of `out`."""
    plans = out["plans"][:k]
    bars = {f"#{i + 1}": {c: v for c, v in p["memory_bytes"].items() if c != "total"}
            for i, p in enumerate(plans)}
    # every category, zero ones hidden (time_split's hide_zero): the shape stays
    rows = {f"#{i + 1} {plan_label(p)}": {BREAKDOWN_LABELS[c]: p["breakdown_s"].get(c, 0.0)
                                          for c in BREAKDOWN_LABELS}
            for i, p in enumerate(plans)}
    # a short capacity name: it sits between the bars and the legend; the GPU is in the title
    return (dict(bars=bars, capacity={"HBM": out["cluster"]["capacity_bytes"]},
                 title=f"memory per {out['cluster']['gpu']} (modelled)\nworst pipeline stage",
                 unit="GB", keep=MEMORY_POOL),
            dict(rows=rows, unit="s", title="step time (modelled)", hide_zero=True))


def plan_figure(out, k=4, fig=None):
    """Left: memory per GPU of the top `k` plans (the allocator's reserve as its own bar)
    against the GPU's memory; right: their
    modelled step time split. Returns the figure."""
    stack, split = _plan_panels(out, k)
    fig = fig or plt.figure(figsize=(12, 4.4))
    left, right = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=[1, 1.3]))
    memory_stack(ax=left, **stack)
    time_split(ax=right, colors=BREAKDOWN_COLORS, **split)
    right.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fit_labels(left)        # the memory panel's totals, at its width after the layout
    fig.tight_layout()
    return fig


class PlannerDrawing(Drawing):
    """plan_figure built once per shape (how many plans; the categories are a fixed pool, zero
    ones hidden); a new GPU count or batch with the same shape moves the bars. The planner's
    search is cached, and the GPU counts next to the chosen one are searched in the
    background, between steps."""

    def shape(self, model, gpus, gpu, tokens, seq):
        prefetch(cached_plan, [(model, n, gpu, tokens, seq)
                               for n in neighbours(EXPLORER_GPU_COUNTS, gpus)])
        try:
            self.out = cached_plan(model, gpus, gpu, tokens, seq)
        except ValueError as error:
            self.out = error
            return str(error)
        self.panels = _plan_panels(self.out)
        stack, split = self.panels
        return (stack_shape(stack["bars"], stack["capacity"], stack["unit"], stack["keep"]),
                time_shape(split["rows"]))

    def build(self, fig, **values):
        if isinstance(self.out, ValueError):
            fig.text(0.5, 0.5, str(self.out), ha="center", wrap=True)
        else:
            plan_figure(self.out, fig=fig)

    def update(self, fig, **values):
        out = self.out
        if isinstance(out, ValueError):
            return f"<b>no plan</b>: {out}"
        stack, split = self.panels
        restack(fig.axes[0], **stack)
        retime(fig.axes[1], **split)
        best = out["plans"][0]
        if not best["fits"]:
            return (f"{out['considered']} legal plans, <b>none fits</b>: the smallest "
                    f"{best['reason']}")
        return (f"{out['considered']} legal plans; best (modelled): "
                f"{plan_label(best, ' · ')}, MFU {best['mfu']:.1%}, "
                f"{best['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU")


EXPLORER_GPU_COUNTS = [2 ** k for k in range(3, 15)]


@functools.lru_cache(maxsize=256)
def cached_plan(model, gpus, gpu, tokens, seq):
    """The planner's ranking, remembered (the explorer redraws without searching again)."""
    return planner.plan(model, gpus, gpu, global_batch_tokens=tokens, seq=seq, top=4)


def planner_explorer():
    """Model, GPUs, GPU kind, batch and sequence length -> the best plans, drawn."""
    import ipywidgets as widgets
    from .widgets import figure_explorer
    names = [m.display_name for m in catalog.models() if m.arch != "unet"]
    controls = dict(
        model=widgets.Dropdown(options=names, value="Llama 3 70B", description="model"),
        gpus=widgets.SelectionSlider(options=EXPLORER_GPU_COUNTS, value=64,
                                     description="GPUs"),
        gpu=widgets.Dropdown(options=list(EXPLORER_GPUS), value="H100 SXM",
                             description="GPU"),
        tokens=widgets.Dropdown(options={"1M tokens": 2 ** 20, "4M tokens": 2 ** 22,
                                         "16M tokens": 2 ** 24}, value=2 ** 22,
                                description="batch"),
        seq=widgets.Dropdown(options=[2048, 4096, 8192, 32768, 131072], value=4096,
                             description="sequence"))

    return figure_explorer(controls, PlannerDrawing(), figsize=(12, 4.4))


def mesh_layout(table, gpus_per_node=8, title="", ax=None):
    """Draw a mesh's ranks (rows of `Mesh.table()`): one box per rank, in rank order, nodes of
    `gpus_per_node` side by side; colour = pipeline stage, text = dp replica and TP shard."""
    from matplotlib.patches import Rectangle
    n = len(table)
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(14, 1.3 * n + 1), 2.3))
    else:
        fig = ax.figure
    stages = sorted({r["pp"] for r in table})
    colors = plt.get_cmap("tab10")
    show_cp = any(r.get("cp") for r in table)
    for r in table:
        x = r["rank"] + 0.25 * (r["rank"] // gpus_per_node)   # a gap between nodes
        ax.add_patch(Rectangle((x, 0), 0.9, 1, color=colors(stages.index(r["pp"]) % 10),
                               alpha=0.35 + 0.5 * (r["tp"] % 2)))
        ax.text(x + 0.45, 0.72, f"rank {r['rank']}", ha="center", fontsize=8, weight="bold")
        ax.text(x + 0.45, 0.45, f"stage {r['pp']}", ha="center", fontsize=8)
        ax.text(x + 0.45, 0.2, f"dp {r['dp']} · tp {r['tp']}"
                + (f" · cp {r['cp']}" if show_cp else ""), ha="center", fontsize=7)
    nodes = (n + gpus_per_node - 1) // gpus_per_node
    for k in range(nodes):
        left = k * gpus_per_node * 1.0 + 0.25 * k - 0.05
        width = min(gpus_per_node, n - k * gpus_per_node) + 0.0
        ax.add_patch(Rectangle((left, -0.12), width, 1.24, fill=False, linestyle="--",
                               edgecolor="0.4"))
        ax.text(left + 0.02, 1.16, f"node {k}", fontsize=8, color="0.3")
    ax.set_xlim(-0.2, n + 0.25 * nodes)
    ax.set_ylim(-0.2, 1.35)
    ax.axis("off")
    ax.set_title(title or "rank layout: colour = pipeline stage, shade = TP shard")
    fig.tight_layout()
    return fig


def _number_places(xy, dpi, others=(), away=7.0, clear=11.0):
    """Where each dot's number goes, as an offset in points: the first of eight places around
    the dot (up-right first) at least `clear` points from every other dot (`others`: more dots,
    unnumbered) and every number placed before it, else the place farthest from them, so that
    clustered dots stay legible. `xy`, `others`: the dots in pixels."""
    places = [(1, 1), (1, -1), (-1, 1), (-1, -1), (1.3, 0), (-1.3, 0), (0, 1.3), (0, -1.3)]
    scale = dpi / 72                                  # pixels per point
    taken, out = [], []
    for i, (x, y) in enumerate(xy):
        near = [p for j, p in enumerate(xy) if j != i] + list(others) + taken

        def room(place):
            cx, cy = x + place[0] * away * scale, y + place[1] * away * scale
            return min((math.hypot(cx - a, cy - b) for a, b in near), default=math.inf)
        best = next((p for p in places if room(p) >= clear * scale), max(places, key=room))
        taken.append((x + best[0] * away * scale, y + best[1] * away * scale))
        out.append((best[0] * away, best[1] * away))
    return out


def error_band_figure(band, calibration=(), ax=None, *, group="source",
                      unit="TFLOP/s per GPU (6N + 12Lhs per token)", model="labkit's planner"):
    """Modelled against published (theory.error_band's training_band or serving_band), each row
    at its rates (error_band.rates: a time drawn as 1 / time, so above y = x the model is
    optimistic whatever the row's unit): each check row a numbered dot named in the key beside
    it, coloured by its `group` field (training: the source; serving: "kind", throughput or
    TTFT), the calibration rows (the one fitted number was fitted on them, so not in the band) as
    hollow grey circles, y = x and the band (modelled = (1 + error) x published, error from low
    to high) shaded between its two dashed edges; `unit` and `model` name the axes. Returns the
    figure."""
    rows = band["rows"]
    if ax is None:
        fig, ax = plt.subplots(figsize=(13, 7.2))
    else:
        fig = ax.figure
    points = {id(r): error_band.rates(r) for r in list(rows) + list(calibration)}
    values = [v for xy in points.values() for v in xy]
    lo, hi = min(values) / 1.3, max(values) * 1.3
    line = [lo, hi]
    edges = [[x * (1 + band[k]) for x in line] for k in ("low", "high")]
    ax.fill_between(line, *edges, color="#1f77b4", alpha=0.12,
                    label=f"expected band {band['low']:+.0%}/{band['high']:+.0%} "
                          f"({band['inside']} of the {band['n']} check rows inside)")
    for edge in edges:
        ax.plot(line, edge, color="#1f77b4", lw=0.8, ls="--")
    ax.plot(line, line, color="0.3", lw=1, label="modelled = published")
    if calibration:
        ax.scatter([points[id(r)][0] for r in calibration],
                   [points[id(r)][1] for r in calibration], facecolors="none", edgecolors="0.5",
                   s=40, label=f"calibration rows ({len(calibration)}, fitted on: not in the "
                               "band)")
    ax.set(xscale="log", yscale="log", xlim=line, ylim=line, xlabel=f"published {unit}",
           ylabel=f"{model}, modelled {unit}",
           title=f"modelled vs published: {band['n']} runs, none fitted to, mean |error| "
                 f"{band['mean_abs']:.1%} (X, *: outside the band)")
    fig.subplots_adjust(left=0.07, right=0.57)     # before the numbers are placed in pixels
    groups = sorted({r[group] for r in rows})
    colors = plt.get_cmap("tab10")
    pixels = ax.transData.transform([points[id(r)] for r in list(rows) + list(calibration)])
    places = _number_places(pixels[:len(rows)], fig.dpi, pixels[len(rows):])
    key, width = [], min(52, max(len(r["name"]) for r in rows))     # the key's name column
    for i, (r, offset) in enumerate(zip(rows, places), 1):
        c = colors(groups.index(r[group]) % 10)
        outside, (x, y) = r["name"] in band["outside"], points[id(r)]
        ax.scatter([x], [y], color=c, s=36, zorder=3, marker="X" if outside else "o")
        ax.annotate(str(i), (x, y), xytext=offset, textcoords="offset points", fontsize=7,
                    color=c, ha="center", va="center")
        key.append(f"{i:>2} {r['name'][:width]:<{width}} {r['error']:+6.1%}"
                   + (" *" if outside else ""))
    for g in groups:
        ax.scatter([], [], color=colors(groups.index(g) % 10), s=36, label=g)
    ax.legend(loc="upper left", fontsize=8)
    fig.text(0.6, 0.5, "\n".join(["check rows: modelled / published - 1"] + key),
             family="monospace", fontsize=7, va="center")
    return fig


# plan --explain's parts (planner.EXPLAIN's keys, in its order), short enough for a legend
STEP_PARTS = {"gemm": ("GEMMs (linear layers, logits)", "#2ca02c"),
              "attention_forward": ("attention forward", "#1f77b4"),
              "attention_backward": ("attention backward", "#aec7e8"),
              "elementwise": ("element-wise (norms, activations, loss...)", "#98df8a"),
              "launches": ("kernel launches", "#bcbd22"),
              "recompute": ("recompute", "#ff7f0e"),
              "optimizer": ("optimizer step", "#8c564b"),
              "tp_comm": ("exposed TP comm", "#9467bd"), "cp_comm": ("exposed CP comm", "#e377c2"),
              "ep_comm": ("exposed EP comm", "#17becf"), "pp_comm": ("exposed PP sends", "#c5b0d5"),
              "dp_comm": ("exposed DP/ZeRO comm", "#d62728"),
              "pp_bubble": ("pipeline bubble", "#c7c7c7"),
              "overlap_slowdown": ("SMs lent to hidden comm", "#dbdb8d")}
PUBLISHED_STYLE = dict(facecolor="white", edgecolor="0.35", hatch="///", linewidth=0.8)


def step_breakdown_figure(panels, fig=None):
    """Modelled steps split into their parts beside published step times, one panel per run.
    `panels`: [(title, [(bar label, bar)])], a bar either a plan's `explain_s` ({part:
    seconds}, drawn stacked in planner.EXPLAIN's order: modelled) or a number of seconds (one
    hatched bar: published). Each bar's total is written at its end; the parts zero in every
    bar stay out of the legend, which sits right of the panels. Returns the figure."""
    order = [k for k, _ in planner.EXPLAIN]
    unknown = {k for _, bars in panels for _, b in bars if isinstance(b, dict)
               for k in b} - set(order)
    if unknown:
        raise ValueError(f"step_breakdown_figure: parts {sorted(unknown)} are not "
                         f"planner.EXPLAIN's")
    rows = sum(len(bars) for _, bars in panels)
    fig = fig or plt.figure(figsize=(11, 1.2 + 0.55 * rows + 0.7 * len(panels)))
    axes = fig.subplots(len(panels), 1, squeeze=False,
                        gridspec_kw=dict(height_ratios=[len(b) for _, b in panels]))[:, 0]
    used = set()
    for ax, (title, bars) in zip(axes, panels):
        ax.labkit_totals = []
        for i, (_, bar) in enumerate(bars):
            y = -i
            if isinstance(bar, dict):
                left = 0.0
                for k in order:
                    if bar.get(k, 0.0) > 0:
                        ax.barh(y, bar[k], 0.6, left=left, color=STEP_PARTS[k][1],
                                edgecolor="white", linewidth=0.5)
                        used.add(k)
                        left += bar[k]
                total = left
            else:
                total = float(bar)
                ax.barh(y, total, 0.6, **PUBLISHED_STYLE)
            ax.labkit_totals.append(ax.text(total, y, f" {total:.2f} s", va="center",
                                            fontsize=8))
        ax.set_yticks([-i for i in range(len(bars))], [label for label, _ in bars],
                      fontsize=8)
        ends = [sum(b.values()) if isinstance(b, dict) else float(b) for _, b in bars]
        ax.set_xlim(0, max(ends) * 1.16)
        ax.set_ylim(-len(bars) + 0.4, 0.6)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        ax.set_title(title, fontsize=10, loc="left")
    axes[-1].set_xlabel("seconds per step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=STEP_PARTS[k][1]) for k in order if k in used]
    labels = [STEP_PARTS[k][0] for k in order if k in used]
    handles.append(plt.Rectangle((0, 0), 1, 1, **PUBLISHED_STYLE))
    labels.append("published step (no parts)")
    legend = fig.legend(handles, labels, loc="center right", bbox_to_anchor=(1.0, 0.5),
                        fontsize=8, frameon=False, title="a modelled step's parts",
                        title_fontsize=8, alignment="left")
    # the panels take what the legend leaves: its width measured, not guessed
    width = legend.get_window_extent(fig.canvas.get_renderer()).width / fig.bbox.width
    fig.tight_layout(rect=(0, 0, 0.99 - width, 1))
    fig.labkit_legend = legend
    return fig

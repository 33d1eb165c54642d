"""Lesson 05 figures and the MoE explorer: expert load, drops, padding, all-to-all time,
throughput.

`moe_explorer()` is built on `widgets.explorer` and `labkit.theory.moe` only (closed forms), so a
redraw takes milliseconds. `load_histogram` draws measured per-expert loads (before/after).
"""
from __future__ import annotations

import functools

import numpy as np

from ..theory import moe as tmoe
from .live import Drawing, neighbours, prefetch
from .plots import fmt
from .widgets import explorer

LINKS = {"NVLink 4 (in a node)": "NVLink 4", "InfiniBand NDR (between nodes)": "InfiniBand NDR",
         "InfiniBand HDR": "InfiniBand HDR", "PCIe 5 x16": "PCIe 5 x16"}


def load_histogram(loads, labels, capacity=None, ax=None, title="per-expert load (measured)"):
    """Grouped bars: assignments per expert for each run in `loads` (lists of E counts)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    experts = len(loads[0])
    width = 0.8 / len(loads)
    top = 0.0
    for i, (load, label) in enumerate(zip(loads, labels)):
        share = np.asarray(load, float) / np.sum(load)
        top = max(top, share.max())
        ax.bar(np.arange(experts) + (i - (len(loads) - 1) / 2) * width, share, width,
               label=f"{label} (max/mean {share.max() * experts:.2f})")
    ax.axhline(1 / experts, color="k", ls=":", lw=1, label="balanced")
    ax.set_xlabel("expert")
    ax.set_ylabel("share of assignments")
    ax.set_xticks(range(experts))
    ax.set_title(title)
    ax.set_ylim(0, top * 1.45)     # room above the bars for the legend
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    return ax


@functools.lru_cache(maxsize=1024)
def expected_drops(tokens, experts, top_k, capacity_factor, skew):
    """theory.moe.expected_tokens_dropped, remembered (a sum over every expert's overflow
    distribution: the slowest part of a redraw)."""
    return tmoe.expected_tokens_dropped(tokens, experts, top_k, capacity_factor, skew)


def _moe_numbers(experts=8, top_k=2, capacity_factor=1.25, ep=8, skew=0.5, link="NVLink 4",
                 tokens_per_gpu=4096, model="mixtral-8x7b"):
    """Expected per-expert load against capacity, and the summary line (HTML)."""
    capacity_factor, skew = round(capacity_factor, 4), round(skew, 4)
    tokens = tokens_per_gpu * ep                   # one routing group = the EP group's tokens
    shares = np.asarray(tmoe.skewed_shares(experts, skew))
    cap = tmoe.capacity(tokens, experts, top_k, capacity_factor)
    drops = expected_drops(tokens, experts, top_k, capacity_factor, skew)
    load = shares * tokens * top_k
    kept = np.minimum(load, cap)
    shape = tmoe.with_experts(model, experts, top_k)
    common = dict(gpus=ep, ep=ep, tokens_per_gpu=tokens_per_gpu, link=link)
    step = tmoe.moe_step(shape, capacity_factor=capacity_factor, **common)
    dropless = tmoe.moe_step(shape, **common)
    text = (f"expected dropped {drops['dropped']:.0f} of {drops['assignments']} assignments "
            f"({drops['fraction']:.1%}); padding: every expert computes its {cap} slots, "
            f"{step['expert_rows'] / (tokens_per_gpu * top_k):.2f}x the assignments "
            f"(expert FLOPs and all-to-all bytes); all-to-all {fmt(step['all_to_all_s'] * 1e3)} "
            f"ms of a {fmt(step['step_s'] * 1e3)} ms forward step ({step['bound']}-bound; "
            f"{fmt(dropless['step_s'] * 1e3)} ms without a capacity); throughput "
            f"{fmt(step['tokens_per_s'])} tokens/s on {ep} GPU(s). All modelled: "
            f"{shape.display_name} shapes, H100, fixed-shape dispatch")
    bars = dict(kept=(kept, 0), dropped=(np.clip(load - cap, 0, None), cap),
                padding=(cap - kept, kept))
    title = f"{experts} experts, top-{top_k}, EP {ep}, {tokens} tokens per routing group"
    return dict(bars=bars, cap=cap, top=max(load.max(), cap) * 1.45, title=title, text=text)


def explorer_figure(ax, **values):
    """Draw expected per-expert load against capacity (kept, dropped, padded slots); return
    the summary line (HTML): drops, the padding's cost and the step, all modelled."""
    numbers = _moe_numbers(**values)
    experts = len(numbers["bars"]["kept"][0])
    style = dict(kept=dict(color="tab:blue", label="expected assignments kept"),
                 dropped=dict(color="tab:red", alpha=0.6, hatch="//",
                              label="dropped (over capacity)"),
                 padding=dict(color="0.85", edgecolor="0.6",
                              label="padding (empty slots, computed and sent)"))
    ax.labkit_moe = [ax.bar(range(experts), height, bottom=bottom, **style[k])
                     for k, (height, bottom) in numbers["bars"].items()]
    ax.axhline(numbers["cap"], color="k", ls="--", lw=1, label=f"capacity {numbers['cap']} slots")
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments per step (modelled)")
    ax.set_title(numbers["title"], fontsize=10)
    ax.set_ylim(0, numbers["top"])    # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    return numbers["text"]


def update_explorer_figure(ax, **values):
    """explorer_figure's artists moved to new values (the same number of experts)."""
    numbers = _moe_numbers(**values)
    for container, (heights, bottoms) in zip(ax.labkit_moe, numbers["bars"].values()):
        bottoms = np.broadcast_to(bottoms, np.shape(heights))
        for rect, h, b in zip(container, heights, bottoms):
            rect.set_y(b)
            rect.set_height(h)
    ax.lines[0].set_ydata([numbers["cap"]] * 2)
    label = f"capacity {numbers['cap']} slots"
    ax.lines[0].set_label(label)
    for text in ax.get_legend().get_texts():
        if text.get_text().startswith("capacity "):
            text.set_text(label)
    ax.set_title(numbers["title"], fontsize=10)
    ax.set_ylim(0, numbers["top"])
    return numbers["text"]


class MoeDrawing(Drawing):
    """The MoE explorer in place: capacity, skew, link and tokens move the bars; a new number
    of experts (or an EP degree that does not divide them) draws again."""

    def shape(self, **values):
        return values["experts"], values["experts"] % values["ep"] == 0

    def build(self, fig, **values):
        ax = fig.add_subplot()
        if values["experts"] % values["ep"]:
            ax.text(0.5, 0.5, "EP degree must divide the number of experts", ha="center")
        else:
            explorer_figure(ax, **values)

    def update(self, fig, **values):
        if values["experts"] % values["ep"]:
            return ""
        v = dict(values, capacity_factor=round(values["capacity_factor"], 4))
        tokens = v["tokens_per_gpu"] * v["ep"]
        prefetch(expected_drops, [(tokens, v["experts"], v["top_k"], round(cf, 4),
                                   round(v["skew"], 4))
                                  for cf in neighbours(CAPACITY_STEPS, v["capacity_factor"])])
        return update_explorer_figure(fig.axes[0], **values)


CAPACITY_STEPS = [round(0.5 + 0.05 * i, 4) for i in range(51)]   # the slider's values


def moe_explorer():
    """Sliders: experts, top-k, capacity factor, EP degree, routing skew, link, tokens/GPU."""
    import ipywidgets as w
    style = dict(description_width="initial")
    controls = dict(
        experts=w.Dropdown(options=[4, 8, 16, 32, 64], value=8, description="experts",
                           style=style),
        top_k=w.Dropdown(options=[1, 2], value=2, description="top-k", style=style),
        capacity_factor=w.FloatSlider(value=1.25, min=0.5, max=3.0, step=0.05,
                                      description="capacity factor", style=style),
        ep=w.Dropdown(options=[1, 2, 4, 8, 16], value=8, description="EP degree", style=style),
        skew=w.FloatSlider(value=0.5, min=0.0, max=2.0, step=0.1, description="routing skew",
                           style=style),
        link=w.Dropdown(options=LINKS, value="NVLink 4", description="link", style=style),
        tokens_per_gpu=w.Dropdown(options=[1, 8, 64, 512, 4096], value=4096,
                                  description="tokens per GPU", style=style),
    )
    return explorer(controls, MoeDrawing())

"""Lesson 05 figures and the MoE explorer: expert load, drops, padding, all-to-all time,
throughput.

`moe_explorer()` is built on `widgets.explorer` and `labkit.theory.moe` only (closed forms), so a
redraw takes milliseconds. `load_histogram` draws measured per-expert loads (before/after).
"""
from __future__ import annotations

import numpy as np

from ..theory import moe as tmoe
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


def explorer_figure(ax, experts=8, top_k=2, capacity_factor=1.25, ep=8, skew=0.5,
                    link="NVLink 4", tokens_per_gpu=4096, model="mixtral-8x7b"):
    """Draw expected per-expert load against capacity (kept, dropped, padded slots); return
    the summary line (HTML): drops, the padding's cost and the step, all modelled."""
    tokens = tokens_per_gpu * ep                   # one routing group = the EP group's tokens
    shares = np.asarray(tmoe.skewed_shares(experts, skew))
    cap = tmoe.capacity(tokens, experts, top_k, capacity_factor)
    drops = tmoe.expected_tokens_dropped(tokens, experts, top_k, capacity_factor, skew)
    load = shares * tokens * top_k
    kept = np.minimum(load, cap)
    ax.bar(range(experts), kept, color="tab:blue", label="expected assignments kept")
    ax.bar(range(experts), np.clip(load - cap, 0, None), bottom=cap, color="tab:red",
           alpha=0.6, hatch="//", label="dropped (over capacity)")
    ax.bar(range(experts), cap - kept, bottom=kept, color="0.85", edgecolor="0.6",
           label="padding (empty slots, computed and sent)")
    ax.axhline(cap, color="k", ls="--", lw=1, label=f"capacity {cap} slots")
    ax.set_xlabel("expert")
    ax.set_ylabel("assignments per step (modelled)")
    ax.set_title(f"{experts} experts, top-{top_k}, EP {ep}, {tokens} tokens per routing group",
                 fontsize=10)
    ax.set_ylim(0, max(load.max(), cap) * 1.45)    # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    shape = tmoe.with_experts(model, experts, top_k)
    common = dict(gpus=ep, ep=ep, tokens_per_gpu=tokens_per_gpu, link=link)
    step = tmoe.moe_step(shape, capacity_factor=capacity_factor, **common)
    dropless = tmoe.moe_step(shape, **common)
    return (f"expected dropped {drops['dropped']:.0f} of {drops['assignments']} assignments "
            f"({drops['fraction']:.1%}); padding: every expert computes its {cap} slots, "
            f"{step['expert_rows'] / (tokens_per_gpu * top_k):.2f}x the assignments "
            f"(expert FLOPs and all-to-all bytes); all-to-all {fmt(step['all_to_all_s'] * 1e3)} "
            f"ms of a {fmt(step['step_s'] * 1e3)} ms forward step ({step['bound']}-bound; "
            f"{fmt(dropless['step_s'] * 1e3)} ms without a capacity); throughput "
            f"{fmt(step['tokens_per_s'])} tokens/s on {ep} GPU(s). All modelled: "
            f"{shape.display_name} shapes, H100, fixed-shape dispatch")


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

    def draw(ax, **v):
        if v["experts"] % v["ep"]:
            ax.text(0.5, 0.5, "EP degree must divide the number of experts", ha="center")
            return ""
        return explorer_figure(ax, **v)

    return explorer(controls, draw)

"""The network roofline drawn: a step's arithmetic intensity (FLOPs per byte sent) against the
tokens per GPU, with each link's ridge; and measured all-reduce times beside the alpha-beta
model. Draws what labkit.theory.roofline computes (all modelled, labelled so)."""
import matplotlib.pyplot as plt
import numpy as np

from ..theory import roofline
from ..theory.time import ring_steps, wire_bytes_per_rank

COLORS = {"dp": "#1f77b4", "fsdp": "#d62728", "tp": "#2ca02c"}
LABELS = {"dp": "DP (all-reduce 2Ψ)", "fsdp": "FSDP / ZeRO-3 (3Ψ)"}
LINK_STYLES = ("-", "--", ":")


def roofline_figure(gpus=64, gpu="H100", links=("NVLink 4", "InfiniBand NDR"),
                    techniques=("dp", "fsdp"), tp=None, batch_range=(1e2, 1e6), ax=None,
                    title=None):
    """Intensity vs tokens per GPU (log-log) for DP and FSDP on `gpus` GPUs, a horizontal ridge
    per link, each technique's critical batch marked on each ridge. tp: optional
    dict(hidden=, layer_params=, degrees=[...]) drawn as flat lines (TP's intensity has no B)."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(8.5, 4.8))
    else:
        fig = ax.figure
    batch = np.logspace(np.log10(batch_range[0]), np.log10(batch_range[1]), 60)
    for technique in techniques:
        curve = [roofline.intensity(technique, b, 1.0, gpus) for b in batch]
        starred = ", ".join(f"{roofline.critical_batch(technique, gpus, gpu, link):,.0f} "
                            f"({link})" for link in links)
        ax.loglog(batch, curve, color=COLORS[technique], lw=2,
                  label=f"{LABELS[technique]}: B* = {starred}")
    for style, link in zip(LINK_STYLES, links):
        line = roofline.ridge(gpu, link)
        ax.axhline(line, color="black", ls=style, lw=1)
        ax.text(batch[0] * 1.1, line * 1.12, f"ridge, {gpu} over {link}: {line:,.0f} FLOPs/B",
                fontsize=8)
        for technique in techniques:    # B*: where the curve crosses the ridge
            b = roofline.critical_batch(technique, gpus, gpu, link)
            ax.plot([b], [line], "o", color=COLORS[technique], ms=7, mec="black")
    for i, t in enumerate((tp or {}).get("degrees", ())):
        value = roofline.tp_intensity(tp["hidden"], tp["layer_params"], t)
        ax.axhline(value, color=COLORS["tp"], ls=LINK_STYLES[i % 3], lw=1.5, alpha=0.8,
                   label=f"TP={t}, h={tp['hidden']} (no batch in it)")
    ax.set_xlabel("tokens per GPU per step (B)")
    ax.set_ylabel("arithmetic intensity (FLOPs per byte sent)")
    ax.set_title(title or f"When can communication hide? {gpus} GPUs, bf16 (modelled, "
                          "bandwidth term)")
    ax.fill_between(batch, 1, [roofline.ridge(gpu, links[-1])] * len(batch), color="0.93",
                    zorder=0)
    ax.text(batch[-1] / 1.1, 2e2, "shaded: below the ridge, "
            f"the step waits for {links[-1]}", ha="right", fontsize=8, color="0.35")
    ax.set_ylim(1e2, 1e6)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    ax.grid(alpha=0.3, which="both", lw=0.4)
    fig.tight_layout()
    return fig


def all_reduce_fit_figure(sizes, seconds, alpha, beta, modelled=None, ax=None, title=None,
                          group_size=2):
    """Measured all-reduce seconds vs message bytes (points), the fitted alpha-beta line
    (2(n-1) alpha + 2(n-1)/n bytes / beta), and optionally `modelled` = {name: seconds per
    size} curves (e.g. NCCL on NVLink)."""
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4.4))
    else:
        fig = ax.figure
    sizes = np.asarray(sizes, dtype=float)
    ax.loglog(sizes, seconds, "o", color="#1f77b4",
              label=f"measured here (gloo, {group_size} CPU ranks)")
    fitted = [ring_steps("all_reduce", group_size) * alpha
              + wire_bytes_per_rank("all_reduce", s, group_size) / beta for s in sizes]
    ax.loglog(sizes, fitted, "-", color="#1f77b4",
              label=f"fit: α = {alpha * 1e6:,.0f} µs, β = {beta / 1e9:.2f} GB/s")
    for (name, curve), style in zip((modelled or {}).items(), ("--", ":", "-.")):
        ax.loglog(sizes, curve, style, color="#d62728", label=f"modelled: {name}")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("all-reduce time (s)")
    ax.set_title(title or "All-reduce time vs size: latency-bound, then bandwidth-bound")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(alpha=0.3, which="both", lw=0.4)
    fig.tight_layout()
    return fig

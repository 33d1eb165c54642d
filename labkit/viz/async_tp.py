"""Async TP's per-chunk timeline drawn: plain (all-gather, then the whole matmul) above async (each
chunk's matmul while the next chunk travels), from labkit.theory.async_tp (modelled, so
labelled)."""
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from ..theory import async_tp

COMPUTE, SEND, WAIT = "#2ca02c", "#1f77b4", "#d62728"
US = 1e6


def chunk_timeline(tokens=4096, in_features=8192, out_features=28672, tp=4, *,
                   cluster="8xH100-NVLink", dtype="bf16", ax=None, title=None):
    """Two rows of bars in microseconds for one colwise layer with sequence parallelism on `tp`
    GPUs: plain (the all-gather's t-1 ring steps, then t chunk matmuls) and async (chunk k's
    matmul under chunk k+1's message); the time each saves or waits is written on the right."""
    s = async_tp.all_gather_matmul(tokens, in_features, out_features, tp, cluster=cluster,
                                   dtype=dtype)
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 3.4))
    else:
        fig = ax.figure
    height = 0.32
    rows = {"plain: compute": 3, "plain: link": 2.6, "async: compute": 1.4, "async: link": 1.0}
    c, m = s["compute_s"] * US, s["send_s"] * US
    for k in range(tp - 1):      # plain: the ring all-gather's steps, then every chunk
        _bar(ax, rows["plain: link"], k * m, m, SEND, f"{k + 1}", height)
    gathered = (tp - 1) * m
    for k in range(tp):
        _bar(ax, rows["plain: compute"], gathered + k * c, c, COMPUTE, f"{k}", height)
    if gathered:
        ax.barh(rows["plain: compute"], gathered, left=0, height=height, color="none",
                edgecolor=WAIT, hatch="//", lw=0.8)
    done = 0.0
    for step in s["steps"]:
        start, end = (t * US for t in step["compute"])
        if start > done:   # the chunk is not here yet: compute waits
            ax.barh(rows["async: compute"], start - done, left=done, height=height,
                    color="none", edgecolor=WAIT, hatch="//", lw=0.8)
        done = end
        _bar(ax, rows["async: compute"], start, end - start, COMPUTE, f"{step['chunk']}", height)
        if step["send"] is not None:
            a, b = (t * US for t in step["send"])
            _bar(ax, rows["async: link"], a, b - a, SEND, f"{step['chunk'] + 1}", height)
    ax.text(s["plain_s"] * US, rows["plain: compute"], f"  {s['plain_s'] * US:.0f} µs",
            va="center", fontsize=9)
    ax.text(s["total_s"] * US, rows["async: compute"],
            f"  {s['total_s'] * US:.0f} µs ({s['hidden_s'] / s['comm_s']:.0%} of the "
            f"gather hidden)", va="center", fontsize=9)
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xlim(0, s["plain_s"] * US * 1.4)
    ax.set_xlabel("modelled time (µs)")
    ax.legend(handles=[Patch(color=COMPUTE, label="matmul of chunk k (compute)"),
                       Patch(color=SEND, label="chunk k arrives (NVLink message)"),
                       Patch(facecolor="none", edgecolor=WAIT, hatch="//",
                             label="compute waits")],
              loc="upper center", fontsize=8, ncol=3, bbox_to_anchor=(0.5, -0.3), frameon=False)
    ax.set_title(title or (f"MODELLED, {s['gpu']} over {s['link']}, tp={tp}: colwise "
                           f"{in_features}->{out_features} on {tokens} tokens ({dtype})"),
                 fontsize=10, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def _bar(ax, y, left, width, color, label, height):
    ax.barh(y, width, left=left, height=height, color=color, edgecolor="white", lw=1)
    ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=8, color="white")

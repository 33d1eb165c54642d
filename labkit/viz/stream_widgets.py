"""A request stream drawn (lesson 10): each request's life as a row (waiting for its first
token, then generating), the latency percentiles side by side, and an explorer over the
scheduler's knobs. It draws what it is handed: records {id, arrival_s, ttft_s, e2e_s} per run
(measured or modelled: the caller's label says which), and, for the explorer, a function that
serves a stream and returns such records."""
from __future__ import annotations

import matplotlib.pyplot as plt

WAIT, GENERATE = "#f4a261", "#2a9d8f"


def draw_timeline(ax, records, title):
    """One row per request: arrival -> first token (waiting + prefill), first -> last token."""
    for i, r in enumerate(sorted(records, key=lambda r: r["id"])):
        first = r["arrival_s"] + r["ttft_s"]
        ax.barh(i, r["ttft_s"] * 1e3, left=r["arrival_s"] * 1e3, color=WAIT, height=0.8)
        ax.barh(i, (r["e2e_s"] - r["ttft_s"]) * 1e3, left=first * 1e3, color=GENERATE,
                height=0.8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("ms since the start")
    ax.set_ylabel("request")
    ax.invert_yaxis()


def draw_percentiles(ax, summaries, key="ttft_s", label="TTFT"):
    """p50 and p99 of `key` for each run, grouped bars (ms)."""
    names = list(summaries)
    for j, q in enumerate(("p50", "p99")):
        values = [summaries[n]["latency"][key][q] * 1e3 for n in names]
        ax.bar([i + 0.4 * j for i in range(len(names))], values, width=0.4,
               label=q, color=("#8ab17d", "#e76f51")[j])
    ax.set_xticks([i + 0.2 for i in range(len(names))], names, fontsize=8)
    ax.set_ylabel(f"{label} (ms)")
    ax.legend(fontsize=8)


def stream_figure(runs, source="modelled", keys=(("ttft_s", "TTFT"), ("itl_s", "ITL"))):
    """runs: {label: (records, summary)}: a timeline per run and the percentiles compared."""
    n = len(runs)
    fig = plt.figure(figsize=(4.2 * n + 4, 4.6))
    grid = fig.add_gridspec(len(keys), n + 1, width_ratios=[1] * n + [0.9])
    first = None
    for i, (name, (records, _)) in enumerate(runs.items()):
        ax = fig.add_subplot(grid[:, i], sharex=first)   # one time axis: the panels compare
        draw_timeline(ax, records, name)
        first = first or ax
    summaries = {k: s for k, (_, s) in runs.items()}
    for row, (key, label) in enumerate(keys):
        if all(key in s["latency"] for s in summaries.values()):
            draw_percentiles(fig.add_subplot(grid[row, n]), summaries, key, label)
    fig.suptitle(f"each request: waiting for its first token (orange), then generating (green)"
                 f" - {source}", fontsize=10)
    fig.tight_layout()
    return fig


def stream_explorer(serve_stream):
    """Sliders over rate, max_num_seqs, max_num_batched_tokens and policy; serve_stream(policy=,
    rate=, max_num_seqs=, max_num_batched_tokens=) -> (records, summary) is called on every
    change and drawn (the budget with chunked prefill; "none": no cap, whole prompts)."""
    import ipywidgets as widgets
    from .widgets import figure_explorer
    wide = dict(style={"description_width": "initial"})   # vLLM's names, whole
    controls = dict(
        policy=widgets.ToggleButtons(options=["static", "continuous"], value="continuous",
                                     description="policy"),
        rate=widgets.SelectionSlider(options=[25, 50, 100, 200, 400, 800], value=100,
                                     description="req/s"),
        max_num_seqs=widgets.SelectionSlider(options=[1, 2, 4, 8, 16], value=8,
                                             description="max_num_seqs", **wide),
        max_num_batched_tokens=widgets.SelectionSlider(
            options=["none", 16, 32, 64, 128, 256], value="none",
            description="max_num_batched_tokens", **wide))

    def draw(fig, policy, rate, max_num_seqs, max_num_batched_tokens):
        budget = None if max_num_batched_tokens == "none" else max(max_num_batched_tokens,
                                                                   max_num_seqs)
        records, summary = serve_stream(policy=policy, rate=rate, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=budget)
        grid = fig.add_gridspec(2, 2, width_ratios=[1.6, 1])
        draw_timeline(fig.add_subplot(grid[:, 0]), records, f"{policy}, {rate} req/s")
        draw_percentiles(fig.add_subplot(grid[0, 1]), {"this": summary}, "ttft_s", "TTFT")
        draw_percentiles(fig.add_subplot(grid[1, 1]), {"this": summary}, "itl_s", "ITL")
        lat = summary["latency"]
        return (f"modelled: p99 TTFT {lat['ttft_s']['p99'] * 1e3:.1f} ms, p99 ITL "
                f"{lat['itl_s']['p99'] * 1e3:.1f} ms, "
                f"{summary['throughput_tokens_per_s']:.0f} output tokens/s")
    return figure_explorer(controls, draw, figsize=(11, 5))

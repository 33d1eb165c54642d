"""Serving drawn (lesson 09): the same GPUs as tensor parallel, pipeline, replicas or experts,
their modelled time per output token, time to first token, throughput and memory per GPU, and
the decode roofline. Everything here is *modelled* by `labkit.theory.serving`; labels say so.
"""
from __future__ import annotations

import functools

import matplotlib.pyplot as plt

from ..theory import catalog, hardware
from ..theory import serving as theory
from .live import Drawing
from .plots import memory_stack, restack, retime, stack_shape, time_shape, time_split

NEW_TOKENS = 256
LAYOUTS = ("1 GPU", "TP", "PP", "replicas", "EP")
TPOT_COLORS = {"memory-bound step": "#64b5cd", "compute-bound step": "#2ca02c",
               "kernel launches": "#ff7f0e", "TP all-reduces": "#9467bd",
               "EP all-to-alls": "#e377c2", "pipeline hand-offs": "#dcdcdc"}
MEMORY_KEEP = ("weights", "kv_cache", "activations")
SHORT = {"1 GPU": "1\nGPU", "TP": "TP\n{g}", "PP": "PP\n{g}", "replicas": "{g}\nrepl.",
         "EP": "EP\n{g}"}
EXPLORER_GPUS = {"H100 SXM": "H100", "H200 SXM": "H200", "A100 SXM 80GB": "A100", "B200": "B200"}


def layouts(model, gpus):
    """{name: layout kwargs or None (not possible)} for the explorer's fixed pool of layouts."""
    m = catalog.model(model)
    moe = m.experts > 1 and m.experts % gpus == 0
    tp_ok = m.heads % gpus == 0 and (m.kv_heads % gpus == 0 or gpus % m.kv_heads == 0)
    return {"1 GPU": dict(),
            "TP": dict(tp=gpus) if gpus > 1 and tp_ok else None,
            "PP": dict(pp=gpus) if 1 < gpus <= m.layers else None,
            "replicas": dict(replicas=gpus) if gpus > 1 else None,
            "EP": dict(ep=gpus) if gpus > 1 and moe else None}


@functools.lru_cache(maxsize=512)
def compare(model, gpus, gpu, batch, context, weights):
    """Modelled serving of `batch` requests (prompt `context`, NEW_TOKENS new) per layout."""
    out = {}
    for name, layout in layouts(model, gpus).items():
        if layout is None:
            out[name] = None
            continue
        t = theory.serving_time(model, gpu=gpu, batch=batch, prompt_len=context,
                                new_tokens=NEW_TOKENS, weights=weights, **layout)
        out[name] = t
    return out


def _label(name, t, gpus):
    if name == "1 GPU":
        return "1 GPU"
    if t is None:
        return f"{name} ×{gpus}: n/a"
    return {"TP": f"TP {gpus}", "PP": f"PP {gpus}", "replicas": f"{gpus} replicas",
            "EP": f"EP {gpus}"}[name]


def tpot_terms(t):
    """serving_time's TPOT as the terms that add up to it ({name: seconds}): the step is the
    larger of its compute and memory times, then the launches and the communication."""
    if t is None:
        return {k: 0.0 for k in TPOT_COLORS}
    d = t["decode_breakdown_s"]
    step = max(d["compute"], d["memory"])
    parts = {"memory-bound step": step if d["memory"] >= d["compute"] else 0.0,
             "compute-bound step": step if d["compute"] > d["memory"] else 0.0,
             "kernel launches": d["launch"], "TP all-reduces": d["tp_comm"],
             "EP all-to-alls": d["ep_comm"]}
    parts["pipeline hand-offs"] = d["pp_hops"]   # every stage's time is in the step already
    return parts


def _panels(model, gpus, gpu, batch, context, weights):
    results = compare(model, gpus, gpu, batch, context, weights)
    labels = {name: _label(name, results[name], gpus) for name in LAYOUTS}
    tpot = {labels[n]: tpot_terms(results[n]) for n in LAYOUTS}
    memory = {SHORT[n].format(g=gpus if results[n] else "n/a"): (
        {k: results[n]["memory_bytes"][k] for k in MEMORY_KEEP} if results[n]
        else {k: 0.0 for k in MEMORY_KEEP}) for n in LAYOUTS}
    usable = hardware.gpu(gpu).memory_bytes - theory.RESERVED_BYTES
    return results, labels, tpot, memory, usable


class ServingDrawing(Drawing):
    """Four panels with a fixed shape (five layouts, fixed categories): a new control value
    moves the bars. TPOT split (top left), memory per GPU (top right), TTFT and throughput
    per GPU (bottom)."""

    def shape(self, model, gpus, gpu, batch, context, weights):
        self.data = _panels(model, gpus, gpu, batch, context, weights)
        _, _, tpot, memory, usable = self.data
        return time_shape(tpot), stack_shape(memory, {"usable": usable}, "GB", MEMORY_KEEP)

    def build(self, fig, **values):
        _, labels, tpot, memory, usable = self.data
        axes = fig.subplots(2, 2, gridspec_kw=dict(width_ratios=[1.2, 1]))
        for ax in axes.flat:
            # A title given a y is placed there from then on, not moved clear of top ticks or a
            # y offset text (none here: ticks below, plain numbers), which would measure every
            # tick label of the y axis at each paint: a tenth of a step's time.
            ax.set_title("", y=1.0)
        time_split(tpot, ax=axes[0, 0], colors=TPOT_COLORS, hide_zero=True)
        memory_stack(memory, {"usable": usable}, ax=axes[0, 1], keep=MEMORY_KEEP)
        y = [-i for i in range(len(LAYOUTS))]
        self.ttft = axes[1, 0].barh(y, [0] * len(y), 0.6, color="#ff7f0e")
        self.speed = axes[1, 1].barh(y, [0] * len(y), 0.6, color="#2ca02c")
        self.value_texts = [[ax.text(0, yi, "", va="center", fontsize=8) for yi in y]
                            for ax in (axes[1, 0], axes[1, 1])]
        for ax, xlabel in ((axes[1, 0], "ms"), (axes[1, 1], "tokens/s per GPU")):
            ax.grid(axis="x", alpha=0.3)
            ax.set_xlabel(xlabel)
        self.names = None   # the bottom panels' layout names, set when they change

    def update(self, fig, model, gpus, gpu, batch, context, weights):
        results, labels, tpot, memory, usable = self.data
        tl, tr, bl, br = fig.axes[:4]
        retime(tl, tpot, title=f"time per output token (modelled), batch {batch}; pale: does "
               "not fit", unit="ms", hide_zero=True)
        tl.set_xlabel("ms per generated token")
        restack(tr, memory, {"usable": usable}, title=f"memory per {gpu} (modelled)",
                keep=MEMORY_KEEP)
        names = [labels[n] for n in LAYOUTS]
        ttft = [results[n]["ttft_s"] * 1e3 if results[n] else 0.0 for n in LAYOUTS]
        speed = [results[n]["tokens_per_s_per_gpu"] if results[n] else 0.0 for n in LAYOUTS]
        fits = [bool(results[n]) and results[n]["memory_bytes"]["total"] <= usable
                for n in LAYOUTS]
        alphas = [1.0 if ok else 0.35 for ok in fits]   # a layout that does not fit: pale
        for container in tl.labkit_split:
            _set_alphas(container, alphas)
        for ax, bars, values, texts, fmt, title in (
                (bl, self.ttft, ttft, self.value_texts[0], "{:,.0f} ms",
                 f"time to first token (modelled), prompt {context}"),
                (br, self.speed, speed, self.value_texts[1], "{:,.0f}",
                 f"output tokens/s per GPU (modelled, {NEW_TOKENS} new)")):
            top = max(values + [1e-9])
            _set_alphas(bars, alphas)
            for rect, text, v, ok, n in zip(bars, texts, values, fits, LAYOUTS):
                rect.set_width(v)
                text.set_x(v + 0.01 * top)
                text.set_text("" if results[n] is None else
                              fmt.format(v) + ("" if ok else " (does not fit)"))
            ax.set_xlim(0, top * 1.45)
            if names != self.names:
                ax.set_yticks([-i for i in range(len(names))], names)
            ax.set_title(title, fontsize=10)
        self.names = names
        best = max((n for n in LAYOUTS if results[n] and fits[LAYOUTS.index(n)]),
                   key=lambda n: results[n]["tokens_per_s_per_gpu"], default=None)
        fast = min((n for n in LAYOUTS if results[n] and fits[LAYOUTS.index(n)]),
                   key=lambda n: results[n]["tpot_s"], default=None)
        if best is None:
            return f"<b>nothing fits</b> one {gpu} at {weights}: more GPUs or fewer bits"
        return (f"modelled: lowest latency <b>{labels[fast]}</b> "
                f"({results[fast]['tpot_s'] * 1e3:.1f} ms/token); most tokens per GPU "
                f"<b>{labels[best]}</b> ({results[best]['tokens_per_s_per_gpu']:,.0f}/s)")


def _set_alphas(bars, alphas):
    """Each bar's alpha, set only where it changes (a set converts colours, marks stale)."""
    for rect, alpha in zip(bars, alphas):
        if rect.get_alpha() != alpha:
            rect.set_alpha(alpha)


def serving_figure(model="Llama 3 8B", gpus=4, gpu="H100 SXM", batch=16, context=2048,
                   weights="bf16"):
    """The explorer's figure for one setting, outside an explorer (a static lesson figure)."""
    fig = plt.figure(figsize=(12, 6.6))
    ServingDrawing().draw_on(fig, model=model, gpus=gpus, gpu=gpu, batch=batch,
                             context=context, weights=weights)
    return fig


def serving_explorer():
    """Model, GPUs, GPU kind, batch, context and weight precision -> the layouts compared."""
    import ipywidgets as widgets
    from .widgets import figure_explorer
    names = [m.display_name for m in catalog.models() if m.arch != "unet"]
    controls = dict(
        model=widgets.Dropdown(options=names, value="Llama 3 70B", description="model"),
        gpus=widgets.SelectionSlider(options=[2, 4, 8, 16], value=8, description="GPUs"),
        gpu=widgets.Dropdown(options=list(EXPLORER_GPUS), value="H100 SXM",
                             description="GPU"),
        batch=widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=16,
                                      description="batch"),
        context=widgets.SelectionSlider(options=[512, 1024, 2048, 4096, 8192, 32768],
                                        value=2048, description="prompt"),
        weights=widgets.Dropdown(options=list(theory.WEIGHTS), value="bf16",
                                 description="weights"))
    return figure_explorer(controls, ServingDrawing(), figsize=(12, 6.6))


def roofline_figure(model="Llama 3 70B", gpus=("H100", "H200", "A100"), contexts=(0, 4096),
                    ax=None):
    """Decode arithmetic intensity vs batch (FLOP per byte read), with each GPU's ridge
    (peak x achievable / HBM bandwidth): left of the knee a step is memory-bound."""
    fig, ax = (plt.subplots(figsize=(7.5, 4.4)) if ax is None else (ax.figure, ax))
    batches = [2 ** k for k in range(0, 13)]
    for context, style in zip(contexts, ("-", "--")):
        ax.plot(batches, [theory.decode_intensity(model, b, context) for b in batches], style,
                color="#1f77b4", marker="o", markersize=3,
                label=f"decode, context {context}" if context else "decode, no cache")
    colors = ("#d62728", "#2ca02c", "#9467bd", "#8c564b")
    for g, color in zip(gpus, colors):
        ridge = theory.ridge_intensity(g)
        ax.axhline(ridge, color=color, linestyle=":", linewidth=1.2,
                   label=f"{hardware.gpu(g).name} ridge: {ridge:.0f} FLOP/B "
                         f"(knee batch {theory.knee_batch(model, g)}, no cache)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests decoded together (batch)")
    ax.set_ylabel("FLOP per byte read from HBM")
    ax.set_title(f"{catalog.model(model).display_name}, bf16 weights: the decode roofline "
                 "(modelled)", fontsize=10)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig


def host_figure(model="Llama 3 8B", gpu="H100", prompts=None, batch=1, weights="fp8", ax=None):
    """Modelled TTFT against prompt length with CUDA graphs (the host hidden) and enqueued
    kernel by kernel (the host's ENQUEUE_S a kernel: pricing.step_total): a short prompt waits
    for the host, a long one keeps the GPU busier than the host, and the two lines meet."""
    fig, ax = (plt.subplots(figsize=(7.5, 4.2)) if ax is None else (ax.figure, ax))
    prompts = prompts or [2 ** k for k in range(4, 14)]
    ttft = {e: [theory.serving_time(model, gpu=gpu, batch=batch, prompt_len=p, new_tokens=1,
                                    weights=weights, kv_dtype=weights if weights == "fp8"
                                    else "bf16", execution=e)["ttft_s"] * 1e3 for p in prompts]
            for e in ("graph", "enqueue")}
    ax.plot(prompts, ttft["graph"], "-o", markersize=3, color="#2ca02c",
            label="CUDA graph replayed: the GPU's time")
    ax.plot(prompts, ttft["enqueue"], "--s", markersize=3, color="#d62728",
            label="enqueued kernel by kernel: max(GPU, host)")
    host = [p for p, g, e in zip(prompts, ttft["graph"], ttft["enqueue"]) if e > g]
    if host:
        ax.axvspan(prompts[0], host[-1], color="#d62728", alpha=0.08,
                   label=f"host-bound (up to {host[-1]:,} tokens)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(prompts[::2], [f"{p:,}" for p in prompts[::2]])
    ax.set_xlabel(f"prompt tokens (batch {batch})")
    ax.set_ylabel("time to first token, ms (modelled)")
    ax.set_title(f"{catalog.model(model).display_name}, {weights} weights, one "
                 f"{hardware.gpu(gpu).name}: who waits for whom (modelled)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig

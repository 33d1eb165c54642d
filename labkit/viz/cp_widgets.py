"""Lesson 08's figures and explorer: context parallelism on a real model, all modelled by theory.

Sequence length, CP degree and layout -> three panels: memory per GPU of one sequence on a CP
group (labkit.theory.planner with cp, tp = pp = 1 fixed; ZeRO-1 over the CP ranks), each rank's
share of the causal attention work, and the forward ring of one attention layer as a Gantt
chart (labkit.theory.context_parallel.ring_schedule on H100s, transfers overlapped).
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..theory import catalog, hardware, planner
from ..theory import context_parallel as tcp
from .live import Drawing
from .plots import TIME_UNITS, fmt, memory_stack, pick_time_unit, restack, stack_shape
from .timeline import gantt
from .widgets import explorer_models, figure_explorer

SEQ_CHOICES = [2 ** k for k in range(13, 21)]      # 8K ... 1M tokens
CP_CHOICES = (1, 2, 4, 8, 16)
CATEGORIES = ("params", "grads", "optimizer", "activations")


def cp_memory(model="Llama 3 8B", seq=131072, cp=8, recompute=None, gpu="H100"):
    """The planner's memory per GPU (bytes by category) and plan for one sequence of `seq`
    tokens on a CP group of `cp` GPUs (tp = pp = dp = 1, ZeRO-1 over the CP ranks; the
    fastest recompute choice that fits unless `recompute` fixes it)."""
    fix = dict(cp=cp, tp=1, pp=1, dp=1, micro_batch_size=1, zero_stage=1)
    if recompute:
        fix["recompute"] = recompute
    out = planner.plan(catalog.model(model).name, cp, gpu, global_batch=1, seq=seq, fix=fix,
                       top=1)
    best = out["plans"][0]
    return {k: best["memory_bytes"][k] for k in CATEGORIES}, best


def memory_vs_seq(ax, model="Llama 3 8B", cps=(1, 2, 4, 8), seqs=SEQ_CHOICES,
                  recompute="full", gpu="H100"):
    """Modelled memory per GPU against sequence length, one line per CP degree."""
    capacity = hardware.gpu(gpu).memory_bytes
    for cp in cps:
        totals = [sum(cp_memory(model, s, cp, recompute, gpu)[0].values()) / 1e9
                  if s % (2 * cp) == 0 else float("nan") for s in seqs]
        ax.plot(seqs, totals, marker="o", label=f"CP={cp}")
    ax.axhline(capacity / 1e9, color="black", ls="--", lw=1,
               label=f"{gpu}: {fmt(capacity / 1e9)} GB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seqs, [f"{s // 1024}K" for s in seqs])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("GB per GPU (modelled)")
    ax.set_title(f"{model}: memory per GPU, one sequence\n(modelled: bf16 + fp32 Adam, ZeRO-1, "
                 f"recompute={recompute}, FlashAttention)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def work_bars(ax, cp=8, layout="zigzag"):
    """Each rank's share of the causal attention work (theory.causal_work), mean dashed."""
    work = tcp.causal_work(cp, layout)
    ax.bar(range(cp), [w * cp for w in work], color="#2ca02c" if layout == "zigzag"
           else "#d62728", width=0.6)
    ax.axhline(1.0, color="black", ls="--", lw=1, label="mean")
    ax.set_xticks(range(cp), [str(r) for r in range(cp)])
    ax.set_xlabel("rank")
    ax.set_ylabel("causal attention work / mean")
    ax.set_ylim(0, 2.1)
    ax.set_title(f"work per rank, {layout} (modelled)\nslowest = "
                 f"{tcp.imbalance(work):.2f} x mean", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    return ax


def ring_gantt(ax, model="Llama 3 8B", seq=131072, cp=8, layout="zigzag", overlap=True):
    """One attention layer's forward ring (batch 1) on H100s as a Gantt chart: NVLink inside
    one 8-GPU node; a larger ring crosses nodes, so its slowest hop is InfiniBand."""
    m = catalog.model(model)
    link = "NVLink 4" if cp <= 8 else "InfiniBand NDR"
    sched = tcp.ring_schedule(1, m.heads, seq, m.hidden // m.heads, cp, layout,
                              kv_heads=m.kv_heads, link=link, overlap=overlap)
    gantt(sched["events"], ax=ax, title=f"one attention layer's forward ring, {layout}, "
          f"{seq // 1024}K tokens, CP={cp} (H100, {link}, modelled)")
    return sched


def _cp_numbers(model="Llama 3 8B", seq=131072, cp=8, layout="zigzag"):
    """The memory bars, plans and forward ring for one choice (modelled), and the summary."""
    if seq % (2 * cp):
        return None
    bars, plans = {}, {}
    for label, rc in (("no recompute", "none"), ("full recompute", "full")):
        bars[f"CP={cp}\n{label}"], plans[rc] = cp_memory(model, seq, cp, rc)
    m = catalog.model(model)
    link = "NVLink 4" if cp <= 8 else "InfiniBand NDR"
    sched = tcp.ring_schedule(1, m.heads, seq, m.hidden // m.heads, cp, layout,
                              kv_heads=m.kv_heads, link=link, overlap=True)
    fits = [rc for rc, p in plans.items() if p["fits"]]
    total = {rc: sum(b.values()) / 1e9 for rc, b in zip(plans, bars.values())}
    gpu = hardware.gpu("H100")
    return dict(
        stack=dict(bars=bars, capacity={"H100 80 GB": gpu.memory_bytes}, unit="GB",
                   title=f"memory per GPU, {seq // 1024}K tokens (modelled)"),
        sched=sched, title=(f"one attention layer's forward ring, {layout}, {seq // 1024}K "
                            f"tokens, CP={cp} (H100, {link}, modelled)"),
        text=(f"{model}, {seq // 1024}K tokens on CP={cp} ({layout}): "
              f"{fmt(total['none'])} GB per GPU without recompute, {fmt(total['full'])} GB "
              f"with full recompute (modelled; fits an H100 with: "
              f"{', '.join(fits) or 'neither'}); one layer's forward attention "
              f"{fmt(sched['time_s'] * 1e3)} ms, the slowest rank does "
              f"<b>{tcp.imbalance(tcp.causal_work(cp, layout)):.2f}x</b> the mean work"))


def regantt(ax, events, title):
    """Move `timeline.gantt`'s bars on `ax` (one per event, in order) to new times of the
    same events: bars, time unit, limits and title."""
    t_max = max([float(e["end"]) for e in events] + [0.0])
    unit = pick_time_unit(t_max)
    scale = TIME_UNITS[unit]
    bars = [rect for container in ax.containers for rect in container]
    for rect, e in zip(bars, events):
        rect.set_x(float(e["start"]) / scale)
        rect.set_width((float(e["end"]) - float(e["start"])) / scale)
    # the bars' span is the data's x extent (what relim would find, without measuring
    # every patch again); autoscale adds gantt's margins
    ax.dataLim.intervalx = (min(float(e["start"]) for e in events) / scale,
                            max(float(e["end"]) for e in events) / scale)
    ax.autoscale_view(scaley=False)
    ax.set_xlabel(f"modelled time ({unit})")
    ax.set_title(title)


class CpDrawing(Drawing):
    """cp_panels built once per (model, CP degree, layout, categories); a new sequence
    length moves the memory bars and the ring's bars in place."""

    def shape(self, model, seq, cp, layout):
        self.d = _cp_numbers(model, seq, cp, layout)
        if self.d is None:
            return "does not split"
        stack = self.d["stack"]
        return (model, cp, layout, len(self.d["sched"]["events"]),
                stack_shape(stack["bars"], stack["capacity"], stack["unit"]))

    def build(self, fig, model, seq, cp, layout):
        grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.1])
        mem_ax, work_ax, gantt_ax = (fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]),
                                     fig.add_subplot(grid[1, :]))
        if self.d is None:
            return
        memory_stack(ax=mem_ax, **self.d["stack"])
        mem_ax.legend(fontsize=7, loc="upper right")
        work_bars(work_ax, cp, layout)
        gantt(self.d["sched"]["events"], ax=gantt_ax, title=self.d["title"])
        fig.tight_layout()

    def update(self, fig, model, seq, cp, layout):
        if self.d is None:
            return f"{seq} tokens do not split into 2 x {cp} chunks"
        restack(fig.axes[0], **self.d["stack"])
        regantt(fig.axes[2], self.d["sched"]["events"], self.d["title"])
        return self.d["text"]


def cp_panels(fig, model="Llama 3 8B", seq=131072, cp=8, layout="zigzag"):
    """The explorer's three modelled panels on `fig`; returns the summary line (HTML)."""
    fig.clf()
    return CpDrawing().draw_on(fig, tight=False, model=model, seq=seq, cp=cp, layout=layout)


def cp_explorer(model="Llama 3 8B"):
    """The widget: sequence length, CP degree and layout over cp_panels (theory only)."""
    import ipywidgets as widgets

    controls = dict(
        model=widgets.Dropdown(options=explorer_models(), value=model, description="model"),
        seq=widgets.SelectionSlider(options=SEQ_CHOICES, value=131072, description="seq len"),
        cp=widgets.SelectionSlider(options=CP_CHOICES, value=8, description="CP degree"),
        layout=widgets.ToggleButtons(options=["contiguous", "zigzag"], value="zigzag",
                                     description="layout"),
    )
    return figure_explorer(controls, CpDrawing(), figsize=(13, 8))


def cp_figure(**kwargs):
    """cp_panels on a new figure (for a static cell or a saved PNG)."""
    fig = plt.figure(figsize=(13, 8))
    fig.labkit_summary = cp_panels(fig, **kwargs)
    return fig

"""Lesson 03's explorer: a real model under tensor parallelism, all modelled by labkit.theory.

Model, TP degree, sequence parallel on/off, link, batch and sequence length -> three panels:
memory per GPU by category (mixed-precision Adam training), the bytes each GPU sends per step,
and the step time split into compute and exposed communication.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

from ..theory import catalog, hardware
from ..theory import tensor_parallel as ttp
from .live import Drawing
from .plots import fmt, memory_stack, restack, retime, stack_shape, time_shape, time_split
from .widgets import explorer, explorer_models

LINKS = {"NVLink 4 (inside a node)": "NVLink 4", "InfiniBand NDR (across nodes)": "InfiniBand NDR",
         "PCIe 5 x16 (no NVLink)": "PCIe 5 x16"}
ACROSS_NODES = ("InfiniBand NDR (across nodes)",)   # the links a TP group beyond 8 GPUs has
TP_CHOICES = (1, 2, 4, 8, 16)


def _tp_numbers(model="Llama 3 70B", tp=8, sequence_parallel=False, link="NVLink 4",
                batch=1, seq=4096):
    """What the three panels show for one choice (modelled), and the summary line."""
    m = catalog.model(model)
    note = ""
    if tp > 8 and link.startswith("NVLink"):  # an NVLink domain is one 8-GPU node
        link, note = "InfiniBand NDR", " (TP > 8 spans nodes, so the link is InfiniBand)"
    bars = {}
    # two-line labels: three bars share a narrow panel, "TP=16 + SP" would run into "TP=16"
    for label, t, sp in (("TP=1", 1, False), (f"TP={tp}", tp, False),
                         (f"TP={tp}\n+ SP", tp, True)):
        parts = ttp.training_memory_per_gpu(m, t, batch=batch, seq=seq, sequence_parallel=sp)
        bars[label] = {k: parts[k] for k in ("params", "grads", "optimizer", "activations")}
    per_op = {}
    for r in ttp.block_comm(batch, seq, m.hidden, tp, sequence_parallel=sequence_parallel):
        per_op[r["op"]] = per_op.get(r["op"], 0.0) + m.layers * r["wire_bytes_per_rank"]
    names = list(per_op) or ["none (TP=1)"]
    timing = ttp.step_time(m, tp, batch=batch, seq=seq, link=link,
                           sequence_parallel=sequence_parallel, cluster=ttp.cluster_for(tp))
    one = ttp.step_time(m, 1, batch=batch, seq=seq)
    total = sum(bars[f"TP={tp}" + ("\n+ SP" if sequence_parallel else "")].values())
    extra = ", incl. SP's backward regathers" if sequence_parallel else ""
    return dict(
        stack=dict(bars=bars, capacity={"H100 80 GB": hardware.gpu("H100").memory_bytes},
                   unit="GB", title="memory per GPU (modelled,\nbf16 + fp32 Adam)"),
        names=names, comm=[per_op.get(n, 0.0) / 1e9 for n in names],
        comm_title=f"communication per step (modelled)\n{m.layers} layers, ring{extra}",
        split=dict(rows={"TP=1": dict(compute=one["compute"], exposed_comm=0.0),
                         f"TP={tp}\n{link}": dict(compute=timing["compute"],
                                                  exposed_comm=timing["exposed_comm"])},
                   unit="s" if timing["total"] >= 1 else "ms",
                   title=f"step time, modelled (H100, in-step GEMM rate)\n"
                         f"batch {batch} x {seq} tokens"),
        text=(f"{m.display_name}, TP={tp}{' + SP' if sequence_parallel else ''} over {link}: "
              f"<b>{fmt(total / 1e9)} GB</b> per GPU, step {fmt(timing['total'] * 1e3)} ms "
              f"(modelled), of which exposed communication "
              f"<b>{timing['exposed_share']:.0%}</b>; speedup over one GPU "
              f"{one['total'] / timing['total']:.1f}x{note}"))


class TpDrawing(Drawing):
    """tp_panels built once per shape (categories, comm ops); other changes move the bars."""

    def shape(self, **values):
        self.d = _tp_numbers(**values)
        return stack_shape(**{k: self.d["stack"][k] for k in ("bars", "capacity", "unit")}), \
            tuple(self.d["names"]), time_shape(self.d["split"]["rows"])

    def build(self, fig, **values):
        d = self.d
        mem_ax, comm_ax, time_ax = fig.subplots(1, 3,
                                                gridspec_kw=dict(width_ratios=[1.1, 1, 1.4]))
        memory_stack(ax=mem_ax, **d["stack"])
        mem_ax.legend(fontsize=7, loc="upper right")
        self.comm_bars = comm_ax.bar(d["names"], d["comm"], color="#9467bd", width=0.5)
        comm_ax.set_ylabel("GB sent per GPU per step")
        comm_ax.grid(axis="y", alpha=0.3)
        time_split(ax=time_ax, **d["split"])
        fig.tight_layout()

    def update(self, fig, **values):
        d = self.d
        mem_ax, comm_ax, time_ax = fig.axes[:3]
        restack(mem_ax, **d["stack"])
        for rect, h in zip(self.comm_bars, d["comm"]):
            rect.set_height(h)
        comm_ax.set_ylim(0, 1.05 * max(d["comm"]) or 1)
        comm_ax.set_title(d["comm_title"], fontsize=10)
        retime(time_ax, **d["split"])
        return d["text"]


def tp_panels(fig, **values):
    """Draw the three modelled panels on `fig` (cleared first); return a one-line summary
    (HTML). Arguments: model, tp, sequence_parallel, link, batch, seq."""
    fig.clf()
    return TpDrawing().draw_on(fig, **values)


def tp_explorer():
    """The widget: dropdowns and sliders over tp_panels (theory only: redraws in ms)."""
    import ipywidgets as widgets

    names = explorer_models()
    controls = dict(
        model=widgets.Dropdown(options=names, value="Llama 3 70B", description="model"),
        tp=widgets.SelectionSlider(options=TP_CHOICES, value=8, description="TP degree"),
        sequence_parallel=widgets.Checkbox(value=False, description="sequence parallel"),
        link=widgets.Dropdown(options=list(LINKS), value=list(LINKS)[0], description="link"),
        batch=widgets.IntSlider(value=1, min=1, max=16, description="batch"),
        seq=widgets.SelectionSlider(options=[1024, 2048, 4096, 8192, 16384], value=4096,
                                    description="seq"),
    )

    def on_tp(change):  # an NVLink domain is one 8-GPU node: beyond it only InfiniBand
        link, chosen = controls["link"], controls["link"].value
        link.options = [k for k in LINKS if change["new"] <= 8 or k in ACROSS_NODES]
        link.value = chosen if chosen in link.options else link.options[0]


    class Explorer(TpDrawing):   # the link control names a link by its long label
        def shape(self, link, **values):
            return super().shape(link=LINKS[link], **values)

    return explorer(controls, Explorer(), figsize=(14, 4.4), linked=[("tp", on_tp)])


def tp_figure(**kwargs):
    """tp_panels on a new figure (for a static cell or a saved PNG)."""
    fig = plt.figure(figsize=(14, 4.4))
    fig.labkit_summary = tp_panels(fig, **kwargs)
    return fig

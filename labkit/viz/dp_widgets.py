"""Lesson 01's explorer: data parallelism on a modelled H100 cluster, from `labkit.theory`.

Controls: GPUs, a catalog model, the global batch (tokens), the gradient bucket size and the
links. Three panels, all *modelled* (theory.time.dp_step_time, alpha-beta ring all-reduce):
the step split into compute and exposed communication (with and without overlap), the
strong-scaling speedup curve, and the bytes each GPU sends per step, 2(N-1)/N x gradient bytes.
Every replica holds the whole model's states (mixed-precision Adam: 16 bytes per parameter), so
a point where they exceed the GPU's memory is drawn hollow: plain data parallelism cannot run it.
"""
from __future__ import annotations

import math

from ..theory import catalog, hardware
from ..theory import time as tt
from ..theory.memory import dtype_bytes, model_state_bytes
from .live import Drawing
from .plots import TIME_COLORS, TIME_UNITS, fmt, pick_time_unit

# label -> (cluster name pattern for n nodes of 8, note)
LINKS = {
    "NVLink in a node, InfiniBand NDR between": "{nodes}x8xH100-IB",
    "NVLink in a node, InfiniBand HDR between": "{nodes}x8xH100-IB-HDR",
    "PCIe 5 only (H100 PCIe), InfiniBand NDR between": "{nodes}x8xH100-PCIe-IB",
}
GPU_CHOICES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
TOKEN_CHOICES = {f"{2 ** k // 1024}K tokens" if k < 20 else f"{2 ** (k - 20)}M tokens": 2 ** k
                 for k in range(14, 25)}


def cluster_for(gpus, link=next(iter(LINKS))):
    """The smallest cluster of 8-GPU nodes that holds `gpus`, with the chosen links."""
    nodes = max(1, math.ceil(gpus / 8))
    name = LINKS.get(link, link).format(nodes=nodes)
    if nodes == 1:  # one node: no inter-node word
        name = name.replace("-IB-HDR", "").replace("-IB", "")
        if "PCIe" not in name:
            name += "-NVLink"
    return hardware.cluster(name)


def step_split(model, gpus, tokens, bucket_mb=25, link=next(iter(LINKS)), overlap=True):
    """theory.time.dp_step_time on the cluster `cluster_for(gpus, link)` (bf16 gradients)."""
    return tt.dp_step_time(model, gpus=gpus, cluster=cluster_for(gpus, link),
                           global_batch_tokens=tokens, overlap=overlap,
                           bucket_bytes=bucket_mb * 2 ** 20)   # MiB, as DataParallel


def speedups(model, gpus_list, tokens, bucket_mb=25, link=next(iter(LINKS)), overlap=True):
    """Strong scaling at a fixed global batch: time(1 GPU) / time(n GPUs)."""
    return tt.dp_speedup(model, gpus_list, lambda n: cluster_for(n, link),
                         global_batch_tokens=tokens, overlap=overlap,
                         bucket_bytes=bucket_mb * 2 ** 20)   # MiB, as DataParallel


def state_bytes_per_gpu(model):
    """Model states every data-parallel replica holds (mixed-precision Adam, 16 B/param)."""
    return model_state_bytes(catalog.model(model).param_count())["total"]


def fits(model, link=next(iter(LINKS))):
    """Whether one replica's model states fit one GPU of the cluster (activations not counted:
    the lower bound of what a replica needs)."""
    return state_bytes_per_gpu(model) <= cluster_for(1, link).gpu.memory_bytes


def scaling_plot(ax, curves, gpus, link=next(iter(LINKS)), bucket_mb=25, title=""):
    """Modelled strong scaling, one line per (model, tokens) in `curves`; hollow markers where
    a replica's model states do not fit one GPU, with the bytes in the legend."""
    memory = cluster_for(1, link).gpu.memory_bytes
    for i, (model, tokens) in enumerate(curves):
        m = catalog.model(model)
        ys = speedups(m, gpus, tokens, bucket_mb, link)
        ok = fits(m, link)
        words = f"{tokens // 2 ** 20}M" if tokens >= 2 ** 20 else f"{tokens // 1024}K"
        label = f"modelled {m.display_name}, {words} tokens per step"
        if not ok:
            label += (f"\n(hollow: {state_bytes_per_gpu(m) / 1e9:.0f} GB of model states per "
                      f"GPU > {memory / 1e9:.0f} GB: does not fit)")
        # drawn on top, larger: a hollow marker rings a curve that shares its points
        style = dict(ms=5) if ok else dict(ms=9, mfc="none", ls=":", zorder=3)
        ax.plot(gpus, ys, marker="os"[i % 2], label=label, **style)
    ax.plot(gpus, gpus, "k--", lw=1, label="ideal (y = x)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.minorticks_off()
    ax.axvline(8, color="grey", lw=0.8, ls=":")
    ax.text(8.4, 0.5 * max(gpus), "node boundary:\nNVLink -> InfiniBand", fontsize=8,
            color="grey")
    ax.set_xlabel("GPUs (log2 scale)")
    ax.set_ylabel("speedup over 1 GPU")
    ax.set_title(title or "modelled strong scaling on H100 nodes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def _dp_numbers(model, gpus, tokens, bucket_mb, link):
    """Everything the three panels show for one choice (modelled), and the summary line."""
    m = catalog.model(model)
    n_params = m.param_count()
    grad_bytes = n_params * dtype_bytes("bf16")
    on = step_split(m, gpus, tokens, bucket_mb, link, True)
    off = step_split(m, gpus, tokens, bucket_mb, link, False)
    unit = pick_time_unit(max(off["total"], 1e-12))
    scale = TIME_UNITS[unit]
    ns = [n for n in GPU_CHOICES if n <= max(64, gpus)]
    s_on = speedups(m, ns, tokens, bucket_mb, link, True)
    ns2 = [n for n in ns if n > 1]
    wire = [tt.wire_bytes_per_rank("all_reduce", grad_bytes, n) / 1e9 for n in ns2]
    ok = fits(m, link)
    here = s_on[ns.index(gpus)]
    states = state_bytes_per_gpu(m) / 1e9
    memory = cluster_for(1, link).gpu.memory_bytes / 1e9
    fit = (f"each replica's model states: {states:,.0f} GB "
           + ("fit" if ok else f"<b>do not fit</b> a {memory:.0f} GB GPU: plain data "
              "parallelism cannot train it (ZeRO, lesson 04, shards them)"))
    text = (f"{fit}<br><b>{gpus} GPUs</b>: step {fmt(on['total'] / scale)} {unit} (compute "
            f"{fmt(on['compute'] / scale)}, exposed comm {fmt(on['exposed_comm'] / scale)}; "
            f"without overlap {fmt(off['total'] / scale)}) &middot; speedup {here:.1f}x "
            f"({here / gpus:.0%} efficiency) &middot; each GPU sends "
            f"{tt.wire_bytes_per_rank('all_reduce', grad_bytes, gpus) / 1e9:.2f} GB per step "
            f"&middot; <i>modelled</i>")
    return dict(
        gpus=gpus, ok=ok, unit=unit, ns=ns, ns2=ns2, s_on=s_on, here=here, wire=wire,
        s_off=speedups(m, ns, tokens, bucket_mb, link, False), grad_gb=grad_bytes / 1e9,
        comp=[on["compute"] / scale, off["compute"] / scale],
        exposed=[on["exposed_comm"] / scale, off["exposed_comm"] / scale],
        hidden=(on["comm"] - on["exposed_comm"]) / scale, text=text,
        suptitle=(f"{m.display_name} ({n_params / 1e9:.2f}B params, bf16 grads "
                  f"{grad_bytes / 1e9:.1f} GB), {tokens:,} tokens per step, modelled on "
                  f"{cluster_for(gpus, link).name}"))


class DpDrawing(Drawing):
    """The three panels, built once per model that fits or not (hollow markers, a longer
    title); every other change moves the bars, lines, markers and ticks in place."""

    def shape(self, **values):
        self.d = _dp_numbers(**values)
        return self.d["ok"]

    def build(self, fig, **values):
        d = self.d
        ax_split, ax_speed, ax_comm = fig.subplots(1, 3,
                                                   gridspec_kw=dict(width_ratios=[1.1, 1, 1]))
        labels = ["overlap", "no overlap"]
        # 1. the step split, with and without overlap
        self.split = [ax_split.barh(labels, [0, 0], color=TIME_COLORS["compute"],
                                    label="compute"),
                      ax_split.barh(labels, [0, 0], color=TIME_COLORS["exposed_comm"],
                                    label="exposed comm"),
                      ax_split.barh([labels[0]], [0], height=0.25, color="#c5b0d5",
                                    label="comm hidden under backward")]
        ax_split.set_ylim(1.5, -1.3)   # room above the bars for the legend
        ax_split.legend(fontsize=7, loc="upper right", ncol=2)
        ax_split.grid(axis="x", alpha=0.3)
        # 2. speedup
        ns = d["ns"]
        self.ideal = ax_speed.plot(ns, ns, "k--", lw=1, label="ideal")[0]
        hollow = dict(mfc=None if d["ok"] else "white")
        self.speed = [ax_speed.plot(ns, ns, "o-", ms=3, label="modelled, overlap", **hollow)[0],
                      ax_speed.plot(ns, ns, "s-", ms=3, label="modelled, no overlap",
                                    **hollow)[0],
                      ax_speed.plot([1], [1], "o", ms=9, mfc="none", mec="red")[0]]
        ax_speed.set_xscale("log", base=2)
        ax_speed.set_yscale("log", base=2)
        ax_speed.tick_params(labelsize=7)
        ax_speed.minorticks_off()
        ax_speed.axvline(8.5, color="grey", lw=0.8, ls=":")
        ax_speed.text(9, 1.05, "> 1 node", fontsize=7, color="grey")
        ax_speed.set_xlabel("GPUs")
        ax_speed.set_ylabel("speedup over 1 GPU")
        ax_speed.set_title("strong scaling, fixed global batch" + ("" if d["ok"] else
                           "\n(hollow: its model states do not fit one GPU)"), fontsize=10)
        ax_speed.legend(fontsize=7)
        ax_speed.grid(alpha=0.3)
        # 3. bytes each GPU sends per step
        ns2 = d["ns2"]
        self.comm = [ax_comm.plot(ns2, ns2, "o-", color="#9467bd", ms=3,
                                  label="2(N-1)/N x gradients")[0],
                     ax_comm.axhline(1, color="k", ls="--", lw=1, label="2 x gradients (limit)"),
                     ax_comm.plot([2], [1], "o", ms=9, mfc="none", mec="red")[0]]
        ax_comm.set_xscale("log", base=2)
        ax_comm.tick_params(axis="x", labelsize=7)
        ax_comm.minorticks_off()
        ax_comm.set_xlabel("GPUs")
        ax_comm.set_ylabel("GB sent per GPU per step")
        ax_comm.set_title("all-reduce traffic per GPU", fontsize=10)
        ax_comm.legend(fontsize=7, loc="lower right")
        ax_comm.grid(alpha=0.3)
        fig.tight_layout()

    def update(self, fig, **values):
        d = self.d
        ax_split, ax_speed, ax_comm = fig.axes[:3]
        compute, exposed, hidden = self.split
        for i, rect in enumerate(compute):
            rect.set_width(d["comp"][i])
        for i, rect in enumerate(exposed):
            rect.set_x(d["comp"][i])
            rect.set_width(d["exposed"][i])
        hidden[0].set_x(d["comp"][0] - d["hidden"])
        hidden[0].set_width(d["hidden"])
        ax_split.set_xlim(0, 1.05 * max(c + e for c, e in zip(d["comp"], d["exposed"])))
        ax_split.set_xlabel(f"modelled step time ({d['unit']})")
        ax_split.set_title(f"one step on {d['gpus']} GPU{'s' if d['gpus'] > 1 else ''}",
                           fontsize=10)
        ns, ns2 = d["ns"], d["ns2"]
        self.ideal.set_data(ns, ns)
        self.speed[0].set_data(ns, d["s_on"])
        self.speed[1].set_data(ns, d["s_off"])
        self.speed[2].set_data([d["gpus"]], [d["here"]])
        ax_speed.set_xticks(ns, [str(n) for n in ns])
        ax_speed.set_yticks(ns, [str(n) for n in ns])
        ax_speed.relim()
        ax_speed.autoscale_view()
        self.comm[0].set_data(ns2, d["wire"])
        self.comm[1].set_ydata([2 * d["grad_gb"]] * 2)
        self.comm[2].set_visible(d["gpus"] > 1)   # one GPU sends nothing: no marker
        if d["gpus"] > 1:
            self.comm[2].set_data([d["gpus"]], [d["wire"][ns2.index(d["gpus"])]])
        ax_comm.set_xticks(ns2, [str(n) for n in ns2])
        ax_comm.dataLim.intervalx = (ns2[0], ns2[-1])   # the line's span (axhline spans any)
        ax_comm.autoscale_view(scaley=False)
        ax_comm.set_ylim(0, 2.2 * d["grad_gb"])
        fig.suptitle(d["suptitle"], fontsize=10)
        return d["text"]


def draw(fig, model, gpus, tokens, bucket_mb, link):
    """Fill `fig` with the three panels; return the summary line (HTML)."""
    return DpDrawing().draw_on(fig, model=model, gpus=gpus, tokens=tokens,
                               bucket_mb=bucket_mb, link=link)


def dp_explorer(model="Llama 3 8B", gpus=16, tokens=2 ** 20, bucket_mb=25):
    """The widget: change a control, the three panels redraw (theory only: well under 1 s)."""
    import ipywidgets as widgets
    from .widgets import figure_explorer

    names = [m.display_name for m in catalog.models() if m.arch != "unet"]
    style = dict(description_width="initial")
    controls = dict(
        gpus=widgets.SelectionSlider(options=GPU_CHOICES, value=gpus, description="GPUs",
                                     style=style),
        model=widgets.Dropdown(options=names, value=catalog.model(model).display_name,
                               description="model", style=style),
        tokens=widgets.SelectionSlider(options=list(TOKEN_CHOICES.items()), value=tokens,
                                       description="global batch", style=style),
        bucket_mb=widgets.SelectionSlider(options=[1, 5, 10, 25, 50, 100, 250, 1000],
                                          value=bucket_mb, description="bucket (MiB)",
                                          style=style),
        link=widgets.Dropdown(options=list(LINKS), description="links", style=style,
                              layout=widgets.Layout(width="420px")),
    )
    return figure_explorer(controls, DpDrawing(), figsize=(12, 3.8))

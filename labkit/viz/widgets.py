"""Interactive explorers for the notebooks: sliders and dropdowns over `labkit.theory`.

An explorer is a set of ipywidgets controls and a drawing: a `draw(ax, **values)` function that
fills one matplotlib axes and returns a line of text, or a `live.Drawing` that builds its artists
once and then moves them. `explorer(controls, draw)` wires them together: on every change the one
figure is updated and its PNG bytes go to an Image widget (`labkit.viz.live`: a slider step
costs tens of milliseconds). Later lessons add their own explorers here the same way.
"""
from __future__ import annotations

import math

from ..theory import catalog, hardware
from ..theory import memory as tm
from .live import Drawing, explorer_box
from .plots import fmt, memory_stack, restack, stack_shape

# ------------------------------------------------------------------------------ the explorer

def explorer(controls, draw, figsize=(8, 4.6), linked=()):
    """A VBox of `controls` ({name: widget}), a text line and a picture redrawn on each change.

    `draw(ax, **{name: widget.value})` draws on `ax` and returns the text line (HTML allowed);
    or `draw` is a `live.Drawing` (built once per shape, then updated in place).
    """
    if not isinstance(draw, Drawing):
        draw = _on_one_axes(draw)
    return figure_explorer(controls, draw, figsize, linked)


def _on_one_axes(draw):
    return lambda fig, **values: draw(fig.add_subplot(), **values)


def figure_explorer(controls, draw, figsize=(8, 4.6), linked=()):
    """Like `explorer`, but `draw(fig, **values)` gets the whole (cleared) figure, for
    explorers with several panels. See `labkit.viz.live` for what makes a step fast."""
    return explorer_box(controls, draw, figsize, linked)


# -------------------------------------------------------------------------- memory explorer

INFERENCE_PRECISIONS = {"bf16": "bf16", "fp8/int8": "int8", "int4": "int4"}
TRAINING_PRECISIONS = {"bf16 mixed precision": True, "fp32": False}
CAPACITY_GPUS = {"H100 SXM": "H100 80 GB", "A100 SXM 40GB": "A100 40 GB",
                 "A100 SXM 80GB": "A100 80 GB", "H200 SXM": "H200 141 GB",
                 "RTX 4090": "RTX 4090 24 GB"}
SEQ_CHOICES = [2 ** k for k in range(9, 16)]   # 512 ... 32768


def explorer_models():
    """Display names of the catalog's language models (the UNet has no KV cache or layers)."""
    return [m.display_name for m in catalog.models() if m.arch != "unet"]


def capacities():
    """{'H100 80 GB': bytes, ...} for the GPUs the explorer draws, from data/hardware.csv."""
    by_name = {g.name: g for g in hardware.gpus()}
    return {label: by_name[name].memory_bytes for name, label in CAPACITY_GPUS.items()}


def memory_breakdown(model, mode, precision, optimizer="Adam", batch=1, seq=4096):
    """Modelled bytes on one GPU (no parallelism) by category, from theory.memory.

    inference: weights in `precision` ('bf16', 'fp8/int8', 'int4') + a bf16 KV cache for
    `batch` sequences of `seq` tokens. training: 'bf16 mixed precision' or 'fp32' with Adam or
    SGD, activations of one batch of `batch` x `seq` tokens without recomputation.
    """
    if mode == "inference":
        dtype = INFERENCE_PRECISIONS.get(precision, precision)
        return tm.inference_memory(model, batch=batch, context=seq, weight_dtype=dtype)
    if mode != "training":
        raise ValueError(f"mode must be 'inference' or 'training', not {mode!r}")
    mixed = TRAINING_PRECISIONS.get(precision, precision != "fp32")
    return tm.training_memory(model, batch=batch, seq=seq, mixed_precision=mixed,
                              optimizer=optimizer.lower())


def gpus_needed(total_bytes, gpu="H100 SXM"):
    """How many GPUs of this kind it takes just to hold `total_bytes` (perfectly split)."""
    return max(1, math.ceil(total_bytes / hardware.gpu(gpu).memory_bytes))


def _describe(mode, precision, optimizer):
    if mode == "inference":
        return f"inference, {precision} weights, bf16 KV cache"
    return f"training, {precision}, {optimizer}"


def _memory_view(model, mode, precision, optimizer, batch, seq):
    """memory_stack's arguments for one choice, and the summary line."""
    m = catalog.model(model)
    parts = memory_breakdown(m, mode, precision, optimizer, batch, seq)
    n = gpus_needed(parts["total"])
    label = f"{m.display_name}\n{_describe(mode, precision, optimizer)}"
    title = (f"modelled memory on one GPU: batch {batch}, {seq} tokens\n"
             f"{fmt(parts['total'] / 1e9)} GB: needs {n:,} x H100 just to hold this")
    summary = (f"{m.display_name}: {fmt(parts['total'] / 1e9)} GB modelled "
               f"&rarr; needs <b>{n:,} x H100</b> (80 GB) just to hold this")
    unit = "TB" if parts["total"] >= 10e12 else "GB"
    return dict(bars={label: parts}, capacity=capacities(), title=title, unit=unit), summary


def memory_explorer_figure(model, mode, precision, optimizer="Adam", batch=1, seq=4096,
                           ax=None):
    """The explorer's figure for one choice: a modelled memory stack against GPU capacities.

    The "needs N x H100" line is in the title and in `fig.labkit_summary`.
    """
    stack, summary = _memory_view(model, mode, precision, optimizer, batch, seq)
    fig = memory_stack(ax=ax, **stack)
    fig.labkit_summary = summary
    return fig


class MemoryDrawing(Drawing):
    """The memory explorer in place: a new batch or length moves the bars and texts."""

    def shape(self, model, mode, precision, optimizer, batch, seq):
        if precision not in (TRAINING_PRECISIONS if mode == "training"
                             else INFERENCE_PRECISIONS):
            self.view = None   # between the mode change and the precision reset
            return None
        self.view = _memory_view(model, mode, precision, optimizer, batch, seq)
        return stack_shape(self.view[0]["bars"], self.view[0]["capacity"],
                           self.view[0]["unit"])

    def build(self, fig, **values):
        if self.view:
            memory_stack(ax=fig.add_subplot(), **self.view[0])

    def update(self, fig, **values):
        if not self.view:
            return ""
        stack, summary = self.view
        restack(fig.axes[0], **stack)
        return summary


def memory_explorer():
    """Model, mode, precision, optimizer, batch and sequence length -> modelled memory bars."""
    import ipywidgets as widgets

    names = explorer_models()
    controls = dict(
        model=widgets.Dropdown(options=names, value="Llama 3 70B" if "Llama 3 70B" in names
                               else names[0], description="model"),
        mode=widgets.Dropdown(options=["inference", "training"], value="inference",
                              description="mode"),
        precision=widgets.Dropdown(options=list(INFERENCE_PRECISIONS), value="bf16",
                                   description="precision"),
        optimizer=widgets.Dropdown(options=["Adam", "SGD"], value="Adam",
                                   description="optimizer", disabled=True),
        batch=widgets.IntSlider(value=1, min=1, max=64, description="batch"),
        seq=widgets.SelectionSlider(options=SEQ_CHOICES, value=8192, description="seq len"),
    )

    def on_mode(change):  # precision choices and the optimizer depend on the mode
        training = change["new"] == "training"
        options = list(TRAINING_PRECISIONS if training else INFERENCE_PRECISIONS)
        controls["precision"].options = options
        controls["precision"].value = options[0]
        controls["optimizer"].disabled = not training


    return explorer(controls, MemoryDrawing(), linked=[("mode", on_mode)])

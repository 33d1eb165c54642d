"""Tests for labkit.viz: every plot returns a Figure with the bars, lines and rows expected."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from labkit import launch  # noqa: E402
from labkit.theory import catalog  # noqa: E402
from labkit.viz import comm_bars, gantt, memory_stack, speedup_curve, time_split  # noqa: E402
from labkit.viz import agg_text, cp_widgets, dp_widgets, pipeline_widgets  # noqa: E402
from labkit.viz import tp_widgets, widgets  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _rects(ax):
    return [p for p in ax.patches if isinstance(p, matplotlib.patches.Rectangle)]


# ------------------------------------------------------------------------------- memory_stack

def test_memory_stack_bars_order_and_capacities():
    bars = {"measured": dict(params=4e6, grads=4e6, optimizer=8e6, activations=2e7, buffers=0,
                             peak=3e7, peak_phase="forward"),
            "predicted": dict(params=4e6, grads=4e6, optimizer=8e6, activations=2.1e7,
                              total=3.7e7)}
    fig = memory_stack(bars, capacity={"A": 40e6, "B": 80e6, "C": 80e6}, unit="MB")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(_rects(ax)) == 2 * 4   # 2 labels x 4 categories; total/peak/zero buffers not
    assert [t.get_text() for t in ax.get_xticklabels()] == ["measured", "predicted"]
    assert "MB" in ax.get_ylabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[-1] == "parameters" and "peak" in legend   # top of the stack listed first
    dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(dashed) == 2                  # B and C (both 80) share a line
    texts = [t.get_text() for t in ax.texts]
    assert "B / C" in texts
    # The top of the measured stack is the sum of its categories, in MB.
    assert _rects(ax)[-2].get_y() + _rects(ax)[-2].get_height() == pytest.approx(36.0)


def test_memory_stack_unknown_keys_and_given_ax():
    fig, ax = plt.subplots()
    out = memory_stack({"x": {"weights": 1e9, "kv_cache": 2e9, "mystery": 5e8}}, ax=ax)
    assert out is fig
    assert len(_rects(ax)) == 3
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["mystery", "weights (served)", "KV cache"]


# ---------------------------------------------------------------------------------------- gantt

def _events():
    ev = []
    for rank in range(3):
        t = 1e-5 * rank
        for mb in range(2):
            ev.append(dict(rank=rank, lane="compute", kind="compute", name="forward", start=t,
                           end=t + 1e-5, wall_start=t * 1e3, wall_end=(t + 1e-5) * 1e3,
                           meta={"microbatch": mb}))
            t += 1e-5
        ev.append(dict(rank=rank, lane="compute", kind="idle", name="wait", start=t,
                       end=t + 5e-6, wall_start=t * 1e3, wall_end=t * 1e3, meta={}))
        ev.append(dict(rank=rank, lane="comm", kind="comm", name="all_reduce", start=t,
                       end=t + 2e-5, wall_start=t * 1e3, wall_end=(t + 2e-5) * 1e3, meta={}))
        ev.append(dict(rank=rank, lane="compute", kind="compute", name="backward",
                       start=t + 5e-6, end=t + 3e-5, wall_start=t * 1e3,
                       wall_end=(t + 3e-5) * 1e3, meta={}))
    return ev


@pytest.mark.parametrize("clock", ["modelled", "wall"])
def test_gantt_both_clocks(clock):
    ev = _events()
    fig = gantt(ev, clock=clock)
    ax = fig.axes[0]
    assert len(_rects(ax)) == len(ev)                 # one bar per event
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    word = "modelled" if clock == "modelled" else "measured"
    assert word in ax.get_xlabel() and word in ax.get_title()
    if clock == "modelled":
        assert ax.get_xlabel() == "modelled time (µs)"
        assert sorted(t.get_text() for t in ax.texts) == ["0", "0", "0", "1", "1", "1"]
    else:
        assert ax.get_xlabel() == "measured wall-clock time (s) on this machine"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"forward", "backward", "collective (comm)", "idle (waiting)"} <= set(legend)
    # rank 0 on top, comm lane just under the compute lane
    bars = _rects(ax)
    y_of = {(e["rank"], e["lane"]): b.get_y() + b.get_height() / 2 for e, b in zip(ev, bars)}
    assert y_of[(0, "compute")] > y_of[(0, "comm")] > y_of[(1, "compute")]


def test_gantt_title_gets_clock_word_and_units_scale():
    ev = [dict(rank=0, lane="compute", kind="compute", name="step", start=0.0, end=0.02,
               wall_start=0.0, wall_end=1.0, meta={})]
    ax = gantt(ev, title="one step").axes[0]
    assert ax.get_title() == "one step (modelled)" and ax.get_xlabel() == "modelled time (ms)"
    with pytest.raises(ValueError):
        gantt(ev, clock="cpu")


def test_gantt_of_a_real_run():
    def work(ctx):
        import torch
        with ctx.clock.compute("forward", microbatch=0):
            x = torch.ones(64, 64) @ torch.ones(64, 64)
        handle = ctx.comm.all_reduce(x, async_op=True)
        with ctx.clock.compute("backward"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        handle.wait()
        ctx.comm.all_reduce(torch.ones(8))
        return ctx.clock.timeline()

    timeline = [e for rank in launch(work, 2) for e in rank]
    for clock in ("modelled", "wall"):
        ax = gantt(timeline, clock=clock).axes[0]
        assert len(_rects(ax)) == len(timeline)


# ----------------------------------------------------------------------- speedup, comm, split

def test_speedup_curve_lines():
    fig = speedup_curve([1, 2, 4, 8], {"modelled": [1, 1.9, 3.5, 6], "measured": [1, 1.5, 2, 2]})
    ax = fig.axes[0]
    assert len(ax.get_lines()) == 3 and ax.get_xscale() == "log"
    assert ax.get_lines()[-1].get_linestyle() == "--"
    ax = speedup_curve([1, 2], {"m": [1, 2]}, ideal=False).axes[0]
    assert len(ax.get_lines()) == 1


def test_comm_bars_rows_and_dataframe():
    rows = [dict(op="all_reduce", calls=2, bytes=4_000_000, wire_bytes_per_rank=6e6),
            dict(op="broadcast", calls=1, bytes=1000, wire_bytes_per_rank=750.0)]
    for data in (rows, pd.DataFrame(rows)):
        ax = comm_bars(data).axes[0]
        assert len(_rects(ax)) == 4
        assert ax.get_ylabel() == "bytes (MB)"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["all_reduce", "broadcast"]


def test_time_split_stacks():
    rows = {"modelled, 1 GPU": {"compute": 0.1},
            "modelled, 8 GPUs": {"compute": 0.0125, "exposed_comm": 0.004, "bubble": 0.001,
                                 "total": 0.0175}}
    ax = time_split(rows).axes[0]
    assert len(_rects(ax)) == 2 * 3
    assert ax.get_xlabel() == "time per step (ms)"
    widths = [r.get_width() for r in _rects(ax)]
    assert widths[0] == pytest.approx(100.0)


# ------------------------------------------------------------------------------------- widgets

LM_MODELS = [m.display_name for m in catalog.models() if m.arch != "unet"]


@pytest.mark.parametrize("model", LM_MODELS)
@pytest.mark.parametrize("mode,precision", [("inference", "bf16"), ("inference", "int4"),
                                            ("training", "bf16 mixed precision"),
                                            ("training", "fp32")])
def test_memory_explorer_figure_every_model(model, mode, precision):
    fig = widgets.memory_explorer_figure(model, mode, precision, "Adam", 4, 4096)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert "modelled" in ax.get_title() and "x H100" in ax.get_title()
    names = " ".join(t.get_text() for t in ax.texts)
    assert "H100 80 GB" in names and "RTX 4090 24 GB" in names and "H200 141 GB" in names


def test_memory_explorer_numbers():
    parts = widgets.memory_breakdown("Llama 3 70B", "inference", "int4", batch=1, seq=8192)
    # int4 matrices (0.5 B) + a bf16 scale per group of 128 + bf16 embeddings, head and norms
    h, kv, ffn, layers, vocab = 8192, 8 * 128, 28672, 80, 128256
    matrices = layers * (2 * h * h + 2 * h * kv + 3 * h * ffn)
    other = 2 * vocab * h + (2 * layers + 1) * h
    assert parts["weights"] == pytest.approx(0.5 * matrices + 2 * matrices / 128 + 2 * other)
    parts = widgets.memory_breakdown("Llama 3 8B", "training", "bf16 mixed precision", "SGD",
                                     1, 512)
    assert parts["optimizer"] == pytest.approx(4 * catalog.model("llama-3-8b").param_count())
    # an H100 holds 81559 MiB = 85.5e9 bytes as the driver reports it: 81 GB fits, 86 GB not
    assert widgets.gpus_needed(81e9) == 1 and widgets.gpus_needed(86e9) == 2
    assert widgets.gpus_needed(1) == 1
    assert "Stable Diffusion 1.5" not in widgets.explorer_models()
    with pytest.raises(ValueError):
        widgets.memory_breakdown("Llama 3 8B", "serving", "bf16")


def test_memory_explorer_widget_redraws():
    box = widgets.memory_explorer()
    controls = [w for row in box.children[:-2] for w in row.children]
    by_name = {w.description: w for w in controls}
    text = box.children[-2]
    assert "x H100" in text.value
    by_name["mode"].value = "training"
    assert by_name["precision"].value == "bf16 mixed precision"
    assert not by_name["optimizer"].disabled
    by_name["batch"].value = 8
    assert "x H100" in text.value
    assert plt.get_fignums() == []   # the explorer's figure is not left in pyplot


@pytest.mark.parametrize("make", [widgets.memory_explorer, dp_widgets.dp_explorer,
                                  cp_widgets.cp_explorer, pipeline_widgets.pipeline_explorer])
def test_a_slider_step_updates_the_picture_in_place(make, monkeypatch):
    box = make()
    slider = next(w for row in box.children[:-2] for w in row.children
                  if "Slider" in type(w).__name__)
    figure, before, builds = box.figure, box.image.value, box.live.builds
    made = []
    init = Figure.__init__
    monkeypatch.setattr(Figure, "__init__", lambda self, *a, **k: (made.append(self),
                                                                   init(self, *a, **k))[1])
    if hasattr(slider, "options"):
        values = [o[1] if isinstance(o, tuple) else o for o in slider.options]
        slider.value = values[values.index(slider.value) - 1]
    else:
        slider.value += slider.step
    assert box.image.value != before and bytes(box.image.value[:4]) == b"\x89PNG"
    assert box.figure is figure and made == [] and box.live.builds == builds
    assert plt.get_fignums() == []


def test_pipeline_explorer_pools_follow_the_stages():
    box = pipeline_widgets.pipeline_explorer()
    stages = next(w for row in box.children[:-2] for w in row.children
                  if w.description == "stages P")
    gantt_ax, mem_ax = box.figure.axes
    for p in (8, 3):
        stages.value = p
        ranks = [t.get_text() for t in gantt_ax.get_yticklabels()]
        assert ranks == [f"rank {r}" for r in range(p)]
        assert sum(bar.get_visible() for bar in mem_ax.patches) == p
    # P = 3, M = 8: every forward and backward bar is wide enough for its micro-batch number;
    # the numbers P = 8 needed more of are hidden, not removed
    numbers = [t.get_text() for t in gantt_ax.texts if t.get_visible()]
    assert sorted(numbers) == sorted([str(mb) for mb in range(8)] * 2 * 3)
    assert len(gantt_ax.texts) > len(numbers) and box.live.builds == 1


def test_cached_text_paints_the_pixels_plain_agg_paints():
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=(3, 2), dpi=100)
    ax = fig.add_subplot()
    ax.set_title("GB = 10⁹ bytes, fi ffl")
    ax.set_ylabel("rotated\nlabel")
    ax.text(0.3, 0.4, "1,234 x H100", fontsize=7, rotation=30)
    pictures = []
    for canvas in (FigureCanvasAgg, agg_text.CachedTextCanvas, agg_text.CachedTextCanvas):
        canvas(fig).draw()   # the second cached draw takes every glyph from the cache
        pictures.append(np.asarray(fig.canvas.buffer_rgba()).copy())
    assert all(np.array_equal(pictures[0], p) for p in pictures[1:])
    assert agg_text._heights   # the layouts' font metrics came from the renderer's cache


# ------------------------------------------------------------ the private-Matplotlib guard

def test_the_fast_path_is_on_for_the_pinned_matplotlib():
    """pyproject.toml pins the Matplotlib the cached renderer was made for: on it the guard
    finds every private name, and the explorers' canvases draw with the cached renderer."""
    import re
    import tomllib
    from pathlib import Path

    import numpy as np
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    pins = [d for d in project["project"]["dependencies"] if re.match(r"matplotlib\b", d)]
    assert len(pins) == 1 and "<" in pins[0], pins   # an upper bound: the tested range
    if matplotlib.__version__ not in SpecifierSet(pins[0][len("matplotlib"):]):
        pytest.skip(f"matplotlib {matplotlib.__version__} is outside the pin {pins[0]}")
    assert agg_text.FAST_PATH and agg_text.fast_path()
    box = widgets.memory_explorer()
    assert type(box.figure.canvas.get_renderer()) is agg_text.CachedTextRenderer
    assert np.asarray(box.figure.canvas.buffer_rgba()).any()


def test_the_guard_probes_every_private_name_the_lab_uses():
    """Every private attribute labkit.viz reads on an object not its own is in the guard's
    table (agg_text.PRIVATE), and only agg_text reads any; a name the probe cannot find
    (another Matplotlib) turns the fast path off."""
    import ast
    from pathlib import Path

    probed = {name for _, name, _ in agg_text.PRIVATE}
    for path in sorted(Path(agg_text.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        own |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                for t in n.targets if isinstance(t, ast.Name)}   # class and module attributes
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and n.attr.startswith("_") and not n.attr.startswith("__") and n.attr not in own
                and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
                         and path.name != "agg_text.py")}
        if path.name == "agg_text.py":
            assert used <= probed, used - probed
        else:
            assert used == set(), (path.name, used)
    assert "_renderer" in probed and "_layout" in probed
    table = agg_text.PRIVATE
    try:
        agg_text.PRIVATE = table + (("FT2Font", "_layout_v2", "RendererAgg.draw_text"),)
        assert not agg_text.fast_path()
    finally:
        agg_text.PRIVATE = table


def _explorer_pictures(makers):
    """{explorer: (its RGBA pixels, plain Agg's for the same figure, its renderer class)}
    after one slider step (the step draws from the caches the first picture filled)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    pictures = {}
    for make in makers:
        box = make()
        slider = next(w for row in box.children[:-2] for w in row.children
                      if "Slider" in type(w).__name__)
        if hasattr(slider, "options"):
            values = [o[1] if isinstance(o, tuple) else o for o in slider.options]
            slider.value = values[values.index(slider.value) - 1]
        else:
            slider.value = slider.value + slider.step
        live_canvas = box.figure.canvas
        live = np.asarray(live_canvas.buffer_rgba()).copy()
        FigureCanvasAgg(box.figure).draw()   # the same figure, plain Matplotlib
        plain = np.asarray(box.figure.canvas.buffer_rgba()).copy()
        pictures[make.__name__] = (live, plain, type(live_canvas.renderer))
        box.figure.set_canvas(live_canvas)
    return pictures


def _save_png(pixels, name):
    from pathlib import Path

    from PIL import Image
    out = Path(__file__).parents[1] / "build" / "test_viz"
    out.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).convert("RGB").save(out / f"{name}.png")


def test_the_explorers_fast_pictures_equal_plain_agg():
    import numpy as np
    if not agg_text.FAST_PATH:
        pytest.skip("this Matplotlib takes the plain path (the pin test says why)")
    from labkit.viz import moe_widgets, zero_widgets
    makers = (widgets.memory_explorer, dp_widgets.dp_explorer, tp_widgets.tp_explorer,
              zero_widgets.zero_explorer, moe_widgets.moe_explorer,
              pipeline_widgets.pipeline_explorer)
    for name, (live, plain, renderer) in _explorer_pictures(makers).items():
        assert renderer is agg_text.CachedTextRenderer, name
        assert live[..., :3].min() < 100 and np.array_equal(live, plain), name
        _save_png(live, f"fast_{name}")


def test_the_plain_fallback_draws_the_same_explorers(monkeypatch):
    """The guard forced off: every canvas draws with plain RendererAgg, and the explorers work
    and paint what plain Agg paints (so what the fast path paints, by the test above)."""
    import numpy as np
    monkeypatch.setattr(agg_text, "FAST_PATH", False)
    makers = (widgets.memory_explorer, dp_widgets.dp_explorer, pipeline_widgets.pipeline_explorer)
    for name, (live, reference, renderer) in _explorer_pictures(makers).items():
        assert renderer is matplotlib.backends.backend_agg.RendererAgg, name
        assert live[..., :3].min() < 100 and np.array_equal(live, reference), name
        _save_png(live, f"plain_{name}")


def test_an_update_puts_back_a_layout_made_before():
    box = tp_widgets.tp_explorer()   # TP 8 <-> 16 changes the link's name in the y labels
    tp = next(w for row in box.children[:-2] for w in row.children if w.description == "TP degree")
    for value in (16, 8):
        tp.value = value
    runs = box.live.layout.runs
    for value in (16, 8, 16):
        tp.value = value
    assert box.live.layout.runs == runs and box.live.builds == 1


def test_site_snapshot_reads_an_image_widget_buffer():
    import base64

    import nbformat

    from labkit import editions
    png = base64.b64encode(b"\x89PNG fake").decode()
    state = {"box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_t",
                                                                        "IPY_MODEL_i"]}},
             "t": {"model_name": "HTMLModel", "state": {"value": "needs <b>2 x H100</b>"}},
             "i": {"model_name": "ImageModel", "state": {"format": "png"},
                   "buffers": [{"data": png, "encoding": "base64", "path": ["value"]}]}}
    nb = nbformat.v4.new_notebook(metadata={"widgets": {editions.WIDGET_STATE:
                                                        {"state": state}}})
    cell = nbformat.v4.new_code_cell("explorer()", outputs=[nbformat.v4.new_output(
        "display_data", {editions.WIDGET_VIEW: {"model_id": "box"}})])
    nb.cells.append(cell)
    nb, _ = editions.WidgetSnapshots(enabled=True)(nb, {})
    html = nb.cells[0].outputs[-1]["data"]["text/html"]
    assert f'<img src="data:image/png;base64,{png}">' in html and "2 x H100" in html


def test_prefetch_waits_while_a_figure_renders():
    """The background prefetch makes no call while a live figure draws a step."""
    import threading

    from labkit.viz import live
    done = threading.Event()
    live._idle.clear()   # as LiveFigure.render does
    try:
        live.prefetch(lambda: done.set(), [()])
        assert not done.wait(0.2)
    finally:
        live._idle.set()
    assert done.wait(5)


def test_prefetch_pauses_between_calls_while_a_figure_renders():
    """A render that starts during a prefetch call lets that call finish and holds the next
    one until the render is over (a plain check between calls: no trace function)."""
    import threading

    from labkit.viz import live
    calls, second = [], threading.Event()

    def fn(i):
        calls.append(i)
        if i == 1:
            live._idle.clear()   # a step starts drawing while call 1 runs
        else:
            second.set()
    try:
        live.prefetch(fn, [(1,), (2,)])
        assert not second.wait(0.3) and calls == [1]
    finally:
        live._idle.set()
    assert second.wait(5) and calls == [1, 2]


def test_zero_categories_hide_without_a_new_shape():
    """A pooled category that is zero everywhere keeps the shape, its bars and legend entry
    hidden; nonzero, they show."""
    from labkit.viz import live
    from labkit.viz.live import legend_labels
    from labkit.viz.plots import restack, stack_shape
    pool = ("params", "activations")
    bars = {"a": {"params": 1e9, "activations": 0}}
    more = {"a": {"params": 1e9, "activations": 2e9}}
    assert stack_shape(bars, keep=pool) == stack_shape(more, keep=pool)
    ax = memory_stack(bars, keep=pool).axes[0]
    entries = [entry for _, entry in live.legend_entries(ax)]
    assert sorted(e.get_visible() for e in entries) == [False, True]
    assert len(legend_labels(ax)) == 1   # what the live layout keys its margins on
    restack(ax, more, keep=pool)
    assert all(e.get_visible() for e in entries) and len(legend_labels(ax)) == 2
    plt.close("all")


def test_layout_keeps_margins_for_slightly_longer_x_ticks_only():
    """An x tick label a digit longer keeps the layout; a wider y tick label lays out again."""
    from labkit.viz import live
    fig = live.live_figure((4, 3))
    ax = fig.subplots()
    ax.set_xticks([0, 1], ["0", "9"])
    ax.set_yticks([0, 1], ["a", "b"])
    fig.tight_layout()
    layout = live.Layout(fig)
    ax.set_xticks([0, 1], ["0", "99"])
    layout.refresh()
    assert layout.runs == 0
    ax.set_yticks([0, 1], ["a", "a much longer label"])
    layout.refresh()
    assert layout.runs == 1


def test_png_bytes_decode_to_the_canvas_pixels():
    """The explorers' own PNG writer (rows unfiltered) gives back exactly what Agg painted."""
    import io

    import numpy as np
    from PIL import Image

    from labkit.viz import live
    fig = live.live_figure((3, 2))
    ax = fig.subplots()
    ax.bar([0, 1], [1, 2], color=["#123456", "#abcdef"], alpha=0.6)
    ax.set_title("pixels")
    png = live.png_bytes(fig)
    decoded = np.asarray(Image.open(io.BytesIO(png)))
    painted = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    assert decoded.shape == (200, 300, 3) and np.array_equal(decoded, painted)
    assert len(np.unique(decoded.reshape(-1, 3), axis=0)) > 10   # not a blank picture


def test_serving_titles_stay_put_because_nothing_sits_above_the_axes():
    """ServingDrawing fixes its titles at the top of the axes (no automatic placement, which
    measures every tick label at each paint): right only while no axes has ticks on top or a
    y offset text (1e6 above the numbers), so check the extremes of every control."""
    from labkit.viz import serving_widgets
    box = serving_widgets.serving_explorer()
    controls = {w.description: w for row in box.children[:-2] for w in row.children}
    for name, value in (("model", "Llama 3.1 405B"), ("GPUs", 2), ("batch", 256),
                        ("prompt", 32768), ("weights", "int4"), ("batch", 1), ("GPUs", 16)):
        controls[name].value = value
        box.figure.canvas.draw()
        for ax in box.figure.axes:
            assert ax.xaxis.get_ticks_position() == "bottom" and ax.title.get_position()[1] == 1
            assert ax.yaxis.offsetText.get_text() == "", (name, value)


def test_serving_tpot_bars_add_up_to_the_modelled_tpot():
    """Lesson 09's TPOT bars: the step, the TP and EP communication and the pipeline hand-offs
    stack to the modelled TPOT for every layout (no unexplained remainder)."""
    from labkit.theory.serving import serving_time
    from labkit.viz.serving_widgets import tpot_terms
    for model, layout in [("llama-3-70b", dict(tp=8)), ("llama-3-70b", dict(tp=4, pp=2)),
                          ("llama-3-70b", dict(pp=8)), ("mixtral-8x7b", dict(ep=8)),
                          ("llama-3-8b", dict(replicas=8))]:
        for batch in (1, 64):
            t = serving_time(model, gpu="H100", batch=batch, **layout)
            assert abs(sum(tpot_terms(t).values()) - t["tpot_s"]) <= 1e-9 * t["tpot_s"], \
                (model, layout, batch)


def test_the_host_figure_shows_a_short_prompt_waiting_for_the_host():
    """Lesson 09's host figure: enqueued kernel by kernel is never faster than a replayed
    graph, its short prompts sit on the host's floor (kernels x ENQUEUE_S), a long prompt is
    the same either way, and the shaded span ends at the last host-bound prompt."""
    from labkit.theory import pricing
    from labkit.viz.serving_widgets import host_figure
    prompts = [16, 64, 256, 1024, 4096]
    fig = host_figure("llama-3-8b", prompts=prompts)
    graph, enqueue = (line.get_ydata() for line in fig.axes[0].get_lines()[:2])
    assert all(e >= g for e, g in zip(enqueue, graph))
    floor = (32 * 11 + 2) * pricing.ENQUEUE_S * 1e3         # 354 kernels of Llama 3 8B
    assert enqueue[0] == pytest.approx(floor) and enqueue[0] > graph[0]
    assert enqueue[-1] == graph[-1]
    bound = [p for p, g, e in zip(prompts, graph, enqueue) if e > g]
    span = fig.axes[0].patches[0].get_path().transformed(
        fig.axes[0].patches[0].get_patch_transform()).vertices[:, 0]
    assert max(span) == pytest.approx(bound[-1]) and bound[-1] < prompts[-1]
    plt.close(fig)


def _extents(fig, artists):
    renderer = fig.canvas.get_renderer()
    return [a.get_window_extent(renderer) for a in artists]


def test_memory_totals_never_overlap_and_titles_stay_inside_the_figure():
    """Lesson 06's best plans (four totals near 65 GB on a narrow panel) and lesson 11's
    explorer (a long title): each total clears its neighbours, each title the figure's edge."""
    import transformers
    from labkit.theory import planner
    from labkit.viz.own_model_widgets import draw_own_model
    from labkit.viz.planner_widgets import plan_figure
    out = planner.plan("llama-3-70b", 64, "H100", global_batch=256, seq=4096, top=4)
    fig = plan_figure(out)
    totals = _extents(fig, fig.axes[0].labkit_stack["totals"])
    assert len(totals) == 4
    for a, b in zip(totals, totals[1:]):
        assert a.x1 <= b.x0, (a, b)
    fig11 = plt.figure(figsize=(9, 4.6))
    draw_own_model(fig11.add_subplot(), {"Llama 3 8B": transformers.LlamaConfig()}, "Llama 3 8B",
                   "FullyShard (ZeRO-3)", 64, 4096)
    for f in (fig, fig11):
        title = _extents(f, [f.axes[0].title])[0]
        assert 0 <= title.x0 and title.x1 <= f.bbox.width and title.y1 <= f.bbox.height, title
    assert "scores not kept" in fig11.axes[0].get_title().replace("\n", " ")


def test_own_model_explorer_keeps_no_attention_scores_by_default():
    """As SDPA / FlashAttention: the 5as/h score term is only there when asked ("eager")."""
    from labkit.theory import memory
    from labkit.viz.own_model_widgets import own_model_bytes
    m = catalog.model("llama-3-8b")
    flash = own_model_bytes("llama-3-8b", "FullyShard (ZeRO-3)", 64, 4096)
    eager = own_model_bytes("llama-3-8b", "FullyShard (ZeRO-3)", 64, 4096, attention="eager")
    scores = 5 * m.heads * 4096 / m.hidden * 4096 * m.hidden * m.layers   # Korthikanti's term
    assert eager["activations"] - flash["activations"] == pytest.approx(scores)
    assert flash["activations"] == memory.training_memory(
        m, batch=1, seq=4096, dp=64, zero_stage=3, recompute="selective")["activations"]


def test_step_breakdown_bars_add_up_and_nothing_overlaps():
    """Lesson 06's step breakdown: a modelled bar's segments add up to the plan's step (its
    explain_s), a published bar is one hatched bar of its seconds; every total and title stays
    inside the figure and clear of the legend; a part the planner does not name is refused."""
    from labkit.theory import planner
    from labkit.viz.planner_widgets import step_breakdown_figure
    p = planner.plan("llama-3-8b", 8, "H100", global_batch=64, seq=4096, top=1)["plans"][0]
    long_title = "Llama 3 8B on 8 H100s (a title as long as lesson 06's, source and layout)"
    fig = step_breakdown_figure([(long_title, [("labkit (modelled)", p["explain_s"]),
                                               ("published", 1.3 * p["step_s"])]),
                                 ("second run", [("labkit (modelled)", p["explain_s"])])])
    top = fig.axes[0]
    modelled = [r for r in top.patches if r.get_y() < 0 < r.get_y() + r.get_height()]
    published = [r for r in top.patches if r.get_y() < -1 < r.get_y() + r.get_height()]
    assert sum(r.get_width() for r in modelled) == pytest.approx(p["step_s"], rel=1e-9)
    assert len(published) == 1 and published[0].get_hatch() == "///"
    assert published[0].get_width() == pytest.approx(1.3 * p["step_s"])
    fig.canvas.draw()
    legend = _extents(fig, [fig.labkit_legend])[0]
    assert 0 <= legend.x0 and legend.x1 <= fig.bbox.width
    for ax in fig.axes:
        texts = _extents(fig, ax.labkit_totals + [ax.title])
        for box in texts:
            assert 0 <= box.x0 and box.x1 <= legend.x0 and box.y1 <= fig.bbox.height, box
        for box in _extents(fig, ax.labkit_totals):
            assert box.x1 <= ax.bbox.x1, box          # each total inside its panel
    with pytest.raises(ValueError, match="not planner.EXPLAIN's"):
        step_breakdown_figure([("t", [("bar", {"gpu_fairies": 1.0})])])
    plt.close("all")

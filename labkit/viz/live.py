"""The explorers' live figure: one figure per explorer, redrawn in place, sent as PNG bytes.

A slider step costs what the figure costs to change and to paint, nothing more:
- the figure is made once (no pyplot, an Agg canvas of its own) and never replaced;
- a `Drawing` keeps its artists while its `shape` stays the same and only moves them
  (set_height, set_data, set_text, axis limits); a new shape clears and builds again;
- the plot helpers' many `tight_layout` calls during a build collapse into one, and an
  in-place update lays the figure out again only when a text that decides the margins
  changed size (`Layout`: tick labels' lengths, lines of titles and axis labels), and
  puts back a layout it made before for the same texts;
- text is painted from cached glyph layouts and bitmaps (`agg_text`: the same pixels);
- the picture is painted once (no `bbox_inches="tight"`, which paints twice) and encoded
  straight to PNG (`png_bytes`: rows unfiltered) into an `ipywidgets.Image`, whose bytes travel
  as one binary buffer (an Output widget re-sends a base64 display message and re-lays out its
  output area);
- sliders send their value when released (`continuous_update=False`), and a control that
  resets another (`linked`) causes one redraw, not one per reset.
"""
from __future__ import annotations

import contextlib
import struct
import threading
import zlib

import numpy as np
from matplotlib.figure import Figure
from matplotlib.offsetbox import HPacker, PackerBase, TextArea

from .agg_text import CachedTextCanvas

DPI = 100          # the inline backend's default: the pictures keep their size and look
PNG_LEVEL = 1      # zlib level: 6 (the default) is 30-40% slower for a few % fewer bytes


class Drawing:
    """A figure drawn once per shape, then updated in place.

    `shape(**values)` is a key for what artists the figure holds (how many bars, panels,
    legend entries); `build(fig, **values)` creates them; `update(fig, **values)` sets
    their data for `values` and returns the explorer's text line (HTML). While the key stays
    the same, only `update` runs.
    """

    relayout = True   # lay out again after an update when `layout_key` says it may move

    def shape(self, **values):
        return None

    def build(self, fig, **values):
        raise NotImplementedError

    def update(self, fig, **values):
        raise NotImplementedError

    def draw_on(self, fig, tight=True, **values):
        """Build and fill `fig` once, outside an explorer (a lesson's static figure, a test);
        one layout at the end, however many the panels' helpers ask for. Returns the text."""
        with one_tight_layout(fig):
            self.shape(**values)
            self.build(fig, **values)
            text = self.update(fig, **values)
            if tight:
                fig.tight_layout()
        return text


class Redraw(Drawing):
    """A plain `draw(fig, **values)` function as a Drawing that builds on every change."""

    relayout = False

    def __init__(self, draw):
        self.draw = draw
        self.text = ""

    def shape(self, **values):
        return object()   # never equal: every change clears and draws again

    def build(self, fig, **values):
        self.text = self.draw(fig, **values) or ""

    def update(self, fig, **values):
        return self.text


def live_figure(figsize, dpi=DPI):
    """A Figure outside pyplot with its own Agg canvas (nothing to close, no display hook)."""
    fig = Figure(figsize=figsize, dpi=dpi)
    CachedTextCanvas(fig)
    return fig


def legend_entries(ax):
    """[(label, entry)] of `ax`'s legend, in order: an entry is the box packing one handle
    with its label's TextArea, found through the packers' public get_children (the legend
    keeps its boxes in private attributes)."""
    legend = ax.get_legend()
    return [] if legend is None else list(_packed_entries(legend))


def _packed_entries(box):
    """Depth first through the packers only (not into each handle's drawing): an entry is an
    HPacker with a TextArea (the title's TextArea sits in a VPacker)."""
    for child in box.get_children():
        if isinstance(child, PackerBase):
            texts = [c for c in child.get_children() if isinstance(c, TextArea)]
            if texts and isinstance(child, HPacker):
                yield texts[0].get_text(), child
            else:
                yield from _packed_entries(child)


def legend_labels(ax):
    """The labels of `ax`'s legend entries that are shown (an entry can be hidden)."""
    return tuple(label for label, entry in legend_entries(ax) if entry.get_visible())


def show_legend_entries(ax, shown):
    """Show or hide `ax`'s legend entries by label ({label: bool}); a hidden entry leaves no
    gap (the legend packs its visible entries only)."""
    for label, entry in legend_entries(ax):
        if label in shown and entry.get_visible() != shown[label]:
            entry.set_visible(shown[label])


def layout_texts(fig):
    """The texts whose sizes decide tight_layout's margins, read without measuring any: per
    axes its y and x tick labels, title and axis labels, legend entries; the suptitle."""
    texts = [fig.get_suptitle()]
    for ax in fig.axes:
        if ax.get_visible():
            texts.append((tuple(t.get_text() for t in ax.yaxis.get_ticklabels()),
                          tuple(t.get_text() for t in ax.xaxis.get_ticklabels()),
                          tuple(ax.get_title(loc) for loc in ("left", "center", "right"))
                          + tuple(t.get_text() if t.get_visible() else "" for t in
                                  (ax.xaxis.label, ax.yaxis.label)),
                          legend_labels(ax)))
    return texts


def margins_key(texts):
    """What of `layout_texts` moves the margins: the longest line of the y tick labels
    (their width sets the left margin) and of the first and last x tick labels (they
    overhang the sides), the lines of titles and labels, the legend's shown entries (a
    legend beside the axes is as wide as its longest). Digits are equally wide, so ticks
    0 ... 250 GB -> 0 ... 300 GB move no margin and -> 0 ... 1,250 GB do."""
    key = [texts[0].count("\n")]
    for ys, xs, words, legend in texts[1:]:
        lengths = [len(x) for x in xs]
        widest = max((len(line) for y in ys for line in y.split("\n")), default=0)
        key.append((widest, tuple(lengths[:1] + lengths[-1:]),
                    tuple(w.count("\n") + bool(w) for w in words), legend))
    return key


class Layout:
    """tight_layout for a figure updated in place, run only when it may move something.

    The margins are kept by `margins_key`: while it holds, the layout stays. When it changes,
    a layout made before for the very same texts is put back (a slider stepping back and
    forth), else tight_layout runs and its subplot parameters are remembered."""

    PARAMS = ("left", "right", "bottom", "top", "wspace", "hspace")

    def __init__(self, fig, args=(), kwargs=None):
        self.fig, self.args, self.kwargs = fig, args, kwargs or {}
        self.made = {}
        self.key = None
        self.runs = 0    # tight_layout runs after the first (tests, benches)
        self._remember(layout_texts(fig))

    KEPT = 256   # layouts kept (a few per slider value; a long session starts over)

    def _remember(self, texts):
        self.key = margins_key(texts)
        if len(self.made) >= self.KEPT:
            self.made.clear()
        self.made[repr(texts)] = {p: getattr(self.fig.subplotpars, p) for p in self.PARAMS}

    # an x tick label hangs half its width past its axes' side: one that grows by up to 2
    # characters hangs ~1 character (6-7 px) further, inside tight_layout's pad (1.08 x the
    # font size, ~15 px), so it neither collides nor is cut: the layout stays
    X_SLACK = 2

    def _still_fits(self, key):
        """Whether `key` differs from the layout's own only by x tick labels that stay within
        X_SLACK characters of those the layout was made for (or shrink)."""
        if len(key) != len(self.key) or key[0] != self.key[0]:
            return False
        for (y, xs, words, legend), (y0, xs0, words0, legend0) in zip(key[1:], self.key[1:]):
            if y != y0 or words != words0 or legend != legend0 or len(xs) != len(xs0):
                return False
            if any(n > n0 + self.X_SLACK for n, n0 in zip(xs, xs0)):
                return False
        return True

    def refresh(self):
        texts = layout_texts(self.fig)
        key = margins_key(texts)
        if key == self.key:
            return
        known = self.made.get(repr(texts))
        if known is not None:
            self.fig.subplots_adjust(**known)
            self.key = key
            return
        if self._still_fits(key):
            return   # self.key stays the one the layout was made for
        self.fig.tight_layout(*self.args, **self.kwargs)
        self.runs += 1
        after = layout_texts(self.fig)   # ticks may change with the axes' sizes
        self._remember(after)
        self.made[repr(texts)] = self.made[repr(after)]   # the texts it was asked for too


@contextlib.contextmanager
def one_tight_layout(fig):
    """Collect the tight_layout calls made inside (each plot helper makes its own, and each
    measures every text) and make one at the end, with the last call's arguments."""
    asked = []
    fig.tight_layout = lambda *args, **kwargs: asked.append((args, kwargs))
    try:
        yield asked
    finally:
        del fig.tight_layout
    if asked:
        args, kwargs = asked[-1]
        fig.tight_layout(*args, **kwargs)


def png_bytes(fig):
    """Paint `fig` once on its Agg canvas and encode the pixels as PNG: 8-bit RGB, each row
    unfiltered, zlib level PNG_LEVEL. (PIL tries all five PNG row filters on every row: on
    these flat-coloured pictures that is most of its encoding time, for ~10% fewer bytes.)"""
    canvas = fig.canvas
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    height, width = rgba.shape[:2]
    rows = np.zeros((height, 1 + 3 * width), np.uint8)   # a row: filter type 0 (none), RGB...
    rows[:, 1:] = rgba[..., :3].reshape(height, 3 * width)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)   # 8 bits, RGB, no interlace
    return b"".join([b"\x89PNG\r\n\x1a\n", _png_chunk(b"IHDR", header),
                     _png_chunk(b"IDAT", zlib.compress(rows, PNG_LEVEL)), _png_chunk(b"IEND", b"")])


def _png_chunk(kind, data):
    """A PNG chunk: length, type, data, CRC-32 of type and data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


class LiveFigure:
    """A Drawing on one figure: `render(values)` returns (text, png bytes)."""

    def __init__(self, drawing, figsize, dpi=DPI):
        self.drawing = drawing if isinstance(drawing, Drawing) else Redraw(drawing)
        self.fig = live_figure(figsize, dpi)
        self._shape = self._unset = object()
        self.builds = 0      # how many times the figure was cleared and built (tests, benches)
        self.layout = None   # a Layout after a build that asked for tight_layout

    def render(self, values):
        _idle.clear()   # background prefetching waits while a step is drawn
        try:
            return self._render(values)
        finally:
            _idle.set()

    def _render(self, values):
        key = self.drawing.shape(**values)
        if self._shape is self._unset or key != self._shape:
            self.fig.clf()
            with one_tight_layout(self.fig) as asked:
                self.drawing.build(self.fig, **values)
                text = self.drawing.update(self.fig, **values)
            self.layout = Layout(self.fig, *asked[-1]) if asked else None   # and updates
            self._shape = key
            self.builds += 1
        else:
            text = self.drawing.update(self.fig, **values)
            if self.drawing.relayout and self.layout is not None:
                self.layout.refresh()
        return text or "", png_bytes(self.fig)


def continuous_off(controls):
    """Sliders send their value when released, not at every pixel of a drag."""
    for w in controls.values():
        if "continuous_update" in w.trait_names():
            w.continuous_update = False


def explorer_box(controls, drawing, figsize, linked=(), dpi=DPI):
    """The widget: rows of `controls`, the text line and the picture (an ipywidgets.Image).

    `linked` holds (control name, handler) pairs: a handler that changes other controls
    (options, disabled) runs first and the redraw waits until it is done.
    The VBox carries `.figure`, `.image`, `.text`, `.live` and `.redraw` for tests and benches.
    """
    import ipywidgets as widgets

    live = LiveFigure(drawing, figsize, dpi)
    text = widgets.HTML()
    width, _ = live.fig.canvas.get_width_height()
    image = widgets.Image(format="png", layout=widgets.Layout(max_width="100%",
                                                              width=f"{width}px"))
    hold = [0]

    def redraw(_change=None):
        if hold[0]:
            return
        line, png = live.render({name: w.value for name, w in controls.items()})
        text.value = line
        image.value = png

    def held(handler):
        def run(change):
            hold[0] += 1
            try:
                handler(change)
            finally:
                hold[0] -= 1
        return run

    for name, handler in linked:   # registered first: they run before the redraw
        controls[name].observe(held(handler), names="value")
    continuous_off(controls)
    for w in controls.values():
        w.observe(redraw, names="value")
    redraw()
    rows = list(controls.values())
    boxes = [widgets.HBox(rows[i:i + 3]) for i in range(0, len(rows), 3)]
    box = widgets.VBox(boxes + [text, image])
    box.figure, box.image, box.text, box.live, box.redraw = live.fig, image, text, live, redraw
    return box


# ------------------------------------------------------------------------------- prefetching

_generation = [0]
_idle = threading.Event()   # clear while a LiveFigure renders
_idle.set()


def prefetch(fn, calls):
    """Call `fn(*args)` for each args tuple of `calls` in a background thread, so that an
    lru_cached theory function has the values a slider is likely to take next ready before
    it takes them. Before each call the thread waits while any live figure renders: two
    threads sharing the GIL hand it over every 5 ms, which would make a step up to twice as
    slow. A call already running finishes first (one theory function: for the MoE
    explorer's expected drops, milliseconds to a tenth of a second at the largest shapes).
    A newer prefetch stops an older one between calls."""
    _generation[0] += 1
    mine = _generation[0]

    def work():
        for args in calls:
            _idle.wait()
            if _generation[0] != mine:
                return
            try:
                fn(*args)
            except Exception:   # noqa: BLE001 - a value the explorer would report, not warm
                pass
    threading.Thread(target=work, daemon=True, name="labkit-prefetch").start()


def neighbours(options, value, reach=2):
    """The options up to `reach` steps either side of `value`, nearest first."""
    options = list(options)
    i = options.index(value) if value in options else min(
        range(len(options)), key=lambda j: abs(options[j] - value))
    out = []
    for step in range(1, reach + 1):
        out += [options[j] for j in (i + step, i - step) if 0 <= j < len(options)]
    return out

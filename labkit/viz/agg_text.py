"""An Agg canvas that remembers text it has drawn: the same pixels, a fraction of the work.

An explorer's picture is painted again at every slider step, and most of its text (tick labels,
titles, legends, bar labels) is what it was one step before. Matplotlib's Agg renderer shapes
every string again (FreeType/HarfBuzz layout) and rasterises every glyph again; here
- a string's glyph layout is kept by (string, font properties, dpi, features, language);
- a glyph's bitmap is kept by (font, size, dpi, glyph, angle, sub-pixel offset): FreeType
  places a glyph at 1/64 pixel, and moving it by whole pixels moves its bitmap unchanged, so
  the bitmap rendered at the offset's fraction is reused at any whole-pixel position.
The pixels are those Matplotlib paints (tests/test_viz.py compares them).

Doing so needs Matplotlib's private glyph API. This module is the only place in labkit that
touches a private Matplotlib name, and `fast_path()` is its one guard: it probes, once, that
every name in PRIVATE exists, that Matplotlib's own text drawing (the code mirrored here) still
goes through them, and that a few strings painted both ways give the same pixels. Any miss (a
Matplotlib other than the one pyproject.toml pins) and FAST_PATH is False: the canvas makes
plain RendererAgg renderers and nothing private is touched.
"""
from __future__ import annotations

import math
import types

import numpy as np
from matplotlib.backends import backend_agg
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg

LAYOUTS_KEPT = 4096     # strings (a figure has ~100; a session of slider steps a few thousand)
GLYPHS_KEPT = 50_000    # glyph bitmaps of ~100-400 bytes each

# Every private Matplotlib name this module uses: (whose it is, the name, the Matplotlib code
# that uses it as this module does). The guard checks both: the name is there, and that code
# still calls it (this module mirrors that code).
PRIVATE = (
    ("FT2Font", "_layout", "RendererAgg.draw_text"),
    ("RendererAgg", "_prepare_font", "RendererAgg.draw_text"),
    ("RendererAgg", "_draw_text_glyphs_and_boxes", "RendererAgg.draw_text"),
    ("FT2Font", "_set_transform", "RendererAgg._draw_text_glyphs_and_boxes"),
    ("FT2Font", "_render_glyph", "RendererAgg._draw_text_glyphs_and_boxes"),
    ("RendererAgg", "_renderer", "RendererAgg._draw_text_glyphs_and_boxes"),
    ("fontManager", "_find_fonts_by_props", "RendererAgg._prepare_font"),
    ("CachedTextRenderer", "_get_font_height_metrics", "Text._get_layout"),   # a hook we fill
)

_layouts = {}
_glyphs = {}
_heights = {}   # {(font properties, dpi): (ascent, descent, line gap)}


def _remember(cache, limit, key, value):
    if len(cache) >= limit:
        cache.clear()   # a rare, cheap reset: the next steps fill it again
    cache[key] = value
    return value


def _names_called(function):
    """The attribute and global names a function's code (and its nested code) refers to."""
    names, codes = set(), [function.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


class CachedTextRenderer(RendererAgg):
    """RendererAgg whose draw_text reuses glyph layouts and glyph bitmaps (plain text only:
    mathtext and TeX take Matplotlib's own path)."""

    def draw_text(self, gc, x, y, s, prop, angle, ismath=False, mtext=None):
        if ismath:
            return super().draw_text(gc, x, y, s, prop, angle, ismath, mtext)
        features = mtext.get_fontfeatures() if mtext is not None else None
        language = mtext.get_language() if mtext is not None else None
        key = (s, hash(prop), self.dpi, tuple(features) if features else None, language)
        glyphs = _layouts.get(key)
        if glyphs is None:
            font = self._prepare_font(prop)
            items = font._layout(s, flags=backend_agg.get_hinting_flag(), features=features,
                                 language=language)
            glyphs = _remember(_layouts, LAYOUTS_KEPT, key,
                               [(i.ft_object, i.glyph_index, i.x, i.y) for i in items])
        self._draw_glyphs(gc, x, y, angle, prop.get_size_in_points(), glyphs)

    def _get_font_height_metrics(self, prop):
        """Text._get_layout's font-wide ascent, descent and line gap (the font's OS/2 or hhea
        table, as Matplotlib reads it), remembered per font and size: every text's layout
        asks, and finding the font and reading its tables is most of a short label's cost.
        (None, None, None) leaves it to Matplotlib."""
        key = (hash(prop), self.dpi)
        hit = _heights.get(key)
        if hit is None:
            from matplotlib.font_manager import fontManager, get_font
            font = get_font(fontManager._find_fonts_by_props(prop))
            hit = (None, None, None)
            for table_name, gap, ascent, descent in (
                    ("OS/2", "sTypoLineGap", "sTypoAscender", "sTypoDescender"),
                    ("hhea", "lineGap", "ascent", "descent")):
                table = font.get_sfnt_table(table_name)
                if table is None:
                    continue
                # Matplotlib's very expression (the same floating-point rounding)
                scale = (1 / font.get_sfnt_table("head")["unitsPerEm"]
                         * prop.get_size_in_points() * self.dpi / 72)
                hit = (table[ascent] * scale, -table[descent] * scale, table[gap] * scale)
                break
            _remember(_heights, LAYOUTS_KEPT, key, hit)
        return hit

    def _draw_glyphs(self, gc, x, y, angle, size, glyphs):
        """RendererAgg._draw_text_glyphs_and_boxes for plain text (no slant, no stretch, no
        boxes), each glyph's bitmap rendered once per sub-pixel offset."""
        from matplotlib.ft2font import RenderMode
        cos, sin = math.cos(math.radians(angle)), math.sin(math.radians(angle))
        antialiased = gc.get_antialiased()
        height = self.height
        matrix = None
        for font, glyph_index, dx, dy in glyphs:   # dy is upwards; FreeType's y too
            px = round(0x40 * (x + dx * cos - dy * sin))
            py = round(0x40 * (height - y + dx * sin + dy * cos))
            whole_x, part_x = divmod(px, 0x40)
            whole_y, part_y = divmod(py, 0x40)
            key = (font.fname, size, self.dpi, glyph_index, angle, part_x, part_y, antialiased)
            hit = _glyphs.get(key)
            if hit is None:
                if matrix is None:
                    matrix = (0x10000 * np.array([[cos, -sin], [sin, cos]])).round().astype(int)
                font.set_size(size, self.dpi)
                font._set_transform(matrix, [part_x, part_y])
                bitmap = font._render_glyph(
                    glyph_index, backend_agg.get_hinting_flag(),
                    RenderMode.NORMAL if antialiased else RenderMode.MONO)
                buffer = np.array(bitmap.buffer)   # a copy of our own to keep
                if not antialiased:
                    buffer *= 0xff
                hit = _remember(_glyphs, GLYPHS_KEPT, key, (buffer, bitmap.left, bitmap.top))
            buffer, left, top = hit
            # draw_text_image's y is downwards and names the bitmap's bottom side
            self._renderer.draw_text_image(buffer, left + whole_x,
                                           int(height) - (top + whole_y) + buffer.shape[0],
                                           0, gc)


def _paints_like_agg():
    """A few strings (rotated, sub-pixel placed, antialiased or not) painted by plain
    RendererAgg and by CachedTextRenderer, twice (the second from the caches): same pixels."""
    from matplotlib.font_manager import FontProperties
    prop = FontProperties(size=9)
    pictures = []
    for renderer in (RendererAgg(64, 40, 100), CachedTextRenderer(64, 40, 100),
                     CachedTextRenderer(64, 40, 100)):
        gc = renderer.new_gc()
        for x, y, s, angle, antialiased in ((2.3, 30.6, "Ag 1.5", 0, True),
                                            (50.7, 38.2, "fi 9", 90, True),
                                            (3.5, 12.4, "x=2", 30, False)):
            gc.set_antialiased(antialiased)
            renderer.draw_text(gc, x, y, s, prop, angle)
        gc.restore()
        pictures.append(np.asarray(renderer.buffer_rgba()).copy())
    return pictures[0][..., 3].any() and all(np.array_equal(pictures[0], p)
                                             for p in pictures[1:])


def fast_path():
    """Whether this Matplotlib is the one the cached renderer mirrors (the one guard: see the
    module's docstring). Probed once, at import, into FAST_PATH."""
    try:
        from matplotlib.font_manager import fontManager
        from matplotlib.ft2font import FT2Font
        from matplotlib.text import Text
        owners = {"FT2Font": FT2Font, "RendererAgg": RendererAgg(1, 1, 72), "Text": Text,
                  "fontManager": fontManager, "CachedTextRenderer": CachedTextRenderer}
        for owner, name, user in PRIVATE:
            user_owner, user_name = user.split(".")
            if not (hasattr(owners[owner], name) and
                    name in _names_called(getattr(owners[user_owner], user_name))):
                return False
        return bool(_paints_like_agg())
    except Exception:   # noqa: BLE001 - any private name that moved or changed: plain Agg
        return False


FAST_PATH = fast_path()


class CachedTextCanvas(FigureCanvasAgg):
    """FigureCanvasAgg drawing with CachedTextRenderer where FAST_PATH holds, with plain
    RendererAgg elsewhere (the renderer is made again when FAST_PATH changes: tests)."""

    _renderer_key = None

    def get_renderer(self):
        w, h = self.get_width_height(physical=True)
        renderer_class = CachedTextRenderer if FAST_PATH else RendererAgg
        key = w, h, self.figure.dpi, renderer_class
        if self._renderer_key != key:
            self.renderer = renderer_class(w, h, self.figure.dpi)
            self._renderer_key = key
        return self.renderer

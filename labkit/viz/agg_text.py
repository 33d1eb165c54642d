"""An Agg canvas that remembers text it has drawn: the same pixels, a fraction of the work.

An explorer's picture is painted again at every slider step, and most of its text (tick labels,
titles, legends, bar labels) is what it was one step before. Matplotlib's Agg renderer shapes
every string again (FreeType/HarfBuzz layout) and rasterises every glyph again; here
- a string's glyph layout is kept by (string, font properties, dpi, features, language);
- a glyph's bitmap is kept by (font, size, dpi, glyph, angle, sub-pixel offset): FreeType
  places a glyph at 1/64 pixel, and moving it by whole pixels moves its bitmap unchanged, so
  the bitmap rendered at the offset's fraction is reused at any whole-pixel position.
The pixels are those Matplotlib paints (tests/test_viz.py compares them). Where this
Matplotlib draws text differently (its private glyph API is missing), the canvas is plain Agg.
"""
from __future__ import annotations

import math

import numpy as np
from matplotlib.backends import backend_agg
from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg

LAYOUTS_KEPT = 4096     # strings (a figure has ~100; a session of slider steps a few thousand)
GLYPHS_KEPT = 50_000    # glyph bitmaps of ~100-400 bytes each

_layouts = {}
_glyphs = {}
_heights = {}   # {(font properties, dpi): (ascent, descent, line gap)}


def _supported():
    """This Matplotlib lays out text with FT2Font._layout and draws glyph by glyph."""
    try:
        from matplotlib.ft2font import FT2Font as font_class
    except ImportError:
        return False
    return (hasattr(font_class, "_layout")
            and hasattr(font_class, "_render_glyph") and hasattr(font_class, "_set_transform")
            and hasattr(RendererAgg, "_draw_text_glyphs_and_boxes")
            and hasattr(backend_agg, "get_hinting_flag") and hasattr(backend_agg, "RenderMode"))


SUPPORTED = _supported()


def _remember(cache, limit, key, value):
    if len(cache) >= limit:
        cache.clear()   # a rare, cheap reset: the next steps fill it again
    cache[key] = value
    return value


class CachedTextRenderer(RendererAgg):
    """RendererAgg whose draw_text reuses glyph layouts and glyph bitmaps (plain text only:
    mathtext and TeX take Matplotlib's own path)."""

    def draw_text(self, gc, x, y, s, prop, angle, ismath=False, mtext=None):
        if ismath or not SUPPORTED:
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
                    backend_agg.RenderMode.NORMAL if antialiased
                    else backend_agg.RenderMode.MONO)
                buffer = np.array(bitmap.buffer)   # a copy of our own to keep
                if not antialiased:
                    buffer *= 0xff
                hit = _remember(_glyphs, GLYPHS_KEPT, key, (buffer, bitmap.left, bitmap.top))
            buffer, left, top = hit
            # draw_text_image's y is downwards and names the bitmap's bottom side
            self._renderer.draw_text_image(buffer, left + whole_x,
                                           int(height) - (top + whole_y) + buffer.shape[0],
                                           0, gc)


class CachedTextCanvas(FigureCanvasAgg):
    """FigureCanvasAgg drawing with CachedTextRenderer."""

    def get_renderer(self):
        w, h = self.get_width_height(physical=True)
        key = w, h, self.figure.dpi
        if self._lastKey != key:
            self.renderer = CachedTextRenderer(w, h, self.figure.dpi)
            self._lastKey = key
        return self.renderer

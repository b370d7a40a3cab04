"""Line plots (loss curves) written as PNG files with the standard library only.

No plotting package is needed: the image is drawn into an RGB byte buffer (axes, ticks,
grid, one 2 px polyline per series, a legend, a title and axis labels in a tiny built-in
5x7 bitmap font) and encoded by hand (PNG signature, ``IHDR``, ``IDAT`` through :mod:`zlib`,
``IEND``, each chunk with its CRC-32).

Axis ranges cover the finite data and are widened to the enclosing "nice" tick values
(steps of 1, 2 or 5 times a power of ten), so data at a tick value lands on the frame.
Non-finite points (NaN, +-inf) are skipped and break the line where they occur, as in most
plotting tools; a point with no finite neighbour is drawn as a small square.
"""

from __future__ import annotations

import math
import struct
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from os import PathLike

__all__ = ["PALETTE", "read_png_size", "write_line_plot_png"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MIN_WIDTH = 160
_MIN_HEIGHT = 120
_MAX_SIDE = 16384
_MAX_LEGEND_CHARS = 24

Color = tuple[int, int, int]

_WHITE: Color = (255, 255, 255)
_BLACK: Color = (0, 0, 0)
_GRID: Color = (228, 228, 228)
_LEGEND_BORDER: Color = (150, 150, 150)

# Distinct, colour-blind-friendly-ish series colours (cycled when there are more series).
PALETTE: tuple[Color, ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)

# --------------------------------------------------------------------------------------------
# Bitmap font: 5 columns x 7 rows per glyph, '#' marks a lit pixel. Letters are drawn in
# upper case (lower-case input is shown upper-case); unknown characters are drawn as '?'.
# --------------------------------------------------------------------------------------------
_GLYPH_W = 5
_GLYPH_H = 7
_GLYPH_ROWS: dict[str, str] = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    "-": "..... ..... ..... ##### ..... ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "=": "..... ..... ##### ..... ##### ..... .....",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "[": ".###. .#... .#... .#... .#... .#... .###.",
    "]": ".###. ...#. ...#. ...#. ...#. ...#. .###.",
    "_": "..... ..... ..... ..... ..... ..... #####",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
    " ": "..... ..... ..... ..... ..... ..... .....",
}


def _build_font() -> dict[str, tuple[tuple[int, int], ...]]:
    """Turn the glyph table into lit-pixel offsets ``(column, row)`` per character."""
    font: dict[str, tuple[tuple[int, int], ...]] = {}
    for char, spec in _GLYPH_ROWS.items():
        rows = spec.split(" ")
        if len(rows) != _GLYPH_H or any(len(row) != _GLYPH_W for row in rows):
            raise AssertionError(f"glyph {char!r} is not {_GLYPH_W}x{_GLYPH_H}")
        font[char] = tuple(
            (col, row)
            for row, bits in enumerate(rows)
            for col, bit in enumerate(bits)
            if bit == "#"
        )
    return font


_FONT = _build_font()


def _glyph(char: str) -> tuple[tuple[int, int], ...]:
    return _FONT.get(char.upper(), _FONT["?"])


def _text_width(text: str, scale: int = 1) -> int:
    """Pixel width of ``text``: 5 px per glyph plus 1 px spacing, times ``scale``."""
    if not text:
        return 0
    return (len(text) * (_GLYPH_W + 1) - 1) * scale


# --------------------------------------------------------------------------------------------
# Canvas
# --------------------------------------------------------------------------------------------
class _Canvas:
    """An RGB image in a flat ``bytearray``; drawing outside the image is silently clipped."""

    def __init__(self, width: int, height: int) -> None:
        self.width = width
        self.height = height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(color)

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill the inclusive rectangle ``[x0, x1] x [y0, y1]``."""
        for y in range(max(y0, 0), min(y1, self.height - 1) + 1):
            for x in range(max(x0, 0), min(x1, self.width - 1) + 1):
                self.set(x, y, color)

    def hline(self, x0: int, x1: int, y: int, color: Color) -> None:
        self.fill_rect(min(x0, x1), y, max(x0, x1), y, color)

    def vline(self, x: int, y0: int, y1: int, color: Color) -> None:
        self.fill_rect(x, min(y0, y1), x, max(y0, y1), color)

    def thick_line(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """A 2 px wide line (Bresenham, each step painting a 2x2 block)."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx = 1 if x0 < x1 else -1
        sy = 1 if y0 < y1 else -1
        err = dx + dy
        x, y = x0, y0
        while True:
            self.fill_rect(x, y, x + 1, y + 1, color)
            if x == x1 and y == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x += sx
            if e2 <= dx:
                err += dx
                y += sy

    def text(self, x: int, y: int, text: str, color: Color, scale: int = 1) -> None:
        """Draw ``text`` with its top-left corner at ``(x, y)``."""
        for i, char in enumerate(text):
            left = x + i * (_GLYPH_W + 1) * scale
            for col, row in _glyph(char):
                px, py = left + col * scale, y + row * scale
                self.fill_rect(px, py, px + scale - 1, py + scale - 1, color)

    def text_up(self, x: int, y: int, text: str, color: Color) -> None:
        """Draw ``text`` rotated 90 degrees anticlockwise, reading upwards from ``(x, y)``.

        ``(x, y)`` is the bottom-left corner of the rotated text's bounding box.
        """
        for i, char in enumerate(text):
            base = y - i * (_GLYPH_W + 1)
            for col, row in _glyph(char):
                self.set(x + row, base - col, color)


# --------------------------------------------------------------------------------------------
# Ticks and labels
# --------------------------------------------------------------------------------------------
def _data_range(values: Sequence[float]) -> tuple[float, float]:
    """Min and max of ``values`` (all finite), padded when they coincide; (0, 1) when empty."""
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    if lo == hi:
        pad = abs(lo) * 0.1 if lo != 0 else 1.0
        lo, hi = max(lo - pad, -sys.float_info.max), min(hi + pad, sys.float_info.max)
        if lo == hi:  # |lo| so small that the padding vanished (subnormal values)
            lo, hi = lo - 1.0, hi + 1.0
    return lo, hi


def _nice_ticks(lo: float, hi: float, target: int) -> list[float]:
    """About ``target`` evenly spaced round values covering ``[lo, hi]`` (lo < hi)."""
    span = hi - lo
    raw = span / max(target, 1)
    if not (math.isfinite(span) and raw > 0 and math.isfinite(raw)):
        return [lo, hi]
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = magnitude * 10
    for mult in (1.0, 2.0, 5.0, 10.0):
        if mult * magnitude >= raw * (1 - 1e-9):
            step = mult * magnitude
            break
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    ticks = [(first + i) * step for i in range(last - first + 1)]
    if len(ticks) < 2 or not all(math.isfinite(t) for t in ticks) or ticks[0] == ticks[-1]:
        return [lo, hi]
    return ticks


def _format_ticks(ticks: Sequence[float]) -> list[str]:
    """Short labels for ``ticks``: fixed-point, or scientific (``1.5e4``) for big/small values."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 0.0
    biggest = max(abs(t) for t in ticks)
    if step <= 0 or not math.isfinite(step) or biggest == 0:
        return [_compact_float(t) for t in ticks]
    step_exp = math.floor(math.log10(step) + 1e-9)
    if biggest >= 1e6 or biggest < 1e-3:
        digits = min(max(math.floor(math.log10(biggest)) - step_exp, 0), 6)
        return [_short_exponent(f"{t:.{digits}e}") if t != 0 else "0" for t in ticks]
    decimals = min(max(-step_exp, 0), 12)
    labels = [f"{t:.{decimals}f}" for t in ticks]
    return ["0" if float(label) == 0 else label for label in labels]  # no "-0.0"


def _short_exponent(text: str) -> str:
    """``"1.50e+04"`` -> ``"1.50e4"``, ``"2e-05"`` -> ``"2e-5"``."""
    mantissa, _, exponent = text.partition("e")
    sign = "-" if exponent.startswith("-") else ""
    return f"{mantissa}e{sign}{int(exponent.lstrip('+-'))}"


def _compact_float(value: float) -> str:
    return _short_exponent(f"{value:.3e}") if value != 0 else "0"


# --------------------------------------------------------------------------------------------
# Layout and drawing
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Box:
    """The plot frame in pixels (inclusive) and the data range it shows."""

    left: int
    top: int
    right: int
    bottom: int
    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    def px(self, x: float) -> int:
        return round(self.left + _fraction(x, self.x_lo, self.x_hi) * (self.right - self.left))

    def py(self, y: float) -> int:
        return round(self.bottom - _fraction(y, self.y_lo, self.y_hi) * (self.bottom - self.top))


def _fraction(value: float, lo: float, hi: float) -> float:
    """Where ``value`` lies in ``[lo, hi]`` as 0..1 (halved first: no overflow near 1e308)."""
    return (value / 2 - lo / 2) / (hi / 2 - lo / 2)


def _clean_series(
    series: Mapping[str, Sequence[tuple[float, float]]],
) -> list[tuple[str, list[tuple[float, float] | None]]]:
    """Validate and convert the points; a non-finite point becomes ``None`` (a line break)."""
    cleaned: list[tuple[str, list[tuple[float, float] | None]]] = []
    for name, points in series.items():
        if not isinstance(name, str):
            raise TypeError(f"series names must be str, got {name!r}")
        out: list[tuple[float, float] | None] = []
        for i, point in enumerate(points):
            try:
                x_raw, y_raw = point
                x, y = float(x_raw), float(y_raw)
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"series[{name!r}][{i}] must be an (x, y) pair of numbers, got {point!r}"
                ) from exc
            out.append((x, y) if math.isfinite(x) and math.isfinite(y) else None)
        cleaned.append((name, out))
    return cleaned


def _legend_label(name: str) -> str:
    if len(name) <= _MAX_LEGEND_CHARS:
        return name
    return name[: _MAX_LEGEND_CHARS - 2] + ".."


def write_line_plot_png(
    path: str | PathLike[str],
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    width: int = 800,
    height: int = 480,
) -> None:
    """Write a line plot of ``series`` (name -> ``(x, y)`` points) to the PNG file ``path``.

    Each series is a 2 px polyline in its own colour, drawn in the given point order; the
    legend (right of the plot) lists the series in mapping order. Letters are drawn upper-case
    by the built-in 5x7 font. Empty series, all-non-finite data and constant values are
    accepted (the axis range falls back to ``[0, 1]`` or is padded around the value).

    Raises:
        ValueError: ``width``/``height`` out of range (at least 160x120, at most 16384), or a
            point that is not a pair of numbers (the message names the series and index).
        TypeError: a series name that is not a string.
    """
    for arg, value, minimum in (("width", width, _MIN_WIDTH), ("height", height, _MIN_HEIGHT)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{arg} must be an int, got {value!r}")
        if not minimum <= value <= _MAX_SIDE:
            raise ValueError(f"{arg} must be in [{minimum}, {_MAX_SIDE}], got {value}")
    cleaned = _clean_series(series)
    canvas = _Canvas(width, height)
    _draw(canvas, cleaned, title=title, x_label=x_label, y_label=y_label)
    with open(path, "wb") as fh:
        fh.write(_encode_png(canvas.width, canvas.height, canvas.pixels))


def _draw(
    canvas: _Canvas,
    series: list[tuple[str, list[tuple[float, float] | None]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
) -> None:
    finite = [p for _, points in series for p in points if p is not None]
    x_lo, x_hi = _data_range([p[0] for p in finite])
    y_lo, y_hi = _data_range([p[1] for p in finite])

    tick_len, gap = 5, 4
    top = 12 + 14 + 10 if title else 14
    bottom_margin = tick_len + gap + _GLYPH_H + 8 + (_GLYPH_H + 8 if x_label else 0)
    bottom = canvas.height - 1 - bottom_margin
    y_ticks = _nice_ticks(y_lo, y_hi, max(2, min(10, (bottom - top) // 50)))
    y_labels = _format_ticks(y_ticks)

    legend = [_legend_label(name) for name, _ in series]
    legend_w = (8 + 18 + 6 + max(_text_width(s) for s in legend) + 8) if legend else 0
    left = 8 + (_GLYPH_H + 8 if y_label else 0) + max(map(_text_width, y_labels)) + gap + tick_len
    right = canvas.width - 1 - (12 + legend_w + 8 if legend else 16)
    x_ticks = _nice_ticks(x_lo, x_hi, max(2, min(10, (right - left) // 90)))
    x_labels = _format_ticks(x_ticks)
    right = min(right, canvas.width - 1 - _text_width(x_labels[-1]) // 2 - 4)
    if right - left < 20 or bottom - top < 20:
        raise ValueError(
            f"width={canvas.width}, height={canvas.height} leave no room for the plot area "
            "after labels and legend; make the image larger or the names shorter"
        )
    box = _Box(left, top, right, bottom, x_ticks[0], x_ticks[-1], y_ticks[0], y_ticks[-1])

    # Grid, then frame, ticks and tick labels.
    for t in x_ticks[1:-1]:
        canvas.vline(box.px(t), top + 1, bottom - 1, _GRID)
    for t in y_ticks[1:-1]:
        canvas.hline(left + 1, right - 1, box.py(t), _GRID)
    canvas.hline(left, right, top, _BLACK)
    canvas.hline(left, right, bottom, _BLACK)
    canvas.vline(left, top, bottom, _BLACK)
    canvas.vline(right, top, bottom, _BLACK)
    for t, label in zip(x_ticks, x_labels, strict=True):
        x = box.px(t)
        canvas.vline(x, bottom, bottom + tick_len, _BLACK)
        canvas.text(x - _text_width(label) // 2, bottom + tick_len + gap, label, _BLACK)
    for t, label in zip(y_ticks, y_labels, strict=True):
        y = box.py(t)
        canvas.hline(left - tick_len, left, y, _BLACK)
        canvas.text(left - tick_len - gap - _text_width(label), y - _GLYPH_H // 2, label, _BLACK)

    # Title and axis labels.
    if title:
        tw = _text_width(title, 2)
        canvas.text(max((left + right) // 2 - tw // 2, 4), 12, title, _BLACK, scale=2)
    if x_label:
        lw = _text_width(x_label)
        y = bottom + tick_len + gap + _GLYPH_H + 8
        canvas.text(max((left + right) // 2 - lw // 2, 4), y, x_label, _BLACK)
    if y_label:
        lh = _text_width(y_label)
        canvas.text_up(8, min((top + bottom) // 2 + lh // 2, canvas.height - 4), y_label, _BLACK)

    # Data on top of the frame, so values at the range ends stay visible.
    for index, (_, points) in enumerate(series):
        _draw_polyline(canvas, box, points, PALETTE[index % len(PALETTE)])

    # Legend, right of the plot area.
    if legend:
        lx0, ly0 = right + 12, top
        lx1, ly1 = lx0 + legend_w - 1, ly0 + 6 + 12 * len(legend)
        canvas.fill_rect(lx0, ly0, lx1, ly1, _WHITE)
        canvas.hline(lx0, lx1, ly0, _LEGEND_BORDER)
        canvas.hline(lx0, lx1, ly1, _LEGEND_BORDER)
        canvas.vline(lx0, ly0, ly1, _LEGEND_BORDER)
        canvas.vline(lx1, ly0, ly1, _LEGEND_BORDER)
        for index, label in enumerate(legend):
            row_y = ly0 + 6 + 12 * index
            color = PALETTE[index % len(PALETTE)]
            canvas.fill_rect(lx0 + 8, row_y + 3, lx0 + 8 + 17, row_y + 4, color)
            canvas.text(lx0 + 8 + 18 + 6, row_y, label, _BLACK)


def _draw_polyline(
    canvas: _Canvas, box: _Box, points: list[tuple[float, float] | None], color: Color
) -> None:
    """Connect consecutive finite points; an isolated finite point becomes a 4x4 square."""
    pixels = [None if p is None else (box.px(p[0]), box.py(p[1])) for p in points]
    for i, here in enumerate(pixels):
        if here is None:
            continue
        prev = pixels[i - 1] if i > 0 else None
        nxt = pixels[i + 1] if i + 1 < len(pixels) else None
        if nxt is not None:
            canvas.thick_line(here[0], here[1], nxt[0], nxt[1], color)
        elif prev is None:
            canvas.fill_rect(here[0] - 1, here[1] - 1, here[0] + 2, here[1] + 2, color)


# --------------------------------------------------------------------------------------------
# PNG encoding
# --------------------------------------------------------------------------------------------
def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB, non-interlaced PNG; every scanline uses filter type 0 (none)."""
    stride = width * 3
    raw = bytearray()
    for y in range(height):
        raw.append(0)
        raw += rgb[y * stride : (y + 1) * stride]
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        _PNG_SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(bytes(raw), 6))
        + _chunk(b"IEND", b"")
    )


def read_png_size(path: str | PathLike[str]) -> tuple[int, int]:
    """``(width, height)`` of the PNG file at ``path``, read from its ``IHDR`` chunk.

    Raises:
        ValueError: the file is not a PNG (bad signature, missing or corrupt ``IHDR``).
    """
    with open(path, "rb") as fh:
        head = fh.read(8 + 8 + 13 + 4)
    if head[:8] != _PNG_SIGNATURE:
        raise ValueError(f"{path!s} is not a PNG file (bad signature)")
    if len(head) < 33 or head[12:16] != b"IHDR":
        raise ValueError(f"{path!s}: the first chunk is not IHDR")
    (length,) = struct.unpack(">I", head[8:12])
    (crc,) = struct.unpack(">I", head[29:33])
    if length != 13 or zlib.crc32(head[12:29]) & 0xFFFFFFFF != crc:
        raise ValueError(f"{path!s}: corrupt IHDR chunk")
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)

"""Tests for hp_train.plot: the PNG container, the drawing and the edge cases.

The PNG is decoded here independently (chunks, CRCs, zlib, scanline filters) so the tests
check the file a viewer would see, not the encoder's internals.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from hp_train.plot import PALETTE, read_png_size, write_line_plot_png

SIGNATURE = b"\x89PNG\r\n\x1a\n"
BLACK = (0, 0, 0)
WHITE = (255, 255, 255)


@dataclass
class Image:
    width: int
    height: int
    chunks: list[bytes]
    rows: list[bytes]

    def pixel(self, x: int, y: int) -> tuple[int, int, int]:
        row = self.rows[y]
        return row[3 * x], row[3 * x + 1], row[3 * x + 2]

    def positions(self, color: tuple[int, int, int]) -> list[tuple[int, int]]:
        return [
            (x, y)
            for y in range(self.height)
            for x in range(self.width)
            if self.pixel(x, y) == color
        ]

    def near(self, x: int, y: int, color: tuple[int, int, int], radius: int = 2) -> bool:
        return any(
            self.pixel(x + dx, y + dy) == color
            for dx in range(-radius, radius + 1)
            for dy in range(-radius, radius + 1)
            if 0 <= x + dx < self.width and 0 <= y + dy < self.height
        )

    def frame(self) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of the black plot frame: the long black lines."""
        rows = [
            y
            for y in range(self.height)
            if sum(self.pixel(x, y) == BLACK for x in range(self.width)) > 0.4 * self.width
        ]
        cols = [
            x
            for x in range(self.width)
            if sum(self.pixel(x, y) == BLACK for y in range(self.height)) > 0.4 * self.height
        ]
        assert rows, "no horizontal frame line found"
        assert cols, "no vertical frame line found"
        return min(cols), min(rows), max(cols), max(rows)


def decode_png(path: Path) -> Image:
    """Parse and fully validate an 8-bit RGB PNG (any of the five scanline filters)."""
    data = path.read_bytes()
    assert data[:8] == SIGNATURE
    pos, chunks, idat = 8, [], b""
    header = b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, f"bad CRC in {kind!r}"
        chunks.append(kind)
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert pos == len(data), "trailing bytes after the last chunk"
    assert chunks[0] == b"IHDR"
    assert chunks[-1] == b"IEND"
    assert b"IDAT" in chunks
    width, height, depth, color_type, compression, filt, interlace = struct.unpack(
        ">IIBBBBB", header
    )
    assert (depth, color_type, compression, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(idat)
    stride = width * 3
    assert len(raw) == height * (stride + 1)
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        ftype = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - 3] if i >= 3 else 0
            b = prev[i]
            c = prev[i - 3] if i >= 3 else 0
            if ftype == 0:
                pred = 0
            elif ftype == 1:
                pred = a
            elif ftype == 2:
                pred = b
            elif ftype == 3:
                pred = (a + b) // 2
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            else:
                raise AssertionError(f"bad filter type {ftype} in row {y}")
            line[i] = (line[i] + pred) & 0xFF
        rows.append(bytes(line))
        prev = line
    return Image(width, height, chunks, rows)


def plot(tmp_path: Path, series: dict[str, list[tuple[float, float]]], **kwargs: object) -> Image:
    path = tmp_path / "plot.png"
    options: dict[str, object] = {"title": "loss", "x_label": "step", "y_label": "loss"}
    options.update(kwargs)
    write_line_plot_png(path, series, **options)  # type: ignore[arg-type]
    return decode_png(path)


# --------------------------------------------------------------------------------------------
# File format
# --------------------------------------------------------------------------------------------
def test_png_structure_and_size(tmp_path: Path) -> None:
    path = tmp_path / "curve.png"
    write_line_plot_png(
        path,
        {"a": [(0, 1.0), (1, 2.0)]},
        title="t",
        x_label="x",
        y_label="y",
        width=321,
        height=203,
    )
    image = decode_png(path)
    assert (image.width, image.height) == (321, 203)
    assert read_png_size(path) == (321, 203)
    assert image.chunks == [b"IHDR", b"IDAT", b"IEND"]


def test_default_size_and_white_background(tmp_path: Path) -> None:
    image = plot(tmp_path, {"a": [(0, 1.0), (10, 2.0)]})
    assert (image.width, image.height) == (800, 480)
    for corner in ((0, 0), (799, 0), (0, 479), (799, 479)):
        assert image.pixel(*corner) == WHITE
    white = sum(row.count(b"\xff\xff\xff") for row in image.rows)  # rough: most is background
    assert white > 0.5 * image.width * image.height


def test_read_png_size_rejects_other_files(tmp_path: Path) -> None:
    path = tmp_path / "not.png"
    path.write_bytes(b"GIF89a" + bytes(40))
    with pytest.raises(ValueError, match="not a PNG"):
        read_png_size(path)
    bad_crc = tmp_path / "bad.png"
    write_line_plot_png(bad_crc, {}, title="", x_label="", y_label="")
    data = bytearray(bad_crc.read_bytes())
    data[20] ^= 0xFF  # inside the IHDR data
    bad_crc.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt IHDR"):
        read_png_size(bad_crc)


# --------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------
def test_rising_and_falling_lines_cross_the_plot_diagonally(tmp_path: Path) -> None:
    # x in [0, 100] and y in [0, 10] are already "nice", so the data fills the frame exactly.
    up = [(float(i), i / 10) for i in range(101)]
    down = [(float(i), 10 - i / 10) for i in range(101)]
    image = plot(tmp_path, {"up": up, "down": down})
    left, top, right, bottom = image.frame()
    assert right - left > 400
    assert bottom - top > 300
    for t in (0.1, 0.25, 0.4, 0.6, 0.75, 0.9):
        x = round(left + t * (right - left))
        assert image.near(x, round(bottom - t * (bottom - top)), PALETTE[0]), t
        assert image.near(x, round(top + t * (bottom - top)), PALETTE[1]), t
    # Nothing of the rising line far from its diagonal.
    for x, y in image.positions(PALETTE[0]):
        if left <= x <= right:
            expected = bottom - (x - left) / (right - left) * (bottom - top)
            assert abs(y - expected) <= 3, (x, y)


def test_legend_sits_right_of_the_plot_with_each_colour(tmp_path: Path) -> None:
    image = plot(tmp_path, {"train": [(0, 3.0), (5, 1.0)], "val": [(0, 4.0), (5, 2.0)]})
    _, top, right, _ = image.frame()
    for color in PALETTE[:2]:
        legend = [(x, y) for x, y in image.positions(color) if x > right + 4]
        assert legend, f"no legend sample in {color}"
        assert all(top <= y <= top + 40 for _, y in legend)
    # Legend text (black) right of the plot.
    assert any(
        image.pixel(x, y) == BLACK
        for x in range(right + 30, right + 60)
        for y in range(top, top + 30)
    )


def test_axes_have_ticks_labels_and_title(tmp_path: Path) -> None:
    image = plot(tmp_path, {"a": [(0, 0.0), (100, 10.0)]}, title="Loss (run 1)")
    left, top, right, bottom = image.frame()
    # Outward tick marks below the bottom axis at both ends, left of the left axis at both ends.
    assert image.pixel(left, bottom + 3) == BLACK
    assert image.pixel(right, bottom + 3) == BLACK
    assert image.pixel(left - 3, bottom) == BLACK
    assert image.pixel(left - 3, top) == BLACK
    # Tick label digits under the x axis and left of the y axis.
    assert any(
        image.pixel(x, y) == BLACK
        for x in range(left - 8, left + 8)
        for y in range(bottom + 8, bottom + 18)
    )
    assert any(
        image.pixel(x, y) == BLACK for x in range(0, left - 6) for y in range(top - 4, top + 5)
    )
    # Title (scale 2) above the frame, roughly centred.
    title = [
        (x, y) for y in range(top - 4) for x in range(image.width) if image.pixel(x, y) == BLACK
    ]
    assert title
    centre = (min(x for x, _ in title) + max(x for x, _ in title)) / 2
    assert abs(centre - (left + right) / 2) < 10
    # Rotated y label at the far left, x label at the bottom.
    assert any(image.pixel(x, y) == BLACK for x in range(0, 20) for y in range(top, bottom))
    assert any(
        image.pixel(x, y) == BLACK
        for x in range(left, right)
        for y in range(bottom + 20, image.height)
    )


# --------------------------------------------------------------------------------------------
# Edge cases
# --------------------------------------------------------------------------------------------
def test_empty_inputs(tmp_path: Path) -> None:
    image = plot(tmp_path, {})
    image.frame()  # axes are still drawn
    image = plot(tmp_path, {"empty": []}, title="", x_label="", y_label="")
    assert image.positions(PALETTE[0])  # only the legend sample


def test_single_point_is_drawn_in_the_middle(tmp_path: Path) -> None:
    image = plot(tmp_path, {"one": [(3.0, 5.0)]})
    left, top, right, bottom = image.frame()
    inside = [(x, y) for x, y in image.positions(PALETTE[0]) if x < right]
    assert inside
    assert all(abs(x - (left + right) / 2) <= 3 for x, _ in inside)
    assert all(abs(y - (top + bottom) / 2) <= 3 for _, y in inside)


def test_constant_values_give_a_flat_line_in_the_middle(tmp_path: Path) -> None:
    image = plot(tmp_path, {"flat": [(float(i), 2.5) for i in range(50)]})
    left, top, right, bottom = image.frame()
    inside = [(x, y) for x, y in image.positions(PALETTE[0]) if x <= right]
    assert max(x for x, _ in inside) - min(x for x, _ in inside) > 0.9 * (right - left)
    assert all(abs(y - (top + bottom) / 2) <= 3 for _, y in inside)


def test_non_finite_points_are_skipped_and_break_the_line(tmp_path: Path) -> None:
    points = [(0.0, 0.0), (1.0, 1.0), (2.0, math.nan), (3.0, 3.0), (4.0, 4.0), (5.0, math.inf)]
    points += [(math.inf, 1.0), (-math.inf, 2.0)]
    image = plot(tmp_path, {"gappy": points})
    left, top, right, bottom = image.frame()
    # x in [0, 4] spans the frame; x = 2 (the NaN) is in the middle and has no line.
    mid = (left + right) // 2
    column = [y for x, y in image.positions(PALETTE[0]) if abs(x - mid) <= 4]
    assert column == []
    assert image.near(left + (right - left) // 8, bottom - (bottom - top) // 8, PALETTE[0])
    assert image.near(right - (right - left) // 8, top + (bottom - top) // 8, PALETTE[0])


def test_all_non_finite_and_extreme_values(tmp_path: Path) -> None:
    plot(tmp_path, {"nan": [(0.0, math.nan), (1.0, -math.inf)]})
    plot(tmp_path, {"huge": [(0.0, -1.7e308), (1.0, 1.7e308)]})
    plot(tmp_path, {"huge_const": [(0.0, 1.7e308), (1.0, 1.7e308)]})
    plot(tmp_path, {"tiny": [(0.0, 1e-300), (1e-300, 3e-300)]})
    plot(tmp_path, {"big": [(0.0, 1.2e6), (1e9, 1.5e6)], "lr": [(0.0, 3e-4), (1e9, 1e-5)]})
    plot(tmp_path, {"close": [(0.0, 1.0), (1.0, 1.0 + 1e-12)]})


def test_many_series_cycle_the_palette(tmp_path: Path) -> None:
    series = {f"s{i}": [(0.0, float(i)), (1.0, float(i) + 0.5)] for i in range(len(PALETTE) + 3)}
    image = plot(tmp_path, series, height=480)
    for color in PALETTE:
        assert image.positions(color)


def test_unknown_characters_and_long_names_are_drawn(tmp_path: Path) -> None:
    name = "a very long series name that will be truncated in the legend"
    plot(tmp_path, {name: [(0.0, 1.0), (1.0, 2.0)]}, title="naïve € ~ title", y_label="μ loss")


# --------------------------------------------------------------------------------------------
# Argument errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"width": 10}, "width"),
        ({"height": 50}, "height"),
        ({"width": 100_000}, "width"),
        ({"width": 640.0}, "width"),
        ({"height": True}, "height"),
    ],
)
def test_bad_size_is_rejected(tmp_path: Path, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plot(tmp_path, {"a": [(0.0, 1.0)]}, **kwargs)


def test_bad_points_name_the_series(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"series\['loss'\]\[1\]"):
        plot(tmp_path, {"loss": [(0.0, 1.0), (1.0,)]})  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"series\['loss'\]\[0\]"):
        plot(tmp_path, {"loss": [("a", 1.0)]})  # type: ignore[list-item]
    with pytest.raises(TypeError, match="series names"):
        plot(tmp_path, {3: [(0.0, 1.0)]})  # type: ignore[dict-item]


def test_names_too_long_for_a_small_image(tmp_path: Path) -> None:
    series = {f"series number {i} with a long name": [(0.0, 1.0)] for i in range(3)}
    with pytest.raises(ValueError, match="no room"):
        plot(tmp_path, series, width=160, height=120)

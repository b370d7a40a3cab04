"""Tests for hp_train.observe.plot: the PNG matplotlib writes, read back through PIL.

Where a line should be, the test asks the figure itself (the same figure ``curves_figure``
builds for the same arguments) for the pixel of a data point, then looks at that pixel of the
written file: the checks are about the file a viewer sees.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from PIL import Image

import hp_train.observe.plot as plot
from hp_train.observe.plot import (
    MISSING_MATPLOTLIB,
    PALETTE,
    curves_figure,
    plot_available,
    write_curves,
)

Points = list[tuple[float, float]]

# Lines are antialiased: a pixel on a line is within this distance (per channel, 0..255) of
# its colour. Measured at 640x400: every sampled point of a line has a pixel of exactly its
# colour within 2 px; plot-area pixels away from the lines (background, grid) differ from
# either colour by at least 180, and one series' pixels differ from the other's by 184.
COLOUR_TOLERANCE = 40


def rgb(hex_colour: str) -> tuple[int, int, int]:
    value = int(hex_colour.lstrip("#"), 16)
    return value >> 16, (value >> 8) & 0xFF, value & 0xFF


BLUE, ORANGE = rgb(PALETTE[0]), rgb(PALETTE[1])


@dataclass
class Drawn:
    """The written PNG as an (H, W, 3) array, and the figure that maps data to its pixels."""

    pixels: npt.NDArray[np.int16]
    figure: Figure

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    def at(self, x: float, y: float) -> tuple[int, int]:
        """The (column, row) of data point (x, y) in the PNG (rows counted from the top)."""
        dx, dy = self.figure.axes[0].transData.transform((x, y))
        return int(dx), int(self.height - dy)

    def mask(self, colour: tuple[int, int, int]) -> npt.NDArray[np.bool_]:
        distance: npt.NDArray[np.int16] = np.abs(self.pixels - np.array(colour)).max(axis=2)
        return distance <= COLOUR_TOLERANCE

    def near(self, column: int, row: int, colour: tuple[int, int, int], radius: int = 2) -> bool:
        return bool(
            self.mask(colour)[
                row - radius : row + radius + 1, column - radius : column + radius + 1
            ].any()
        )

    def legend(self) -> Legend:
        legend = self.figure.axes[0].get_legend()
        assert legend is not None
        return legend

    def legend_texts(self) -> list[str]:
        return [text.get_text() for text in self.legend().get_texts()]

    def plot_area_mask(self) -> npt.NDArray[np.bool_]:
        """Pixels inside the axes but outside the legend box."""
        inside = np.zeros(self.pixels.shape[:2], dtype=bool)
        box = self.figure.axes[0].get_window_extent()
        inside[self._rows(box.y0, box.y1), int(box.x0) + 2 : int(box.x1) - 1] = True
        legend = self.legend().get_window_extent()
        inside[
            self._rows(legend.y0 - 2, legend.y1 + 2), int(legend.x0) - 2 : int(legend.x1) + 3
        ] = False
        return inside

    def _rows(self, y0: float, y1: float) -> slice:
        return slice(max(int(self.height - y1), 0) + 2, int(self.height - y0) - 1)


def draw(tmp_path: Path, series: dict[str, Points], **kwargs: object) -> Drawn:
    options: dict[str, object] = {"title": "loss", "x_label": "step", "y_label": "loss"}
    options.update(kwargs)
    path = tmp_path / "curves.png"
    assert write_curves(path, series, **options) is True  # type: ignore[arg-type]
    with Image.open(path) as image:
        assert image.format == "PNG"
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    figure = curves_figure(series, **options)  # type: ignore[arg-type]
    figure.canvas.draw()  # the layout (and so the data -> pixel map) is set when drawn
    return Drawn(pixels, figure)


def test_plot_available_with_the_extra_installed() -> None:
    assert plot_available() is True


def test_png_of_the_asked_size_with_both_series(tmp_path: Path) -> None:
    train = [(float(x), 1 + x / 10) for x in range(101)]
    evaluation = [(float(x), 11 - x / 10) for x in range(0, 101, 10)]
    drawn = draw(tmp_path, {"train loss": train, "eval loss": evaluation}, width=640, height=400)
    assert drawn.pixels.shape == (400, 640, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]  # no ".tmp" left behind
    assert tuple(drawn.pixels[0, 0]) == (255, 255, 255)
    assert drawn.legend_texts() == ["train loss", "eval loss"]
    for t in (10, 25, 40, 60, 75, 90):
        assert drawn.near(*drawn.at(t, 1 + t / 10), BLUE), t
        assert drawn.near(*drawn.at(t, 11 - t / 10), ORANGE), t
        assert not drawn.near(*drawn.at(t, 1 + t / 10), ORANGE, radius=1), t
    # Every blue pixel of the plot area lies on the rising line (none stray elsewhere).
    rows, columns = np.nonzero(drawn.mask(BLUE) & drawn.plot_area_mask())
    assert len(rows) > 400
    (c0, r0), (c1, r1) = drawn.at(0, 1), drawn.at(100, 11)
    slope = (r1 - r0) / (c1 - c0)
    assert np.abs(rows - (r0 + slope * (columns - c0))).max() <= 3


def test_default_size(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    assert write_curves(
        path, {"loss": [(0.0, 3.0), (1.0, 2.0)]}, title="t", x_label="x", y_label="y"
    )
    with Image.open(path) as image:
        assert image.size == (800, 480)


def test_non_finite_points_are_skipped_break_the_line_and_are_said(tmp_path: Path) -> None:
    gappy = [(0.0, 0.0), (1.0, 1.0), (2.0, math.nan), (3.0, 3.0), (4.0, 4.0), (5.0, math.inf)]
    gappy += [(math.inf, 1.0), (6.0, 1e301), (7.0, -math.nan), (8.0, 8.0)]
    drawn = draw(tmp_path, {"loss": gappy, "eval": [(0.0, 8.0), (8.0, 0.0)]})
    assert drawn.legend_texts() == ["loss (4 non-finite, 1 beyond 1e300 skipped)", "eval"]
    blue = drawn.mask(BLUE) & drawn.plot_area_mask()
    # The finite neighbours of the NaN are drawn; the segment across it is not.
    assert drawn.near(*drawn.at(0.5, 0.5), BLUE)
    assert drawn.near(*drawn.at(3.5, 3.5), BLUE)
    for x in (1.6, 2.0, 2.4):
        column, row = drawn.at(x, x)
        assert not blue[row - 10 : row + 11, column - 1 : column + 2].any(), x
    # The last point has no finite neighbour: drawn as a square, the only blue right of x = 4.
    assert drawn.near(*drawn.at(8.0, 8.0), BLUE)
    right_of_four = blue[:, drawn.at(4.2, 0)[0] :]
    assert right_of_four.any()
    rows = np.nonzero(right_of_four)[0]
    assert rows.max() - rows.min() <= 6  # one 4-point square, about 6 px


def test_all_skipped_empty_and_no_series(tmp_path: Path) -> None:
    drawn = draw(tmp_path, {"nan": [(0.0, math.nan), (1.0, -math.inf)], "empty": []})
    assert drawn.legend_texts() == ["nan (2 non-finite skipped)", "empty"]
    assert not (drawn.mask(BLUE) & drawn.plot_area_mask()).any()
    path = tmp_path / "nothing.png"
    assert write_curves(path, {}, title="", x_label="", y_label="")
    with Image.open(path) as image:
        assert image.size == (800, 480)


@pytest.mark.parametrize(
    ("ys", "scale"),
    [
        ([10.0, 1.0, 0.1], "log"),  # two decades
        ([10.0, 0.5, 0.2], "linear"),  # 1.7 decades
        ([10.8, 5.0, 2.3], "linear"),
        ([100.0, 1.0, 0.0], "linear"),  # zero has no logarithm
        ([1e3, math.nan, 0.1, -math.inf], "log"),  # skipped points do not count
    ],
)
def test_log_scale_when_the_values_span_decades(ys: list[float], scale: str) -> None:
    figure = curves_figure(
        {"loss": [(float(i), y) for i, y in enumerate(ys)]}, title="", x_label="", y_label=""
    )
    assert figure.axes[0].get_yscale() == scale


def test_extreme_values_are_drawn(tmp_path: Path) -> None:
    cases: list[dict[str, Points]] = [
        {"huge": [(0.0, -1e300), (1.0, 1e300)]},
        {"huge_const": [(0.0, 1e300), (1.0, 1e300)]},
        {"tiny": [(0.0, 1e-300), (1e-300, 3e-300)]},
        {"big": [(0.0, 1.2e6), (1e9, 1.5e6)], "lr": [(0.0, 3e-4), (1e9, 1e-5)]},
        {"close": [(0.0, 1.0), (1.0, 1.0 + 1e-12)]},
        {"one": [(3.0, 5.0)]},
    ]
    for series in cases:
        assert write_curves(
            tmp_path / "x.png", series, title="", x_label="", y_label="", width=320, height=240
        )


def test_the_users_matplotlib_state_is_left_alone(tmp_path: Path) -> None:
    # In a fresh interpreter: pyplot (which picks and switches backends) is never imported,
    # and rcParams are unchanged, also under a user's own style.
    # dict.items: RcParams' own item access would resolve the backend by importing pyplot.
    script = textwrap.dedent(
        f"""
        import sys
        import matplotlib
        matplotlib.rcParams["lines.linewidth"] = 7.0
        before = dict(dict.items(matplotlib.rcParams))
        from hp_train.observe.plot import write_curves
        assert write_curves({str(tmp_path / "p.png")!r}, {{"a": [(0, 1), (1, 2)]}},
                            title="t", x_label="x", y_label="y")
        assert "matplotlib.pyplot" not in sys.modules, "pyplot was imported"
        assert dict(dict.items(matplotlib.rcParams)) == before, "rcParams changed"
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_without_matplotlib_nothing_is_written_and_it_is_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` -> ImportError
    monkeypatch.setattr(plot, "_missing_reported", False)
    assert plot_available() is False
    series = {"loss": [(0.0, 1.0), (1.0, 0.5)]}
    with caplog.at_level(logging.WARNING, logger="hp_train"):
        for _ in range(3):
            assert (
                write_curves(tmp_path / "loss.png", series, title="", x_label="", y_label="")
                is False
            )
    assert list(tmp_path.iterdir()) == []
    said = [r for r in caplog.records if r.name.startswith("hp_train")]
    assert [(r.name, r.levelno, r.getMessage()) for r in said] == [
        ("hp_train.observe.plot", logging.WARNING, MISSING_MATPLOTLIB)
    ]
    assert "pip install 'hp-train[plot]'" in MISSING_MATPLOTLIB
    with pytest.raises(ModuleNotFoundError, match=r"hp-train\[plot\]"):
        curves_figure(series, title="", x_label="", y_label="")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"width": 100}, "width"),
        ({"height": 50}, "height"),
        ({"width": 100_000}, "width"),
        ({"width": 640.0}, "width"),
        ({"height": True}, "height"),
    ],
)
def test_bad_size_is_rejected(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        write_curves(
            tmp_path / "x.png", {"a": [(0.0, 1.0)]}, title="", x_label="", y_label="", **kwargs
        )
    assert list(tmp_path.iterdir()) == []


def test_bad_points_name_the_series(tmp_path: Path) -> None:
    def bad(series: object) -> None:
        write_curves(tmp_path / "x.png", series, title="", x_label="", y_label="")  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"series\['loss'\]\[1\]"):
        bad({"loss": [(0.0, 1.0), (1.0,)]})
    with pytest.raises(ValueError, match=r"series\['loss'\]\[0\]"):
        bad({"loss": [("a", 1.0)]})
    with pytest.raises(TypeError, match="series names"):
        bad({3: [(0.0, 1.0)]})

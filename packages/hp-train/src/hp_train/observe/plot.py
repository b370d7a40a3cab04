"""Loss and eval curves as PNG files, drawn by matplotlib (the optional extra ``hp-train[plot]``).

:func:`write_curves` draws one line per series into a figure of its own and writes it with
matplotlib's Agg canvas. pyplot is never imported and nothing global is touched: the process's
backend stays whatever it was (or unresolved) and ``matplotlib.rcParams`` are not changed (a
user's style still applies, as to any figure they draw). Colours come from :data:`PALETTE`,
not from the user's colour cycle, so a series keeps its colour from plot to plot.

Without matplotlib a run still trains: :func:`write_curves` returns False and says once per
process, through the ``hp_train`` loggers, that no plot is written.

Conventions:

* a point whose x or y is not finite (NaN, +-inf) is skipped; the line breaks there, and the
  legend says how many points of the series were skipped (``"loss (2 non-finite skipped)"``);
  so is a point beyond :data:`MAX_MAGNITUDE` in size (matplotlib's axis margins and ticks
  overflow near the float limit), said as ``"(1 beyond 1e300 skipped)"``;
* a finite point with no finite neighbour is drawn as a small square (a line needs two);
* the y axis is logarithmic when every finite y is positive and the largest is at least
  ``10 ** LOG_SCALE_DECADES`` times the smallest (a loss falling from 10 to 0.05, say); else
  linear, since a loss from 10.8 to 2.3 reads better on a linear axis.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DPI",
    "LOG_SCALE_DECADES",
    "MAX_MAGNITUDE",
    "MISSING_MATPLOTLIB",
    "PALETTE",
    "curves_figure",
    "plot_available",
    "write_curves",
]

_log = logging.getLogger(__name__)

#: Series colours in mapping order (matplotlib's "tab10"), cycled past ten series.
PALETTE: tuple[str, ...] = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)

#: Pixels per inch of the written PNG: ``width`` and ``height`` are pixels at this density.
DPI = 100

#: The y axis turns logarithmic when the positive finite values span this many decades.
LOG_SCALE_DECADES = 2

#: What a process without matplotlib logs (once) instead of writing a plot.
MISSING_MATPLOTLIB = "matplotlib is not installed (pip install 'hp-train[plot]'): no plot written"

#: The largest ``|x|`` or ``|y|`` drawn; larger points are skipped like non-finite ones (the
#: legend's "beyond 1e300" names this value).
MAX_MAGNITUDE = 1e300

_MIN_WIDTH = 320
_MIN_HEIGHT = 240
_MAX_SIDE = 16384

_missing_reported = False  # the once-per-process flag of MISSING_MATPLOTLIB

Points = Sequence[tuple[float, float]]


def plot_available() -> bool:
    """True when matplotlib and its Agg canvas import (the ``hp-train[plot]`` extra)."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends import backend_agg  # noqa: F401
    except ImportError:
        return False
    return True


def write_curves(
    path: str | Path,
    series: Mapping[str, Points],
    *,
    title: str,
    x_label: str,
    y_label: str,
    width: int = 800,
    height: int = 480,
) -> bool:
    """Write ``series`` (name -> ``(x, y)`` points) as a line plot to the PNG file ``path``.

    Returns True when the file was written: an 8-bit PNG of exactly ``width`` x ``height``
    pixels with one line per series in :data:`PALETTE` order and a legend inside the axes,
    where it hides the fewest points (see the module docstring for non-finite points and the
    log scale). The file is written to ``<path>.tmp`` and renamed, so a reader never sees half
    a plot. Returns False, writing nothing, when matplotlib is missing; the first such call of
    the process logs :data:`MISSING_MATPLOTLIB` as a warning of the ``hp_train.observe.plot``
    logger.

    Raises:
        ValueError: ``width``/``height`` not an int in [320, 16384] / [240, 16384], or a
            point that is not a pair of numbers (the message names the series and index).
        TypeError: a series name that is not a string.
    """
    global _missing_reported
    _check_size(width, height)
    cleaned = _clean_series(series)
    if not plot_available():
        if not _missing_reported:
            _missing_reported = True
            _log.warning(MISSING_MATPLOTLIB)
        return False
    figure = _draw(cleaned, title=title, x_label=x_label, y_label=y_label, size=(width, height))
    target = Path(path)
    partial = target.with_name(target.name + ".tmp")
    try:
        figure.savefig(partial, format="png", dpi=DPI)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return True


def curves_figure(
    series: Mapping[str, Points],
    *,
    title: str,
    x_label: str,
    y_label: str,
    width: int = 800,
    height: int = 480,
) -> Figure:
    """The figure :func:`write_curves` writes, for callers that show or restyle it.

    The figure has one axes and an Agg canvas, and belongs to no pyplot figure manager (it is
    freed with its last reference). Raises what :func:`write_curves` raises, and
    ``ModuleNotFoundError`` naming the ``hp-train[plot]`` extra when matplotlib is missing.
    """
    _check_size(width, height)
    cleaned = _clean_series(series)
    if not plot_available():
        raise ModuleNotFoundError(MISSING_MATPLOTLIB)
    return _draw(cleaned, title=title, x_label=x_label, y_label=y_label, size=(width, height))


def _check_size(width: int, height: int) -> None:
    for arg, value, minimum in (("width", width, _MIN_WIDTH), ("height", height, _MIN_HEIGHT)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{arg} must be an int number of pixels, got {value!r}")
        if not minimum <= value <= _MAX_SIDE:
            raise ValueError(f"{arg} must be in [{minimum}, {_MAX_SIDE}] pixels, got {value}")


def _clean_series(series: Mapping[str, Points]) -> list[tuple[str, list[tuple[float, float]]]]:
    """The points as float pairs, checked; non-finite points are kept (drawing skips them)."""
    cleaned: list[tuple[str, list[tuple[float, float]]]] = []
    for name, points in series.items():
        if not isinstance(name, str):
            raise TypeError(f"series names must be str, got {name!r}")
        out: list[tuple[float, float]] = []
        for i, point in enumerate(points):
            try:
                x_raw, y_raw = point
                out.append((float(x_raw), float(y_raw)))
            except (TypeError, ValueError) as exc:
                raise ValueError(
                    f"series[{name!r}][{i}] must be an (x, y) pair of numbers, got {point!r}"
                ) from exc
        cleaned.append((name, out))
    return cleaned


def _skip_reason(point: tuple[float, float]) -> str | None:
    """Why ``point`` is not drawn (``"non-finite"``, ``"beyond 1e300"``), or None (drawn)."""
    if not (math.isfinite(point[0]) and math.isfinite(point[1])):
        return "non-finite"
    if max(abs(point[0]), abs(point[1])) > MAX_MAGNITUDE:
        return "beyond 1e300"
    return None


def _legend_label(name: str, reasons: Sequence[str | None]) -> str:
    """``name``, followed by how many of its points were skipped and why."""
    counts = {r: reasons.count(r) for r in dict.fromkeys(reasons) if r is not None}
    if not counts:
        return name
    said = ", ".join(f"{n} {reason}" for reason, n in counts.items())
    return f"{name} ({said} skipped)"


def _wants_log_scale(values: Sequence[float]) -> bool:
    if not values or min(values) <= 0:
        return False
    return max(values) >= min(values) * 10.0**LOG_SCALE_DECADES


def _draw(
    series: list[tuple[str, list[tuple[float, float]]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    size: tuple[int, int],
) -> Figure:
    # Figure + FigureCanvasAgg rather than pyplot: no global figure manager, no backend switch.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    drawn_y: list[float] = []
    for index, (name, points) in enumerate(series):
        color = PALETTE[index % len(PALETTE)]
        reasons = [_skip_reason(p) for p in points]
        good = [r is None for r in reasons]
        # NaN at a skipped point makes matplotlib break the line there.
        xs = [p[0] if ok else math.nan for p, ok in zip(points, good, strict=True)]
        ys = [p[1] if ok else math.nan for p, ok in zip(points, good, strict=True)]
        axes.plot(xs, ys, color=color, linewidth=1.5, label=_legend_label(name, reasons))
        lonely = [
            p
            for i, (p, ok) in enumerate(zip(points, good, strict=True))
            if ok and not (i > 0 and good[i - 1]) and not (i + 1 < len(good) and good[i + 1])
        ]
        if lonely:
            axes.plot(
                [p[0] for p in lonely],
                [p[1] for p in lonely],
                linestyle="none",
                marker="s",
                markersize=4,
                color=color,
                label="_lonely",  # a leading underscore keeps it out of the legend
            )
        drawn_y.extend(y for (_, y), ok in zip(points, good, strict=True) if ok)
    if _wants_log_scale(drawn_y):
        axes.set_yscale("log")
    axes.grid(True, alpha=0.3)
    axes.set_title(title)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    if series:
        # Inside the axes where it covers the fewest points: it fits any image size.
        axes.legend(loc="best")
    return figure

"""A one-line text progress bar for a terminal or a log file.

On a TTY the line is redrawn in place (``\\r``); on anything else (a log file, a pipe) a full
line is written for the first update, every ``every``-th update after it and the last step,
so logs stay readable. Only rank 0 should draw: pass ``enabled=(rank == 0)``; a disabled bar
writes nothing at all.

Example line::

    [#####...............] 5/20 loss 3.21 tok/s 1.2e4

Field names are printed as given, so names that are not identifiers can be passed with
``**{"tok/s": rate}``.
"""

from __future__ import annotations

import math
import sys
from types import TracebackType
from typing import SupportsFloat, TextIO

__all__ = ["ProgressBar", "format_value"]


def format_value(value: object) -> str:
    """Format one field value compactly.

    Integers print in full; floats (and objects convertible with ``float()``, such as
    one-element tensors) use three significant digits, switching to ``1.2e4``-style notation
    below 0.001 or from 10000 on; everything else uses ``str()``.
    """
    if isinstance(value, bool | str):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, SupportsFloat):
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            return str(value)
        return _format_float(number)
    return str(value)


def _format_float(number: float) -> str:
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    magnitude = abs(number)
    if magnitude == 0:
        return "0"
    if magnitude >= 1e4 or magnitude < 1e-3:
        mantissa, _, exponent = f"{number:.1e}".partition("e")
        return f"{mantissa}e{int(exponent)}"
    if magnitude >= 100:
        return f"{number:.0f}"
    return f"{number:.3g}"


class ProgressBar:
    """A text progress bar: ``update(step, total, **fields)`` then ``close()``.

    Args:
        enabled: draw at all; pass ``rank == 0`` so only one process writes.
        stream: where to write (default: ``sys.stderr`` at construction time).
        width: number of cells in the ``[###...]`` bar.
        every: on a non-TTY stream, write a line every ``every`` updates (plus the first
            update and the one where ``step == total``).
        tty: force TTY (in-place) or log (line) mode instead of asking ``stream.isatty()``.

    Also a context manager (``close()`` on exit).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        stream: TextIO | None = None,
        width: int = 20,
        every: int = 10,
        tty: bool | None = None,
    ) -> None:
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be a positive int, got {width!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        self.enabled = bool(enabled)
        self._stream: TextIO = stream if stream is not None else sys.stderr
        self.width = width
        self.every = every
        if tty is None:
            isatty = getattr(self._stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.is_tty = tty
        self._updates = 0
        self._last_line = ""  # the latest rendered line
        self._pending = False  # a non-TTY line rendered but not yet written
        self._drawn_width = 0  # TTY: length of the line now on screen
        self._closed = False

    def render(self, step: int, total: int, **fields: object) -> str:
        """The bar line for ``step`` of ``total`` (no ``\\r``/newline), without writing it."""
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total must be a positive int, got {total!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        filled = min(step, total) * self.width // total
        parts = [f"[{'#' * filled}{'.' * (self.width - filled)}] {step}/{total}"]
        parts.extend(f"{name} {format_value(value)}" for name, value in fields.items())
        return " ".join(parts)

    def update(self, step: int, total: int, **fields: object) -> None:
        """Show progress ``step`` of ``total`` with extra ``name value`` fields.

        Raises:
            ValueError: ``step`` negative or ``total`` not positive (even when disabled, so a
                bad call is caught on every rank), or the bar was closed.
        """
        line = self.render(step, total, **fields)
        if self._closed:
            raise ValueError("update() on a closed ProgressBar")
        if not self.enabled:
            return
        index = self._updates
        self._updates += 1
        self._last_line = line
        if self.is_tty:
            pad = " " * max(self._drawn_width - len(line), 0)
            self._stream.write(f"\r{line}{pad}")
            self._drawn_width = len(line)
            self._stream.flush()
        elif index % self.every == 0 or step >= total:
            self._stream.write(line + "\n")
            self._stream.flush()
            self._pending = False
        else:
            self._pending = True

    def close(self) -> None:
        """Finish: end the TTY line, or write the latest state if the log has not shown it.

        Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if not self.enabled:
            return
        if self.is_tty and self._drawn_width:
            self._stream.write("\n")
            self._stream.flush()
        elif self._pending:
            self._stream.write(self._last_line + "\n")
            self._stream.flush()
            self._pending = False

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

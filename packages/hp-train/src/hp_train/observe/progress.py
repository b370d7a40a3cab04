"""The training progress bar, drawn by tqdm; readable lines when the output is a log file.

On a TTY, tqdm redraws one line in place (at most every ``min_interval_s``), with the rate
and time left, and the fields after them::

     25%|██▌       | 5/20 [00:01<00:03,  4.00step/s, loss=3.21, tok/s=1.2e4]

Redraws in a log file or a pipe would pile up as one unreadable line of ``\\r``-separated
states, so there each shown state is a line of its own, in tqdm's format: the first update,
every ``every``-th update after it and the last step; :meth:`ProgressBar.close` adds the
latest state if it was not shown. Field values are formatted by :func:`format_value` (so
``loss=3.21``, not tqdm's ``loss=3.2109``); names are printed as given, so names that are not
identifiers can be passed with ``**{"tok/s": rate}``.

Only rank 0 should draw: pass ``enabled=(rank == 0)``; a disabled bar writes nothing at all.
The rate counts from the first update, so a resumed run shows its own speed.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, SupportsFloat, TextIO

# tqdm ships no type hints (types-tqdm is not a dependency): its objects are Any here.
from tqdm import tqdm  # type: ignore[import-untyped]

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


def _postfix(fields: dict[str, object]) -> str:
    """``name=value, ...`` as tqdm's ``set_postfix`` joins them, values by format_value."""
    return ", ".join(f"{name}={format_value(value)}" for name, value in fields.items())


def _check_position(step: int, total: int) -> None:
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"total must be a positive int, got {total!r}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")


class ProgressBar:
    """A progress bar: ``update(step, total, **fields)`` then ``close()``.

    Args:
        enabled: draw at all; pass ``rank == 0`` so only one process writes.
        stream: where to write (default: ``sys.stderr`` at construction time).
        every: on a non-TTY stream, write a line every ``every`` updates (plus the first
            update and the one where ``step >= total``).
        tty: force TTY (tqdm redraws) or log (one line per shown state) mode instead of asking
            ``stream.isatty()``.
        min_interval_s: on a TTY, the least time between two redraws (tqdm's ``mininterval``).
        clock: seconds for the log lines' elapsed time, rate and time left.

    Also a context manager (``close()`` on exit).
    """

    def __init__(
        self,
        enabled: bool,
        *,
        stream: TextIO | None = None,
        every: int = 10,
        tty: bool | None = None,
        min_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        if not (isinstance(min_interval_s, int | float) and min_interval_s >= 0):
            raise ValueError(f"min_interval_s must be a number >= 0, got {min_interval_s!r}")
        self.enabled = bool(enabled)
        self._stream: TextIO = stream if stream is not None else sys.stderr
        self.every = every
        if tty is None:
            isatty = getattr(self._stream, "isatty", None)
            tty = bool(isatty()) if callable(isatty) else False
        self.is_tty = tty
        self._min_interval_s = float(min_interval_s)
        self._clock = clock
        self._bar: Any = None  # TTY mode: the tqdm bar, from the first update on
        self._first: tuple[int, float] | None = None  # log mode: (step, time) of update 1
        self._updates = 0
        self._pending: str | None = None  # log mode: the latest line, not yet written
        self._closed = False

    def update(self, step: int, total: int, **fields: object) -> None:
        """Show progress ``step`` of ``total`` with extra ``name=value`` fields.

        Raises:
            ValueError: ``step`` negative or ``total`` not positive (even when disabled, so a
                bad call is caught on every rank), or the bar was closed.
        """
        _check_position(step, total)
        if self._closed:
            raise ValueError("update() on a closed ProgressBar")
        if not self.enabled:
            return
        postfix = _postfix(fields)
        if self.is_tty:
            self._redraw(step, total, postfix)
        else:
            self._log_line(step, total, postfix)
        self._updates += 1

    def _redraw(self, step: int, total: int, postfix: str) -> None:
        if self._bar is None:
            # initial=step: the rate counts from here, not from step 0 (a resumed run).
            self._bar = tqdm(
                total=total,
                initial=step,
                file=self._stream,
                unit="step",
                mininterval=self._min_interval_s,
                dynamic_ncols=True,
                leave=True,
                postfix=postfix or None,
                disable=False,
            )
            return
        bar = self._bar
        if bar.total != total:
            bar.total = total
        bar.set_postfix_str(postfix, refresh=False)
        bar.update(step - bar.n)

    def _log_line(self, step: int, total: int, postfix: str) -> None:
        now = self._clock()
        if self._first is None:
            self._first = (step, now)
        first_step, began = self._first
        line: str = tqdm.format_meter(
            n=step,
            total=total,
            elapsed=max(now - began, 0.0),
            ascii=True,  # a log file gets no block characters
            unit="step",
            postfix=postfix or None,
            initial=first_step,
        )
        if self._updates % self.every == 0 or step >= total:
            self._write(line)
            self._pending = None
        else:
            self._pending = line

    def _write(self, line: str) -> None:
        self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        """Finish: tqdm's final state and newline on a TTY, or the log's unshown latest line.

        Calling it again does nothing.
        """
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._pending is not None:
            self._write(self._pending)
            self._pending = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

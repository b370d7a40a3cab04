"""Stopping on SIGTERM or SIGINT with a checkpoint: the dying gasp.

A scheduler pre-empting a job sends SIGTERM (torchrun forwards it to every worker and kills
them 30 s later); Ctrl-C sends SIGINT to the launcher and its workers. :class:`StopSignals`
turns the first such signal into a request that the training loop reads between steps: the
ranks agree on it inside the step's loss all-reduce (a rank that saw a signal adds 1), so
every rank finishes the same step, writes the same checkpoint and exits with
``128 + signal`` (143 for SIGTERM, 130 for SIGINT), the shell's code for a process stopped by
that signal. A second signal ends the process at once, by that signal's default action: one
that arrives within :data:`SAME_SIGNAL_S` of the first is the same request delivered twice
(a launcher and a terminal both passing Ctrl-C on), not a second one.

A rank that cannot reach the agreement (stuck in a collective a peer never joins, or the peer
is gone) would hold the signal until torchrun's SIGKILL 30 s later. So the first signal also
starts a grace period (``grace()`` seconds, the trainer's: a few step times, at least
:data:`MIN_GRACE_S`); a rank whose loop has not acknowledged the agreement by then says so on
stderr and kills itself (SIGKILL): no checkpoint, as before this feature. Outside the training
loop (build, resume, the end) the handlers are not installed and a signal acts as usual.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType

from hp_train.observe.errors import write_lines

__all__ = ["MIN_GRACE_S", "SAME_SIGNAL_S", "STOP_SIGNALS", "StopSignals", "StoppedBySignalError"]

#: The signals that ask for a checkpoint before stopping.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: A signal within this many seconds of the first is the same request delivered twice.
SAME_SIGNAL_S = 1.0
#: The shortest time a rank has, after a signal, to reach the step where the ranks agree.
MIN_GRACE_S = 3.0


class StoppedBySignalError(Exception):
    """Training stopped on a signal after writing a checkpoint (raised on every rank alike).

    Attributes:
        signum: the signal (SIGTERM when any rank got one, else SIGINT).
        steps_done: the steps the checkpoint holds.
        checkpoint: the checkpoint written.
    """

    def __init__(self, signum: int, steps_done: int, checkpoint: str) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} after step {steps_done}; wrote checkpoint {checkpoint} "
            "(continue with --resume)"
        )
        self.signum = signum
        self.steps_done = steps_done
        self.checkpoint = checkpoint

    @property
    def exit_code(self) -> int:
        """``128 + signal``: 143 for SIGTERM, 130 for SIGINT."""
        return 128 + self.signum


class StopSignals:
    """A context manager that, while entered, records the first SIGTERM or SIGINT instead of
    dying, and dies on a later one, or when :meth:`acknowledge` does not come within
    ``grace()`` seconds of the first (module docstring). Enter it in the main thread only
    (Python delivers signals there)."""

    def __init__(self, grace: Callable[[], float] = lambda: MIN_GRACE_S) -> None:
        self.signum: int | None = None
        self._grace = grace
        self._at = 0.0
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def acknowledge(self) -> None:
        """The ranks agreed to stop: no grace period limit from here (torchrun's applies)."""
        if self._timer is not None:
            self._timer.cancel()

    def _give_up(self, seconds: float) -> None:
        name = signal.Signals(self.signum or signal.SIGTERM).name
        write_lines(
            [
                f"hp-train: got {name} but did not reach the step where the ranks agree to stop "
                f"within {seconds:.1f} s (a collective that does not complete?); stopping now, "
                "without a checkpoint"
            ]
        )
        os.kill(os.getpid(), signal.SIGKILL)

    @property
    def requested(self) -> bool:
        """Whether a stop was asked for."""
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._at = signum, now
            seconds = max(MIN_GRACE_S, self._grace())
            self._timer = threading.Timer(seconds, self._give_up, args=(seconds,))
            self._timer.daemon = True
            self._timer.start()
            return
        if now - self._at < SAME_SIGNAL_S:
            return
        # A second request: stop now, as the signal would have without this handler.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def __enter__(self) -> StopSignals:
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()
        self.acknowledge()

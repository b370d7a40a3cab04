"""``--profile``: ``torch.profiler`` around chosen training steps.

:func:`parse_step_ranges` reads the flag's value (1-based step numbers: ``"5"``, ``"5,7"``,
``"5-7"``, or a mix such as ``"2,5-7"``). A :class:`StepProfiler` profiles those steps on its
rank: the trainer calls :meth:`StepProfiler.step_begin` before a step and
:meth:`StepProfiler.step_end` after it. Each profiled step gets its own Chrome / Perfetto trace,
``<out_dir>/profile/rank_<r>_step_<n>.json`` (open it in https://ui.perfetto.dev or
``chrome://tracing``), and ``step_end`` returns a table of the step's most expensive operators
for the log.

The host (CPU) activity is always recorded; the device's activity too when the device is an
accelerator the profiler knows (CUDA, XPU, HPU, MTIA by their ``ProfilerActivity`` names, and
a PrivateUse1 backend such as ``npu`` under the name it registered). Every profiled step is one
profiler session of its own, started at ``step_begin`` and stopped at ``step_end``, so a trace
holds that step's events and nothing of its neighbours; the first session pays the profiler's
start-up, which the trace shows before the step's own events.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, supported_activities

from hp_train.config.schema import ConfigError

__all__ = [
    "StepListError",
    "StepProfiler",
    "parse_step_ranges",
    "profiler_activities",
    "step_list_option",
    "trace_path",
]

_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_step_ranges(text: str) -> tuple[int, ...]:
    """The 1-based step numbers ``text`` names, ascending and each once.

    ``text`` is a comma-separated list of steps (``"5"``) and inclusive ranges (``"5-7"``),
    e.g. ``"2,5-7"`` -> ``(2, 5, 6, 7)``.

    Raises:
        ValueError: ``text`` empty, an item that is not a positive step or ``first-last`` range,
            a step 0, or a range whose last step is before its first (the message names the
            item and shows the accepted forms).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"a list of steps must name at least one step, got {text!r}; "
            "write e.g. '5', '5,7' or '5-7' (1-based step numbers)"
        )
    steps: set[int] = set()
    for item in text.split(","):
        match = _ITEM.match(item)
        if match is None:
            raise ValueError(
                f"{item.strip()!r} in {text!r} is not a step or a range of steps; "
                "write e.g. '5', '5,7' or '5-7' (1-based step numbers)"
            )
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if first < 1:
            raise ValueError(f"steps are counted from 1, got {item.strip()!r} in {text!r}")
        if last < first:
            raise ValueError(
                f"the range {item.strip()!r} in {text!r} ends before it starts; write it "
                f"as '{last}-{first}'"
            )
        steps.update(range(first, last + 1))
    return tuple(sorted(steps))


class StepListError(ConfigError, argparse.ArgumentTypeError):
    """A list of steps that does not parse: argparse shows its message for a flag, and a
    ``--config`` file's value raises it as the :class:`ConfigError` it also is."""


def step_list_option(text: str) -> str:
    """The argparse ``type`` of a flag taking a list of steps: ``text`` stripped, once
    :func:`parse_step_ranges` accepts it (kept as text, so ``config.toml`` can hold it).

    Raises:
        StepListError: what :func:`parse_step_ranges` raises, as its message says.
    """
    try:
        parse_step_ranges(text)
    except ValueError as exc:
        raise StepListError(str(exc)) from None
    return text.strip()


def profiler_activities(device: torch.device) -> tuple[ProfilerActivity, ...]:
    """What the profiler records on ``device``: CPU, plus the device's own activity when it is
    an accelerator.

    Raises:
        ValueError: an accelerator type the profiler has no activity for, or whose activity
            this build of torch cannot record (``torch.profiler.supported_activities()``).
    """
    if device.type == "cpu":
        return (ProfilerActivity.CPU,)
    activity = ProfilerActivity.__members__.get(device.type.upper())
    if activity is None and device.type == torch._C._get_privateuse1_backend_name():
        activity = ProfilerActivity.PrivateUse1
    if activity is None or activity not in supported_activities():
        supported = sorted(a.name for a in supported_activities())
        raise ValueError(
            f"torch.profiler cannot record device {device.type!r} here (it records "
            f"{', '.join(supported)}); profile on 'cpu' or on a device whose profiler torch "
            "was built with"
        )
    return (ProfilerActivity.CPU, activity)


def trace_path(out_dir: Path, rank: int, step: int) -> Path:
    """Where the trace of ``step`` (1-based) on ``rank`` is written."""
    return Path(out_dir) / "profile" / f"rank_{rank}_step_{step}.json"


class StepProfiler:
    """Profiles the steps ``steps`` (1-based) of one rank.

    Call ``step_begin(n)`` before step ``n`` and ``step_end(n)`` after it for every step (the
    unprofiled ones cost a set lookup), then :meth:`close`.

    Raises (constructor):
        ValueError: ``rank`` negative, ``steps`` empty or holding a non-positive or non-int
            step, ``row_limit`` below 1, or a device the profiler cannot record
            (:func:`profiler_activities`).
    """

    def __init__(
        self,
        out_dir: Path,
        rank: int,
        steps: Sequence[int],
        device: torch.device,
        row_limit: int = 15,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 1]
        if not steps or bad:
            raise ValueError(f"steps to profile must be 1-based step numbers, got {list(steps)!r}")
        if isinstance(row_limit, bool) or not isinstance(row_limit, int) or row_limit < 1:
            raise ValueError(f"row_limit must be a positive int, got {row_limit!r}")
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.steps = frozenset(steps)
        self.device = torch.device(device)
        self.row_limit = row_limit
        self._activities = profiler_activities(self.device)
        self._session: profile | None = None
        self._marker: record_function | None = None
        self._step: int | None = None
        self._closed = False

    def step_begin(self, step: int) -> None:
        """Start profiling when ``step`` is one of :attr:`steps`; else do nothing.

        Raises:
            RuntimeError: a profiled step is still open (its ``step_end`` was not called), or
                the profiler was closed (:meth:`close`).
        """
        if self._step is not None:
            raise RuntimeError(
                f"step_begin({step}) while step {self._step} is being profiled; call "
                f"step_end({self._step}) first"
            )
        if self._closed:
            raise RuntimeError(f"step_begin({step}) after the step profiler was closed")
        if step not in self.steps:
            return
        session = profile(activities=list(self._activities), record_shapes=True)
        session.start()
        self._session, self._step = session, step
        self._marker = record_function(f"hp_train.step_{step}")
        self._marker.__enter__()

    def step_end(self, step: int) -> str | None:
        """Stop profiling ``step`` and write its trace; None when ``step`` was not profiled.

        Postconditions for a profiled step: :func:`trace_path` of it holds the step's Chrome
        trace (JSON), and the returned text names that file and tabulates the step's
        ``row_limit`` operators of most self time (on the device when it has an activity of
        its own, else on the host).

        Raises:
            RuntimeError: ``step`` is not the step being profiled while one is.
        """
        if self._step is None:
            if step in self.steps and not self._closed:
                raise RuntimeError(f"step_end({step}) without step_begin({step})")
            return None
        if step != self._step:
            raise RuntimeError(f"step_end({step}) while step {self._step} is being profiled")
        session = self._stop()
        path = trace_path(self.out_dir, self.rank, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        session.export_chrome_trace(str(path))
        sort_by = "self_device_time_total" if len(self._activities) > 1 else "self_cpu_time_total"
        table = session.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        return f"profile of step {step} on rank {self.rank} (trace {path}):\n{table}"

    def _stop(self) -> profile:
        session, marker = self._session, self._marker
        assert session is not None
        assert marker is not None
        self._session = self._marker = self._step = None
        marker.__exit__(None, None, None)
        if self.device.type != "cpu":
            # The device runs behind the host: wait so the step's kernels are in the trace.
            torch.accelerator.synchronize(self.device)
        session.stop()
        return session

    def close(self) -> None:
        """Stop a session left open (a step that raised: its trace is not written) and
        profile no further step; calling it again does nothing."""
        if self._session is not None:
            self._stop()
        self._closed = True

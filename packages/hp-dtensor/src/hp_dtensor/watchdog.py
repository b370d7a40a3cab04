"""Collective timeouts that say what hung: the collective, its group, the ranks that never came.

A collective that a rank never joins leaves the others waiting. The backend ends the wait at the
process group's timeout (gloo raises ``Timed out waiting ...ms for recv``), but its error names
neither the collective, nor the group, nor the absent rank. With the watchdog on
(:func:`configure`, or ``init_device_mesh(..., timeout_s=...)``), every collective hp_dtensor
issues runs inside :func:`watch`, and one that fails at the timeout raises
:class:`CollectiveTimeoutError` naming all three.

How the absent ranks are found. Each rank counts, per group, the watched collectives it has
entered, in memory (a few hundred nanoseconds per collective: no message, no store write). A
daemon thread publishes these counts, and the collective the rank is inside right now, to the
job's c10d store every ``min(1 s, timeout / 5)`` when they have changed (and every third period
regardless, as a heartbeat): at most one small store write per rank and period, whatever the
collective rate. When a collective fails after the timeout,
the waiting rank reads its group members' reports: a member whose count for the group is below
the waiting rank's is one that did not arrive, and its report says where it is instead. The
reports are at most one period old, and the waiting rank has waited a whole timeout (five
periods at least), so a rank that arrived in time is not reported missing.

Groups hp_dtensor creates get the timeout (:func:`group_timeout`); torch gives a new group 30
minutes by default, whatever the default group's timeout, so without it a collective over a
mesh axis waits half an hour. Blocking backends only: gloo's collectives return or raise in the
calling thread; NCCL's return at once and its own watchdog aborts the job at the group's
timeout, which this module passes on but cannot put a name to.
"""

from __future__ import annotations

import atexit
import json
import re
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist

__all__ = [
    "CollectiveTimeoutError",
    "configure",
    "enabled",
    "group_timeout",
    "name_group",
    "set_entry_hook",
    "stop",
    "timeout_s",
    "watch",
    "watch_async",
]

EntryHook = Callable[[str, str, int], None]
"""``hook(collective, group, number)``: called before this rank enters its ``number``-th
watched collective (1-based, all groups together; :func:`watch` only, not
:func:`watch_async`); for fault injection in tests."""

# Where each rank's report lives in the job's default store.
_REPORT_KEY = "hp_dtensor/watchdog/{rank}"
# A backend error that means the wait ended: a timeout, or a peer that left the collective.
_TIMED_OUT = re.compile(r"timed? ?out", re.IGNORECASE)
_PEER_GONE = ("connection closed", "connection reset", "broken pipe")
# A rank whose report did not change publishes it again after this many periods.
_HEARTBEAT = 3


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the timeout.

    Attributes:
        collective: what was issued (``"all_reduce"``, ``"all_gather"``, ...).
        group: the group, as in the message (``"'tp' (ranks [0, 1])"``).
        ranks: the group's global ranks.
        missing: the ranks of the group that did not enter the collective (empty when every
            rank did: then they entered different collectives, or one failed inside it).
        timeout_s: the configured timeout.
        elapsed_s: how long this rank waited.
    """

    def __init__(
        self,
        message: str,
        *,
        collective: str,
        group: str,
        ranks: Sequence[int],
        missing: Sequence[int],
        timeout_s: float,
        elapsed_s: float,
    ) -> None:
        super().__init__(message)
        self.collective = collective
        self.group = group
        self.ranks = tuple(ranks)
        self.missing = tuple(missing)
        self.timeout_s = timeout_s
        self.elapsed_s = elapsed_s

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only attributes: rebuild through a helper so the error pickles (rank pools
        # and multiprocessing send exceptions between processes).
        return (
            _rebuild,
            (
                str(self),
                self.collective,
                self.group,
                self.ranks,
                self.missing,
                self.timeout_s,
                self.elapsed_s,
            ),
        )


def _rebuild(
    message: str,
    collective: str,
    group: str,
    ranks: tuple[int, ...],
    missing: tuple[int, ...],
    timeout_s: float,
    elapsed_s: float,
) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(
        message,
        collective=collective,
        group=group,
        ranks=ranks,
        missing=missing,
        timeout_s=timeout_s,
        elapsed_s=elapsed_s,
    )


@dataclass(eq=False)
class _Group:
    """One process group this rank is in: its identity across ranks and its count."""

    ranks: tuple[int, ...]
    key: str
    is_world: bool
    count: int = 0
    last: str = ""

    def label(self) -> str:
        names = _NAMES.get(self.ranks, [])
        axes = "/".join(names)
        if self.is_world:
            name = f"'world' (axis '{axes}')" if axes else "'world'"
        else:
            name = f"'{axes}'" if axes else "unnamed"
        return f"{name} (ranks {list(self.ranks)})"


@dataclass
class _State:
    timeout_s: float | None = None
    hook: EntryHook | None = None
    world: Any = None
    rank: int = -1
    groups: dict[Any, _Group] = field(default_factory=dict)
    # (group, its count, collective) of the watched collective this rank is inside, if any.
    current: tuple[_Group, int, str] | None = None
    entered: int = 0
    version: int = 0
    publisher: _Publisher | None = None


_STATE = _State()
# Axis names of groups, by rank list (see name_group); kept across configure calls.
_NAMES: dict[tuple[int, ...], list[str]] = {}
_ATEXIT: list[bool] = []


def configure(timeout_s: float | None) -> None:
    """Turn the watchdog on with a timeout of ``timeout_s`` seconds, or off with None.

    The timeout is the one hp_dtensor gives the groups it creates from now on
    (:func:`group_timeout`) and the one the messages quote; groups that exist keep theirs. Call
    it on every rank at the same point, before the first collective
    (``init_device_mesh(timeout_s=...)`` does); a new timeout restarts the counts, the same one
    changes nothing.

    Raises:
        ValueError: ``timeout_s`` is not a positive number.
    """
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
            raise ValueError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    wanted = None if timeout_s is None else float(timeout_s)
    if wanted == _STATE.timeout_s:
        return  # again (a second mesh): the counts go on
    stop()
    _STATE.timeout_s = wanted
    _STATE.world = None  # counts restart with the next collective
    _STATE.groups.clear()
    _STATE.current = None
    _STATE.entered = 0


def enabled() -> bool:
    """Whether collectives are watched."""
    return _STATE.timeout_s is not None


def timeout_s() -> float | None:
    """The configured timeout in seconds (None: the watchdog is off)."""
    return _STATE.timeout_s


def set_entry_hook(hook: EntryHook | None) -> None:
    """Call ``hook`` before every watched collective (None: no hook); see :data:`EntryHook`.

    Only while the watchdog is on. For tests that make one rank miss a collective.
    """
    _STATE.hook = hook


def name_group(ranks: Sequence[int], name: str) -> None:
    """Call the group over ``ranks`` ``name`` (a mesh axis) in messages."""
    names = _NAMES.setdefault(tuple(ranks), [])
    if name not in names:
        names.append(name)


def group_timeout() -> timedelta | None:
    """The timeout for a new process group: the configured one, else the default group's
    (torch would give a new group its 30-minute default instead), else None."""
    if _STATE.timeout_s is not None:
        return timedelta(seconds=_STATE.timeout_s)
    if not dist.is_initialized() or dist.group.WORLD is None:
        return None
    return _backend_timeout(dist.group.WORLD)


def _backend_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout ``group``'s backend was built with, where the backend tells."""
    try:
        devices = list(group._device_types)
    except (AttributeError, RuntimeError):
        return None
    for device in devices:
        try:
            backend = group._get_backend(device)
        except (RuntimeError, ValueError):
            continue
        found = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(found, timedelta):
            return found
    return None


def stop() -> None:
    """Stop publishing this rank's report (before the process group goes away); the watchdog
    stays configured and restarts it with the next watched collective."""
    publisher, _STATE.publisher = _STATE.publisher, None
    if publisher is not None:
        publisher.stop()


class _Watch:
    """The context of one watched collective (see :func:`watch`)."""

    __slots__ = ("count", "group", "info", "name", "started")

    def __init__(self, name: str, group: dist.ProcessGroup | None) -> None:
        self.name = name
        self.group = group
        self.info: _Group | None = None
        self.count = 0
        self.started = 0.0

    def __enter__(self) -> _Watch:
        state = _STATE
        if state.timeout_s is None:
            return self
        info = _group_info(self.group)
        if state.hook is not None:
            state.hook(self.name, info.label(), state.entered + 1)
        state.entered += 1
        self.info, self.count = info, _count(info, self.name)
        state.current = (info, self.count, self.name)
        self.started = time.monotonic()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        info = self.info
        if info is None:
            return
        state = _STATE
        state.current = None
        state.version += 1
        if isinstance(exc, RuntimeError):
            _raise_diagnosed(self.name, info, self.count, self.started, exc)


class _Off:
    """The context of a collective while the watchdog is off: nothing to do."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


_OFF = _Off()


def watch(collective: str, group: dist.ProcessGroup | None = None) -> _Watch | _Off:
    """A context manager around issuing ``collective`` over ``group`` (None: the default
    group) on this rank; it must be entered on every rank of the group, in the same order.

    Off (see :func:`configure`) it costs an attribute test. On, entering counts the collective;
    a RuntimeError from the collective that means the wait ended (a timeout, or a peer that
    left) becomes a :class:`CollectiveTimeoutError` when a rank of the group did not enter the
    collective, or when it was a timeout. Other errors pass unchanged.
    """
    if _STATE.timeout_s is None:
        return _OFF
    return _Watch(collective, group)


class _WatchedWork:
    """An asynchronous collective counted when issued (see :func:`watch_async`); its
    :meth:`wait` turns a timeout into :class:`CollectiveTimeoutError` as :func:`watch` does."""

    __slots__ = ("count", "info", "name", "started", "work")

    def __init__(self, work: Any, name: str, info: _Group, count: int) -> None:
        self.work = work
        self.name = name
        self.info = info
        self.count = count
        self.started = time.monotonic()

    def wait(self) -> Any:
        try:
            return self.work.wait()
        except RuntimeError as exc:
            _raise_diagnosed(self.name, self.info, self.count, self.started, exc)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def watch_async(collective: str, group: dist.ProcessGroup | None, work: Any) -> Any:
    """Count ``work``, an asynchronous ``collective`` over ``group`` (None: the default group)
    this rank has just issued, as a watched collective; returns what to wait on instead:
    ``work`` itself while the watchdog is off (or when ``work`` is None), else a wrapper whose
    ``wait()`` raises :class:`CollectiveTimeoutError` as :func:`watch` does. Every rank of the
    group must issue it, in the same order as its other watched collectives."""
    if _STATE.timeout_s is None or work is None:
        return work
    info = _group_info(group)
    # Not numbered for the entry hook: the rank has issued it already.
    return _WatchedWork(work, collective, info, _count(info, collective))


def _group_info(group: dist.ProcessGroup | None) -> _Group:
    """This rank's record of ``group`` (None: the default group), registered on first use."""
    group = dist.group.WORLD if group is None else group
    info = _STATE.groups.get(group)
    return info if info is not None else _register(group)


def _count(info: _Group, collective: str) -> int:
    """Count one more ``collective`` over ``info``'s group; returns its number there."""
    info.count += 1
    info.last = collective
    _STATE.version += 1
    return info.count


def _raise_diagnosed(
    name: str, info: _Group, count: int, started: float, exc: RuntimeError
) -> None:
    """Raise :class:`CollectiveTimeoutError` for ``exc``, from this rank's ``count``-th
    collective over ``info`` (entered at ``started``), when it means a wait that ended;
    return (the caller lets ``exc`` through) otherwise."""
    if isinstance(exc, CollectiveTimeoutError):
        return
    error = _diagnose(name, info, count, time.monotonic() - started, exc)
    if error is not None:
        raise error from exc


def _register(group: Any) -> _Group:
    """Count collectives over ``group`` from now on (the first watched one over it)."""
    state = _STATE
    world = dist.group.WORLD
    if state.world is not world:
        # A new default group: the counts of the previous one mean nothing to its ranks.
        stop()
        state.groups.clear()
        state.current = None
        state.entered = 0
        state.world = world
        state.rank = dist.get_rank()
    ranks = tuple(dist.get_process_group_ranks(group))
    key = f"g{zlib.crc32(repr(ranks).encode()):08x}"
    info = _Group(ranks, key, is_world=group is world)
    state.groups[group] = info
    if state.publisher is None and dist.get_world_size() > 1 and state.timeout_s is not None:
        state.publisher = _Publisher(state.rank, _period(state.timeout_s))
        if not _ATEXIT:
            _ATEXIT.append(True)
            atexit.register(stop)
    return info


def _period(timeout: float) -> float:
    return min(1.0, max(0.05, timeout / 5))


def _report() -> dict[str, Any]:
    """This rank's counts per group and the collective it is inside."""
    state = _STATE
    groups = {g.key: [g.count, g.last] for g in list(state.groups.values())}
    current = state.current
    now = None
    if current is not None:
        info, count, name = current
        now = [info.key, info.label(), count, name]
    return {"t": time.time(), "groups": groups, "now": now}


class _Publisher:
    """Writes this rank's report to the default store whenever it changed, once a period."""

    def __init__(self, rank: int, period: float) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.key = _REPORT_KEY.format(rank=rank)
        self.period = period
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hp-dtensor-watchdog", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        published, quiet = -1, 0
        while True:
            version = _STATE.version
            # On a change, and every few periods anyway: the report's time tells the waiting
            # ranks whether this thread still runs.
            if version != published or quiet >= _HEARTBEAT:
                try:
                    self.store.set(self.key, json.dumps(_report()))
                except Exception:  # the store is gone (the job is ending): stop publishing
                    return
                published, quiet = version, 0
            else:
                quiet += 1
            if self.done.wait(self.period):
                return

    def stop(self) -> None:
        self.done.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5.0)


def _read_reports(ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The reports of ``ranks`` found in the store (a rank that never published has none)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return {}
    found: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        key = _REPORT_KEY.format(rank=rank)
        try:
            if store.check([key]):
                found[rank] = json.loads(store.get(key))
        except (RuntimeError, ValueError):
            continue
    return found


def _where(report: dict[str, Any], period: float) -> str:
    now = report.get("now")
    where = (
        f"now inside {now[3]} (its collective #{now[2]} over group {now[1]})"
        if now
        else "now outside any watched collective"
    )
    age = time.time() - float(report.get("t", 0.0))
    if age > (_HEARTBEAT + 2) * period + 0.5:
        where += f"; its last report is {age:.1f} s old (dead, or stuck holding the GIL?)"
    return where


def _diagnose(
    name: str, info: _Group, count: int, elapsed: float, exc: RuntimeError
) -> CollectiveTimeoutError | None:
    """The error to raise for ``exc`` from this rank's ``count``-th collective over ``info``,
    or None to let ``exc`` through."""
    timeout = _STATE.timeout_s
    if timeout is None:
        return None
    text = str(exc)
    timed_out = elapsed >= 0.9 * timeout or _TIMED_OUT.search(text) is not None
    peer_gone = any(marker in text.lower() for marker in _PEER_GONE)
    if not (timed_out or peer_gone):
        return None
    period = _period(timeout)
    me = _STATE.rank
    reports = _read_reports([r for r in info.ranks if r != me])
    missing: list[int] = []
    notes: list[str] = []
    for rank in info.ranks:
        if rank == me:
            continue
        report = reports.get(rank)
        if report is None:
            missing.append(rank)
            notes.append(f"rank {rank}: no report (it entered no watched collective yet)")
            continue
        seen, last = report.get("groups", {}).get(info.key, [0, ""])
        if int(seen) >= count:
            if report.get("now") and report["now"][0] == info.key and report["now"][3] != name:
                notes.append(f"rank {rank}: entered {report['now'][3]} as #{seen}")
            continue
        missing.append(rank)
        before = f"#{seen} {last}" if seen else "none"
        notes.append(
            f"rank {rank}: its last collective over this group was {before}; "
            f"{_where(report, period)}"
        )
    if not missing and not timed_out:
        return None
    group = info.label()
    first_line = (text.strip().splitlines() or [""])[0]
    if missing:
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
        verdict = f"{who} of the group did not arrive"
    else:
        verdict = (
            "every rank of the group entered its collective #"
            f"{count} there: they issued different collectives, or one failed inside it"
        )
    message = (
        f"{name} over group {group} did not complete within the {timeout:g} s timeout "
        f"(rank {me}, its collective #{count} over this group, failed after {elapsed:.1f} s): "
        f"{verdict}"
        + "".join(f"\n  {note}" for note in notes)
        + f"\n  backend error: {type(exc).__name__}: {first_line[:300]}"
    )
    return CollectiveTimeoutError(
        message,
        collective=name,
        group=group,
        ranks=info.ranks,
        missing=missing,
        timeout_s=timeout,
        elapsed_s=elapsed,
    )

"""Collective failures that say what happened: the collective, its group, and the rank that
never came (a stall) or that is gone (a crash).

A collective that a rank never joins leaves the others waiting. The backend ends the wait at the
process group's timeout (gloo raises ``Timed out waiting ...ms for recv``), but its error names
neither the collective, nor the group, nor the absent rank; and a rank that exits mid-collective
makes the others fail at once with ``Connection closed by peer``, naming an address. With the
watchdog on (:func:`configure`, or ``init_device_mesh(..., timeout_s=...)``), every collective
of the stack runs inside :func:`watch` (or is counted by :func:`watch_async`), and one that fails
raises :class:`CollectiveTimeoutError` (a stall: who did not arrive) or :class:`PeerLostError`
(a crash: who exited), both :class:`CollectiveError`; the decision is
:func:`hp_dtensor.collective_errors.diagnose`. The diagnosis is also logged (logger
``hp_dtensor.watchdog``, level ERROR) before it is raised, so it reaches a log file even when
the launcher stops the process right after.

How the ranks are found. Each rank counts, per group, the watched collectives it has
entered, in memory (a few hundred nanoseconds per collective: no message, no store write). A
daemon thread publishes these counts, the collective the rank is inside right now, and where it
runs (host, pid, process start time), to the job's c10d store every ``min(1 s, timeout / 5)``
when they have changed (and every third period regardless, as a heartbeat): at most one small
store write per rank and period, whatever the collective rate. A rank whose collective fails
publishes at once, saying so. Then it reads its group members' reports:

* after a wait to the timeout, a member whose count for the group is below the waiting rank's
  did not arrive, and its report says where it is instead. The reports are at most one period
  old, and the waiting rank has waited a whole timeout (five periods at least), so a rank that
  arrived in time is not reported missing;
* after a lost connection, counts prove nothing (they may be a period old: hundreds of
  collectives); a member whose process has exited (same host: ``/proc``, the pid and its start
  time) is gone; a member on another host that does not publish again within two periods (a
  live one does: its own collective failed too, or its heartbeat) stopped reporting.

Groups hp_dtensor creates get the timeout (:func:`group_timeout`); torch gives a new group 30
minutes by default, whatever the default group's timeout, so without it a collective over a
mesh axis waits half an hour. Blocking backends only: gloo's collectives return or raise in the
calling thread; NCCL's return at once and its own watchdog aborts the job at the group's
timeout, which this module passes on but cannot put a name to.
"""

from __future__ import annotations

import atexit
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch.distributed as dist

from hp_dtensor._peer_reports import Publisher, peer_reports
from hp_dtensor.collective_errors import (
    CollectiveError,
    CollectiveTimeoutError,
    Failure,
    PeerLostError,
    diagnose,
)

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "configure",
    "enabled",
    "forget_groups",
    "group_timeout",
    "name_group",
    "set_entry_hook",
    "stop",
    "timeout_s",
    "watch",
    "watch_async",
    "watch_p2p",
]

EntryHook = Callable[[str, str, int], None]
"""``hook(collective, group, number)``: called before this rank enters its ``number``-th
watched collective (1-based, all groups together; :func:`watch` only, not
:func:`watch_async`); for fault injection in tests."""

_LOG = logging.getLogger(__name__)
# A library's logger: silent unless the application configures logging (hp-train does).
_LOG.addHandler(logging.NullHandler())


@dataclass(eq=False)
class _Group:
    """One process group this rank is in: its identity across ranks and its count."""

    ranks: tuple[int, ...]
    key: str
    is_world: bool
    count: int = 0
    last: str = ""
    # A point-to-point channel's label (see watch_p2p); None for a process group.
    title: str | None = None

    def label(self) -> str:
        if self.title is not None:
            return self.title
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
    # By process group, and by ("p2p", src, dst) for point-to-point channels.
    groups: dict[Any, _Group] = field(default_factory=dict)
    # (group, its count, collective) of the watched collective this rank is inside, if any.
    current: tuple[_Group, int, str] | None = None
    entered: int = 0
    version: int = 0
    publisher: Publisher | None = None
    # This rank's failed collective, once one failed (published for the peers' diagnosis).
    failed: str | None = None


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
    _STATE.failed = None


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


def forget_groups() -> None:
    """Stop publishing and drop this module's references to the job's process groups (their
    counts); for after ``torch.distributed.destroy_process_group``. Torch frees a group's
    backend only with its last reference, and gloo's backend joins its worker threads then: a
    group kept until the interpreter's finalization is freed there, where a worker thread that
    still has a tensor to release needs the GIL and is ended by Python mid-destructor, which
    aborts the process ("terminate called without an active exception"). The watchdog stays
    configured; the counts restart with the next watched collective."""
    stop()
    _STATE.groups.clear()
    _STATE.world = None
    _STATE.current = None
    _STATE.entered = 0
    _STATE.failed = None


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

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.work.wait(*args, **kwargs)
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


def watch_p2p(transfer: str, src: int, dst: int, work: Any) -> Any:
    """Count ``work``, a point-to-point ``transfer`` from global rank ``src`` to ``dst`` that
    this rank (one of the two) has just posted; returns what to wait on instead, as
    :func:`watch_async` does.

    A send and its receive are counted on a channel of their own, ``src -> dst``, so that the
    counts of the two ranks match message for message (a process group's count would not:
    the other ranks of the group take no part); a receive that fails at the timeout names the
    sender when the sender's count on the channel is behind."""
    if _STATE.timeout_s is None or work is None:
        return work
    key = ("p2p", src, dst)
    info = _STATE.groups.get(key)
    if info is None:
        _group_info(None)  # the default group's ranks and the publisher, on first use
        info = _Group((src, dst), f"p{src}-{dst}", is_world=False, title=f"'p2p {src}->{dst}'")
        _STATE.groups[key] = info
    return _WatchedWork(work, transfer, info, _count(info, transfer))


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
    if isinstance(exc, CollectiveError):
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
        state.failed = None
        state.world = world
        state.rank = dist.get_rank()
    ranks = tuple(dist.get_process_group_ranks(group))
    key = f"g{zlib.crc32(repr(ranks).encode()):08x}"
    info = _Group(ranks, key, is_world=group is world)
    state.groups[group] = info
    if state.publisher is None and dist.get_world_size() > 1 and state.timeout_s is not None:
        state.publisher = Publisher(
            state.rank, _period(state.timeout_s), _snapshot, lambda: _STATE.version
        )
        if not _ATEXIT:
            _ATEXIT.append(True)
            atexit.register(stop)
    return info


def _period(timeout: float) -> float:
    return min(1.0, max(0.05, timeout / 5))


def _snapshot() -> dict[str, Any]:
    """This rank's counts per group, the collective it is inside, its failure if any."""
    state = _STATE
    groups = {g.key: [g.count, g.last] for g in list(state.groups.values())}
    current = state.current
    now = None
    if current is not None:
        info, count, name = current
        now = [info.key, info.label(), count, name]
    return {"groups": groups, "now": now, "failed": state.failed}


def _diagnose(
    name: str, info: _Group, count: int, elapsed: float, exc: RuntimeError
) -> CollectiveError | None:
    """The error to raise for ``exc`` from this rank's ``count``-th collective over ``info``,
    or None to let ``exc`` through."""
    timeout = _STATE.timeout_s
    if timeout is None:
        return None
    failure = Failure(
        collective=name,
        group=info.label(),
        group_key=info.key,
        ranks=info.ranks,
        rank=_STATE.rank,
        count=count,
        elapsed_s=elapsed,
        timeout_s=timeout,
        error=f"{type(exc).__name__}: {exc}",
    )
    if not (failure.timed_out or failure.peer_lost):
        return None
    # Say so at once: a peer diagnosing its own failure sees this rank alive and why it fails.
    _STATE.failed = f"{name} over group {failure.group} (#{count} there): {failure.error[:200]}"
    publisher = _STATE.publisher
    if publisher is not None:
        publisher.publish_now()
    peers = [r for r in info.ranks if r != failure.rank]
    reports = peer_reports(
        peers,
        info.key,
        _period(timeout),
        wait_for_news=failure.peer_lost and not failure.timed_out,
    )
    error = diagnose(failure, reports)
    if error is not None:
        _LOG.error("rank %d: %s", failure.rank, error)
    return error

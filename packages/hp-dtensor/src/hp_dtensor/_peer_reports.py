"""Each rank's report in the job's c10d store, and what a failing rank reads back from it.

A report is one JSON value per rank under :data:`REPORT_KEY`: when it was written (``t``) and
its sequence number (``seq``), the rank's count of watched collectives per group, the one it is
inside (``now``), its own failure if a collective failed on it (``failed``), and where it runs
(``host``: host name and boot id, ``pid``, ``start``: the process's start time in clock ticks,
so a reused pid is not taken for the rank). :class:`Publisher` writes it from a daemon thread;
:func:`peer_reports` turns what a failing rank reads into
:class:`hp_dtensor.collective_errors.PeerReport` values, with each peer's process state as far
as this host can see it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import torch.distributed as dist

from hp_dtensor.collective_errors import PeerReport, ProcessState

__all__ = ["REPORT_KEY", "Publisher", "identity", "peer_reports", "read_reports"]

#: Where each rank's report lives in the job's default store.
REPORT_KEY = "hp_dtensor/watchdog/{rank}"
# A rank whose report did not change publishes it again after this many periods.
HEARTBEAT = 3


@cache
def identity() -> dict[str, Any]:
    """Where this process runs: host (name and boot id: two containers may share a name), pid,
    and its start time in clock ticks since boot (None where ``/proc`` is missing)."""
    host = socket.gethostname()
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            host += "/" + file.read().strip()
    except OSError:
        pass
    pid = os.getpid()
    return {"host": host, "pid": pid, "start": _start_ticks(pid)}


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name, or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as file:
            text = file.read()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after the last ')'.
    return text[text.rfind(")") + 2 :].split()


def _start_ticks(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


# The kernel's PF_EXITING flag (field 9 of /proc/<pid>/stat): set when the process starts to
# exit, before its sockets close (which is when its peers see "connection reset"), while its
# state still reads R or D; it becomes a zombie only after.
_PF_EXITING = 0x4


def process_state(report: Mapping[str, Any]) -> ProcessState:
    """Whether the process that wrote ``report`` runs: ``unknown`` on another host (or for a
    report without an identity), else from ``/proc`` (gone, exiting, a zombie, or its pid
    reused is ``exited``), or ``os.kill(pid, 0)`` where there is no ``/proc``."""
    me = identity()
    pid = report.get("pid")
    if report.get("host") != me["host"] or not isinstance(pid, int):
        return "unknown"
    if me["start"] is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except PermissionError:
            return "running"
        return "running"
    fields = _proc_stat(pid)
    if fields is None or fields[0] in ("Z", "X") or int(fields[6]) & _PF_EXITING:
        return "exited"
    started = int(fields[19]) if len(fields) > 19 else None
    return "exited" if started != report.get("start") else "running"


class Publisher:
    """Writes ``snapshot()`` as this rank's report to the default store whenever
    ``version()`` changed, once a period, and every :data:`HEARTBEAT` periods regardless;
    :meth:`publish_now` writes it at once (from any thread)."""

    def __init__(
        self,
        rank: int,
        period: float,
        snapshot: Callable[[], dict[str, Any]],
        version: Callable[[], int],
    ) -> None:
        self.store = dist.distributed_c10d._get_default_store()
        self.key = REPORT_KEY.format(rank=rank)
        self.period = period
        self.snapshot = snapshot
        self.version = version
        self.seq = 0
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hp-dtensor-watchdog", daemon=True)
        self.thread.start()

    def publish_now(self) -> bool:
        """Write the report now; False when the store is gone (the job is ending)."""
        with self.lock:
            self.seq += 1
            report = {**self.snapshot(), **identity(), "t": time.time(), "seq": self.seq}
            try:
                self.store.set(self.key, json.dumps(report))
            except Exception:  # the store's server is gone: nobody is left to read it
                return False
            return True

    def _run(self) -> None:
        published, quiet = -1, 0
        while True:
            version = self.version()
            # On a change, and every few periods anyway: the report's time tells the waiting
            # ranks whether this thread still runs.
            if version != published or quiet >= HEARTBEAT:
                if not self.publish_now():
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


def read_reports(ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The reports of ``ranks`` found in the store (a rank that never published has none)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return {}
    found: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        key = REPORT_KEY.format(rank=rank)
        try:
            if store.check([key]):
                found[rank] = json.loads(store.get(key))
        except (RuntimeError, ValueError):
            continue
    return found


def peer_reports(
    peers: Sequence[int], group_key: str, period: float, *, wait_for_news: bool
) -> dict[int, PeerReport | None]:
    """Each peer's report as :class:`PeerReport` (None: it never published one).

    ``wait_for_news`` (a lost connection): for up to two periods, a peer that neither has
    exited nor published again (a live rank does: its own collective failed and it publishes at
    once, or its heartbeat) is watched: its process state is read again, its report re-read.
    The wait ends early once every peer on another host has news, and either a peer has exited
    or every peer on this host has news. A peer still without news at the end is ``stale``.
    Otherwise a report is ``stale`` when it is older than a few heartbeats (its publisher
    stopped)."""
    first = read_reports(peers)
    states = {rank: process_state(report) for rank, report in first.items()}
    latest = dict(first)
    waiting = [r for r in first if states[r] != "exited"] if wait_for_news else []
    deadline = time.monotonic() + 2 * period
    while _still_waiting(waiting, states) and time.monotonic() < deadline:
        time.sleep(min(0.02, period / 4))
        reread = read_reports(waiting)
        for rank in list(waiting):
            report = reread.get(rank)
            if report is not None and report.get("seq") != first[rank].get("seq"):
                latest[rank] = report
                waiting.remove(rank)
            else:
                states[rank] = process_state(latest[rank])
                if states[rank] == "exited":
                    waiting.remove(rank)
    now = time.time()
    found: dict[int, PeerReport | None] = {}
    for rank in peers:
        if rank not in latest:
            found[rank] = None
            continue
        report = latest[rank]
        age = now - float(report.get("t", 0.0))
        stale = rank in waiting if wait_for_news else age > (HEARTBEAT + 2) * period + 0.5
        found[rank] = _as_peer_report(report, group_key, age, stale, states[rank])
    return found


def _still_waiting(waiting: Sequence[int], states: Mapping[int, ProcessState]) -> bool:
    """Whether a peer without news may still tell something: one on another host, or, while
    no peer has exited, one on this host (its exit may not show in ``/proc`` yet)."""
    if any(states[r] == "unknown" for r in waiting):
        return True
    return bool(waiting) and not any(state == "exited" for state in states.values())


def _as_peer_report(
    report: Mapping[str, Any], group_key: str, age: float, stale: bool, state: ProcessState
) -> PeerReport:
    seen, last = report.get("groups", {}).get(group_key, [0, ""])
    now = report.get("now")
    failed = report.get("failed")
    return PeerReport(
        count=int(seen),
        last=str(last),
        now=(str(now[0]), str(now[1]), int(now[2]), str(now[3])) if now else None,
        age_s=age,
        stale=stale,
        process=state,
        where=f"pid {report.get('pid')} on {str(report.get('host', '?')).split('/')[0]}",
        failed=str(failed) if failed else None,
    )

"""What went wrong in a collective that failed: a stall (a rank never came) or a crash (a rank
left), told apart from what the ranks reported.

A collective over a group fails on a blocking backend (gloo) in two different ways:

* **a stall**: a rank of the group never enters it; the others wait for the whole timeout, then
  the backend raises ``Timed out waiting ...``. The culprits are the ranks whose count of
  collectives over the group is below the waiting rank's: :class:`CollectiveTimeoutError`.
* **a crash**: a rank of the group exits (killed, or its own error) while the others are in a
  collective with it; they fail at once, ``Connection closed by peer`` / ``reset``. Counts
  prove nothing here (a live rank's published count can lag its real one by a period, which
  at a thousand collectives a second is hundreds), so the culprit is the rank that is gone:
  its process no longer runs (same host), or it stopped reporting (another host):
  :class:`PeerLostError`.

:func:`diagnose` is the decision, pure: it takes the failure and the peers' reports as data and
returns the error to raise, or None for an error that is neither (it passes unchanged).
:mod:`hp_dtensor.watchdog` gathers the data (the c10d store, ``/proc``) and raises.

Postconditions of :func:`diagnose` (tested in ``tests/test_collective_errors.py``):

* a failure within ``0.9 x`` the timeout whose backend error is a lost connection is a
  :class:`PeerLostError`; its ``gone`` are exactly the peers whose process exited, its
  ``silent`` exactly the peers on other hosts that never reported again; no rank is ever
  blamed from its count there;
* a failure at the timeout (or one the backend calls a timeout) is a
  :class:`CollectiveTimeoutError` whose ``missing`` are the peers without a report or whose
  count over the group is below the failing rank's;
* any other error gives None.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "Failure",
    "PeerLostError",
    "PeerReport",
    "ProcessState",
    "diagnose",
]

# A backend error that means the wait ended: a timeout, or a peer that left the collective.
_TIMED_OUT = re.compile(r"timed? ?out", re.IGNORECASE)
_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "connection refused")

ProcessState = Literal["running", "exited", "unknown"]
"""A peer's process as this rank can tell: ``running`` or ``exited`` (same host: ``/proc``),
``unknown`` (another host: only its reports tell)."""


class CollectiveError(RuntimeError):
    """A collective failed because of another rank (base of the two kinds).

    Attributes:
        collective: what was issued (``"all_reduce"``, ``"Muon exchange (all_to_all)"``, ...).
        group: the group, as in the message (``"'tp' (ranks [0, 1])"``).
        ranks: the group's global ranks.
        elapsed_s: how long this rank was inside the collective.
    """

    def __init__(
        self, message: str, *, collective: str, group: str, ranks: Sequence[int], elapsed_s: float
    ) -> None:
        super().__init__(message)
        self.collective = collective
        self.group = group
        self.ranks = tuple(ranks)
        self.elapsed_s = elapsed_s

    def _fields(self) -> dict[str, Any]:
        return {
            "collective": self.collective,
            "group": self.group,
            "ranks": self.ranks,
            "elapsed_s": self.elapsed_s,
        }

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only attributes: rebuild through a helper so the error pickles (rank pools
        # and multiprocessing send exceptions between processes).
        return (_rebuild, (type(self), str(self), self._fields()))


def _rebuild(kind: type[CollectiveError], message: str, fields: dict[str, Any]) -> CollectiveError:
    return kind(message, **fields)


class CollectiveTimeoutError(CollectiveError):
    """A collective did not complete within the timeout: a rank never entered it.

    Attributes (besides :class:`CollectiveError`'s):
        missing: the ranks of the group that did not enter the collective (empty when every
            rank did: then they entered different collectives, or one failed inside it).
        timeout_s: the configured timeout.
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
        super().__init__(
            message, collective=collective, group=group, ranks=ranks, elapsed_s=elapsed_s
        )
        self.missing = tuple(missing)
        self.timeout_s = timeout_s

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "missing": self.missing, "timeout_s": self.timeout_s}


class PeerLostError(CollectiveError):
    """A collective failed at once because a rank of the group left it: a crash, not a stall.

    Attributes (besides :class:`CollectiveError`'s):
        gone: the ranks whose process has exited (seen from this host).
        silent: the ranks on other hosts that stopped reporting (exited, or hung).
    """

    def __init__(
        self,
        message: str,
        *,
        collective: str,
        group: str,
        ranks: Sequence[int],
        gone: Sequence[int],
        silent: Sequence[int],
        elapsed_s: float,
    ) -> None:
        super().__init__(
            message, collective=collective, group=group, ranks=ranks, elapsed_s=elapsed_s
        )
        self.gone = tuple(gone)
        self.silent = tuple(silent)

    def _fields(self) -> dict[str, Any]:
        return {**super()._fields(), "gone": self.gone, "silent": self.silent}


@dataclass(frozen=True)
class Failure:
    """A collective that raised on this rank.

    Attributes:
        collective: its name; group: its group's label; group_key: the group's key in reports;
        ranks: the group's global ranks; rank: this rank; count: its number over the group on
        this rank (1-based); elapsed_s: how long this rank was inside it; timeout_s: the
        configured timeout; error: the backend's error text.
    """

    collective: str
    group: str
    group_key: str
    ranks: tuple[int, ...]
    rank: int
    count: int
    elapsed_s: float
    timeout_s: float
    error: str

    @property
    def timed_out(self) -> bool:
        """The wait ran to the timeout (or the backend says it timed out)."""
        return self.elapsed_s >= 0.9 * self.timeout_s or _TIMED_OUT.search(self.error) is not None

    @property
    def peer_lost(self) -> bool:
        """The backend lost its connection to a peer."""
        lowered = self.error.lower()
        return any(marker in lowered for marker in _PEER_GONE)


@dataclass(frozen=True)
class PeerReport:
    """What one peer published last, and what this rank knows of its process.

    Attributes:
        count: its count of collectives over the failed one's group; last: the last of them.
        now: ``(group key, group label, number, collective)`` it was inside, or None.
        age_s: how old the report was when read; stale: the report did not change while this
            rank waited for it to (a rank that runs publishes again within a few periods).
        process: ``running`` / ``exited`` / ``unknown`` (see :data:`ProcessState`).
        where: ``pid <pid> on <host>``; failed: its own failure, if it reported one.
    """

    count: int
    last: str
    now: tuple[str, str, int, str] | None
    age_s: float
    stale: bool
    process: ProcessState
    where: str
    failed: str | None = None


def _where_now(report: PeerReport) -> str:
    now = report.now
    if now is None:
        return "now outside any watched collective"
    return f"now inside {now[3]} (its collective #{now[2]} over group {now[1]})"


def _last(report: PeerReport) -> str:
    return f"#{report.count} {report.last}" if report.count else "none"


def diagnose(failure: Failure, peers: Mapping[int, PeerReport | None]) -> CollectiveError | None:
    """The error to raise for ``failure``, given every peer's report (None: it never
    published one), or None when the backend error is neither a timeout nor a lost peer.
    See the module docstring for the postconditions."""
    if failure.peer_lost and not failure.timed_out:
        return _lost(failure, peers)
    if failure.timed_out:
        return _stalled(failure, peers)
    return None


def _header(failure: Failure) -> str:
    return (
        f"{failure.collective} over group {failure.group}" if failure.group else failure.collective
    )


def _message(failure: Failure, what: str, verdict: str, notes: Sequence[str]) -> str:
    """``<collective> over group <group> <what>: <verdict>``, a line per note, the backend's
    first line."""
    first_line = (failure.error.strip().splitlines() or [""])[0]
    return (
        f"{_header(failure)} {what}: {verdict}"
        + "".join(f"\n  {note}" for note in notes)
        + f"\n  backend error: {first_line[:300]}"
    )


def _peers(
    failure: Failure, peers: Mapping[int, PeerReport | None]
) -> Iterator[tuple[int, PeerReport | None]]:
    """Every other rank of the failed collective's group, in group order, with its report."""
    return ((rank, peers.get(rank)) for rank in failure.ranks if rank != failure.rank)


def _who(ranks: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 2, 3``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _lost(failure: Failure, peers: Mapping[int, PeerReport | None]) -> PeerLostError:
    gone: list[int] = []
    silent: list[int] = []
    notes: list[str] = []
    for rank, report in _peers(failure, peers):
        if report is None:
            silent.append(rank)
            notes.append(f"rank {rank}: never reported (it entered no watched collective)")
            continue
        last = f"its last report ({report.age_s:.1f} s old): {_last(report)}, {_where_now(report)}"
        if report.process == "exited":
            gone.append(rank)
            notes.append(f"rank {rank}: exited ({report.where} no longer runs); {last}")
        elif report.process == "unknown" and report.stale:
            silent.append(rank)
            notes.append(f"rank {rank}: stopped reporting ({report.where}); {last}")
        elif report.failed:
            notes.append(f"rank {rank}: running, its own collective failed: {report.failed}")
    if gone or silent:
        parts = []
        if gone:
            parts.append(f"{_who(gone)} exited")
        if silent:
            parts.append(
                f"{_who(silent)} stopped reporting "
                "(exited or hung; on another host, so its process cannot be checked from here)"
            )
        verdict = " and ".join(parts) + " while the group was in it"
    else:
        verdict = (
            "the backend lost its connection to a peer, but every rank of the group is still "
            "running (a rank leaving after its own error, or the network)"
        )
    what = (
        f"failed on rank {failure.rank} after {failure.elapsed_s:.1f} s "
        f"(its collective #{failure.count} over this group)"
    )
    return PeerLostError(
        _message(failure, what, verdict, notes),
        collective=failure.collective,
        group=failure.group,
        ranks=failure.ranks,
        gone=gone,
        silent=silent,
        elapsed_s=failure.elapsed_s,
    )


def _stalled(failure: Failure, peers: Mapping[int, PeerReport | None]) -> CollectiveTimeoutError:
    missing: list[int] = []
    notes: list[str] = []
    for rank, report in _peers(failure, peers):
        if report is None:
            missing.append(rank)
            notes.append(f"rank {rank}: no report (it entered no watched collective yet)")
            continue
        if report.count >= failure.count:
            now = report.now
            if now is not None and now[0] == failure.group_key and now[3] != failure.collective:
                notes.append(f"rank {rank}: entered {now[3]} as #{report.count}")
            continue
        missing.append(rank)
        note = f"rank {rank}: its last collective over this group was {_last(report)}; "
        note += _where_now(report)
        if report.process == "exited":
            note += f"; it has exited since ({report.where} no longer runs)"
        elif report.stale:
            note += f"; its last report is {report.age_s:.1f} s old (dead, or stuck holding "
            note += "the GIL?)"
        notes.append(note)
    if missing:
        verdict = f"{_who(missing)} of the group did not arrive"
    else:
        verdict = (
            f"every rank of the group entered its collective #{failure.count} there: they "
            "issued different collectives, or one failed inside it"
        )
    what = (
        f"did not complete within the {failure.timeout_s:g} s timeout (rank {failure.rank}, "
        f"its collective #{failure.count} over this group, failed after "
        f"{failure.elapsed_s:.1f} s)"
    )
    return CollectiveTimeoutError(
        _message(failure, what, verdict, notes),
        collective=failure.collective,
        group=failure.group,
        ranks=failure.ranks,
        missing=missing,
        timeout_s=failure.timeout_s,
        elapsed_s=failure.elapsed_s,
    )

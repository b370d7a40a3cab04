"""One rank's step as a program of compute and collectives, simulated on streams.

A program lists what the runtime does, in its order (:mod:`~hp_planner.price.runtime_order`
writes hp-fsdp's): :class:`Compute` runs on the compute stream; :class:`Issue` starts a
collective on the stream of its topology tier (collectives on one tier share its links and run
one after another; different tiers run side by side), no earlier than the collective it comes
``after`` ends; :class:`Wait` stalls the compute stream until a collective has ended (the
runtime computes on its result, or frees its buffer); :class:`Mark` notes the compute stream's
clock. :func:`simulate` runs the program.

Postconditions of :func:`simulate` (``tests/test_price_timeline.py`` checks them over
generated programs):

* ``makespan == compute + sum(exposed)``: the compute stream is either computing or waiting,
  and each wait is charged to the kind of collective waited for (a collective delayed by one
  queued before it on its tier is charged to its own kind).
* Every exposed share is at least 0 and at most the total seconds of its kind's collectives
  plus the seconds of the collectives queued before them.
* A collective waited for right after it is issued, on an idle tier, is exposed in full.
* The order collectives start in on a tier is the order they are issued in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Compute", "Issue", "Mark", "Op", "Timeline", "Wait", "simulate"]


@dataclass(frozen=True)
class Compute:
    """``seconds`` on the compute stream (``label`` says what, for reading a program)."""

    seconds: float
    label: str = ""


@dataclass(frozen=True)
class Issue:
    """Start collective ``name`` (unique in the program) of ``kind`` on ``tier``'s stream.

    Attributes:
        name: its name; a :class:`Wait` refers to it.
        kind: its collective kind (:data:`hp_planner.price.comm.KINDS`), what its exposed time
            is charged to.
        tier: the topology tier its group spans (its stream).
        seconds: how long it runs once started.
        after: a collective it cannot start before (hp-fsdp's replicate all-reduce needs the
            reduce-scatters of its bucket done), or None.
    """

    name: str
    kind: str
    tier: str
    seconds: float
    after: str | None = None


@dataclass(frozen=True)
class Wait:
    """The compute stream waits until collective ``name`` has ended."""

    name: str


@dataclass(frozen=True)
class Mark:
    """Notes the compute stream's clock under ``label`` (:attr:`Timeline.marks`)."""

    label: str


Op = Compute | Issue | Wait | Mark


@dataclass(frozen=True)
class Timeline:
    """The simulated program.

    Attributes:
        makespan: seconds from the first op to the last wait.
        compute: seconds the compute stream computes.
        exposed: per collective kind (in order of first issue), seconds the compute stream
            waits for that kind.
        issued: the collectives' names in the order they were issued.
        marks: ``(label, clock)`` per :class:`Mark`, in program order.
        busy: per tier, the seconds its stream carries collectives.
    """

    makespan: float
    compute: float
    exposed: tuple[tuple[str, float], ...]
    issued: tuple[str, ...]
    marks: tuple[tuple[str, float], ...]
    busy: tuple[tuple[str, float], ...]

    def exposed_of(self, kind: str) -> float:
        """Exposed seconds of ``kind`` (0 where the program issues none)."""
        return dict(self.exposed).get(kind, 0.0)

    def mark(self, label: str) -> float:
        """The clock at the first :class:`Mark` ``label``."""
        for name, clock in self.marks:
            if name == label:
                return clock
        raise KeyError(f"no mark {label!r}; marks are {[n for n, _ in self.marks]}")


def simulate(program: Iterable[Op]) -> Timeline:
    """Run ``program`` (module doc).

    Raises:
        ValueError: a negative duration, a name issued twice, a wait for (or an ``after`` of)
            a collective not issued before, or a collective never waited for.
    """
    clock = compute = 0.0
    tier_free: dict[str, float] = {}
    busy: dict[str, float] = {}
    ends: dict[str, float] = {}
    kinds: dict[str, str] = {}
    waited: set[str] = set()
    exposed: dict[str, float] = {}
    issued: list[str] = []
    marks: list[tuple[str, float]] = []
    for op in program:
        if isinstance(op, Compute):
            if op.seconds < 0:
                raise ValueError(f"compute {op.label!r} of {op.seconds} s: durations are >= 0")
            clock += op.seconds
            compute += op.seconds
        elif isinstance(op, Issue):
            if op.seconds < 0:
                raise ValueError(f"collective {op.name!r} of {op.seconds} s: durations are >= 0")
            if op.name in ends:
                raise ValueError(f"collective {op.name!r} issued twice; names are unique")
            start = max(clock, tier_free.get(op.tier, 0.0))
            if op.after is not None:
                if op.after not in ends:
                    raise ValueError(f"{op.name!r} comes after {op.after!r}, not issued before")
                start = max(start, ends[op.after])
            ends[op.name] = tier_free[op.tier] = start + op.seconds
            busy[op.tier] = busy.get(op.tier, 0.0) + op.seconds
            kinds[op.name] = op.kind
            exposed.setdefault(op.kind, 0.0)
            issued.append(op.name)
        elif isinstance(op, Wait):
            if op.name not in ends:
                raise ValueError(f"a wait for {op.name!r}, which was not issued before")
            waited.add(op.name)
            if ends[op.name] > clock:
                exposed[kinds[op.name]] += ends[op.name] - clock
                clock = ends[op.name]
        else:
            marks.append((op.label, clock))
    never = [name for name in issued if name not in waited]
    if never:
        raise ValueError(f"collectives never waited for: {never[:4]} ({len(never)} in all)")
    return Timeline(
        makespan=clock,
        compute=compute,
        exposed=tuple(exposed.items()),
        issued=tuple(issued),
        marks=tuple(marks),
        busy=tuple(busy.items()),
    )

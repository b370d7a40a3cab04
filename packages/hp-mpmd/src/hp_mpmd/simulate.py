"""Time a :class:`SchedulePlan` under a cost model and draw it as an ASCII timeline.

The execution model is the checker's (:func:`hp_mpmd.check.replay`): compute actions run back
to back on their rank; a rank waits on each batch of consecutive communication actions. Two
timing models:

* eager sends (default): a send completes as soon as it is posted; a receive completes
  ``comm`` after its matching send was posted. This is what a runtime gets when it waits only
  on receives before computing (and on sends later), and what the textbook formulas assume.
* ``rendezvous=True``: a batch completes only once every peer batch it pairs with was posted
  (``comm`` after the later side), which is what a runtime gets when it waits on *all* works
  of a ``batch_isend_irecv`` before going on with a backend whose sends block until received.

Idle time is every moment a rank is not computing (waiting on a batch counts as idle). With
``comm = 0`` and equal stage costs the measured bubble fractions (eager) are the textbook
ones: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B, ``(p - 1) / (v m + p - 1)`` for
interleaved 1F1B, ``(p - 1) / (3 m + p - 1)`` for ZB-H1 (``m >= p``, F = I = W = 1);
DualPipeV (:func:`hp_mpmd.schedules.dualpipev`) measures 4.0 % at p = 2, m = 4 and 6.8 % at
p = 4, m = 16.
Under rendezvous, GPipe and 1F1B are unchanged but interleaved 1F1B and ZB-H1 lose most of
their gain (e.g. p = 4, m = 8: interleaved v = 2 59 %, ZB-H1 27 %, against 16 % and 11 %).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hp_mpmd.actions import COMPUTE_KINDS, Action, ActionKind, SchedulePlan
from hp_mpmd.check import check_plan, replay

__all__ = ["Simulation", "TimedAction", "format_timeline", "simulate"]


@dataclass(frozen=True)
class TimedAction:
    """One compute action placed in time.

    Attributes:
        action: the action.
        start: when it started.
        end: when it finished.
    """

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """The timed replay of a plan.

    Attributes:
        name: the plan's name.
        compute: per rank, its compute actions in execution order, with times.
        busy: per rank, the total compute time.
        makespan: when the last rank finished (its last action, communication included).
        bubble_fraction: idle time over ``num_ranks x makespan`` (0 for an empty makespan).
        peak_in_flight: per rank, the most microbatch-stages alive at once: forward done,
            backward (or weight pass) not yet done. A proxy for peak activation memory.
    """

    name: str
    compute: tuple[tuple[TimedAction, ...], ...]
    busy: tuple[float, ...]
    makespan: float
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks."""
        return len(self.compute)


def _cost(name: str, value: float, *, allow_zero: bool) -> float:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} must be a finite, {bound} number, got {value!r}")
    return float(value)


def simulate(
    plan: SchedulePlan,
    *,
    forward: float = 1.0,
    backward: float = 2.0,
    backward_input: float = 1.0,
    backward_weight: float = 1.0,
    comm: float = 0.0,
    rendezvous: bool = False,
) -> Simulation:
    """Check ``plan`` (:func:`hp_mpmd.check.check_plan`), then time it.

    Every stage costs the same: ``forward`` per ``FORWARD``, ``backward`` per full
    ``BACKWARD``, ``backward_input`` / ``backward_weight`` per split pass; every transfer costs
    ``comm``. ``rendezvous`` picks the timing model (module docstring). Postconditions:
    ``compute[r]`` lists rank ``r``'s compute actions in plan order,
    each starting no earlier than the previous one ended; ``bubble_fraction`` is
    ``1 - sum(busy) / (num_ranks x makespan)``.

    Raises:
        PlanCheckError: the plan is invalid or deadlocks.
        ValueError: a cost that is not finite, or not positive (``comm``: negative).
    """
    costs = {
        ActionKind.FORWARD: _cost("forward", forward, allow_zero=False),
        ActionKind.BACKWARD: _cost("backward", backward, allow_zero=False),
        ActionKind.BACKWARD_INPUT: _cost("backward_input", backward_input, allow_zero=False),
        ActionKind.BACKWARD_WEIGHT: _cost("backward_weight", backward_weight, allow_zero=False),
    }
    comm = _cost("comm", comm, allow_zero=True)
    check_plan(plan)
    result = replay(plan, lambda a: costs[a.kind], comm, eager_sends=not rendezvous)
    compute = tuple(
        tuple(
            TimedAction(a, result.start[r][q], result.end[r][q])
            for q, a in enumerate(actions)
            if a.kind in COMPUTE_KINDS
        )
        for r, actions in enumerate(plan.actions)
    )
    busy = tuple(sum(t.end - t.start for t in row) for row in compute)
    makespan = max((max(row, default=0.0) for row in result.end), default=0.0)
    total = plan.num_ranks * makespan
    bubble = 1.0 - sum(busy) / total if total > 0 else 0.0
    return Simulation(
        name=plan.name,
        compute=compute,
        busy=busy,
        makespan=makespan,
        bubble_fraction=bubble,
        peak_in_flight=tuple(_peak_in_flight(actions) for actions in plan.actions),
    )


def _peak_in_flight(actions: tuple[Action, ...]) -> int:
    """The most (stage, microbatch) pairs alive: forward run, backward or weight pass not yet."""
    alive = peak = 0
    for a in actions:
        if a.kind is ActionKind.FORWARD:
            alive += 1
            peak = max(peak, alive)
        elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            alive -= 1
    return peak


def _label(action: Action, chunk: int | None) -> str:
    text = f"{action.kind.value}{action.microbatch}"
    return text if chunk is None else f"{text}{chr(ord('a') + chunk % 26)}"


def format_timeline(
    plan: SchedulePlan, simulation: Simulation | None = None, *, width: int | None = None
) -> str:
    """An ASCII timeline: a header line, then one row per rank.

    Each time unit is ``width`` characters (default: the longest label plus one). A compute
    action is drawn as its label (kind letter ``F``/``B``/``I``/``W`` and microbatch, plus a
    chunk letter ``a``, ``b``, ... when a rank runs several stages: its first, second, ...
    stage) padded with spaces over its duration; idle time is ``.``. Labels that do not fit
    their span are cut. ``simulation`` defaults to :func:`simulate` with default costs.

    Raises:
        ValueError: ``width`` is not a positive integer.
    """
    sim = simulate(plan) if simulation is None else simulation
    multi = any(len(plan.stages_of(r)) > 1 for r in range(plan.num_ranks))
    chunk_of = {s: plan.stages_of(r).index(s) for s, r in enumerate(plan.stage_to_rank)}
    labels = [
        [_label(t.action, chunk_of[t.action.stage] if multi else None) for t in row]
        for row in sim.compute
    ]
    if width is None:
        width = max((len(x) for row in labels for x in row), default=1) + 1
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a positive integer, got {width!r}")
    cells = round(sim.makespan * width)
    lines = [
        f"{plan.name}: {plan.num_ranks} ranks, {plan.num_stages} stages, "
        f"{plan.num_microbatches} microbatches, makespan {sim.makespan:g}, "
        f"bubble {sim.bubble_fraction:.1%}"
    ]
    for r, row in enumerate(sim.compute):
        line = ["."] * cells
        for timed, label in zip(row, labels[r], strict=True):
            lo, hi = round(timed.start * width), round(timed.end * width)
            span = (label + " " * max(0, hi - lo - len(label)))[: hi - lo]
            line[lo:hi] = span
        lines.append(f"rank {r:>{len(str(plan.num_ranks - 1))}} |{''.join(line)}|")
    return "\n".join(lines)

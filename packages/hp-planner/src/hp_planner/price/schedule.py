"""The pipeline's step time and bubble from hp-mpmd's own plan and simulator.

The trainer runs its JobPlan's schedule (``JobPlan.schedule``); :func:`pipeline_timing` takes
that same :class:`hp_mpmd.SchedulePlan` from hp-planner (:func:`hp_planner.plan_schedule`, what
:func:`hp_planner.plan_job` records, without planning the rest of the job for every
microbatch count the search tries) and times it with
:func:`hp_mpmd.simulate.simulate` (eager sends): every stage at the slowest stage's forward and
backward time per microbatch (compute plus exposed communication), every transfer at the
stage boundary's send time. The bubble is the makespan less one stage's busy time; the
microbatches in flight per stage (its activation memory) are the simulator's
``peak_in_flight``.

Schedules with ``v`` virtual stages per rank (``interleaved``, ``dualpipev``) time each virtual
stage at ``1 / v`` of the rank's forward and backward, and count a rank's in-flight
microbatches in whole-rank units (the simulator's microbatch-stages over ``v``, rounded up).
Split-backward schedules (``zbh1``, ``dualpipev``) time the input and the weight pass at half
the backward each.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from hp_mpmd.simulate import Simulation, simulate
from hp_planner.inputs import JobDims, TrainingPolicy
from hp_planner.plan_job import plan_schedule
from hp_planner.price.model import PricingError

__all__ = ["PipelineTiming", "in_flight", "pipeline_timing"]


@dataclass(frozen=True)
class PipelineTiming:
    """One step of the pipeline.

    Attributes:
        schedule: its name.
        makespan: seconds from the first forward to the last backward.
        bubble: idle seconds of the busiest stage (``makespan - m x (forward + backward)``).
        bubble_fraction: the simulator's idle share over all stages.
        in_flight: per pipeline rank, the most microbatches alive at once (in units of the
            rank's whole share of the model).
    """

    schedule: str
    makespan: float
    bubble: float
    bubble_fraction: float
    in_flight: tuple[int, ...]


@lru_cache(maxsize=1024)
def _simulate(
    schedule: str, pp: int, m: int, forward: float, backward: float, comm: float
) -> Simulation:
    training = TrainingPolicy(schedule=schedule, microbatches=m)
    plan = plan_schedule(JobDims(pp=pp), training)
    if plan is None:
        raise PricingError(f"a pipeline schedule needs pp > 1, got pp={pp}")
    v = training.stages_per_rank
    return simulate(
        plan,
        forward=forward / v,
        backward=backward / v,
        backward_input=backward / (2 * v),
        backward_weight=backward / (2 * v),
        comm=comm,
    )


def _virtual(schedule: str) -> int:
    return TrainingPolicy(schedule=schedule).stages_per_rank


def pipeline_timing(
    schedule: str, pp: int, microbatches: int, forward: float, backward: float, comm: float
) -> PipelineTiming:
    """Time ``schedule`` over ``pp`` stages and ``microbatches`` microbatches, each stage taking
    ``forward`` and ``backward`` seconds per microbatch and each transfer ``comm`` (module doc).

    Raises:
        PricingError: ``pp`` is 1 (no pipeline to time).
        hp_planner.PlanInputError: a schedule hp-planner does not know.
    """
    sim = _simulate(schedule, pp, microbatches, max(forward, 1e-12), max(backward, 1e-12), comm)
    busy = microbatches * (forward + backward)
    return PipelineTiming(
        schedule=schedule,
        makespan=sim.makespan,
        bubble=max(0.0, sim.makespan - busy),
        bubble_fraction=sim.bubble_fraction,
        in_flight=tuple(-(-n // _virtual(schedule)) for n in sim.peak_in_flight),
    )


def in_flight(schedule: str, pp: int, microbatches: int, stage: int) -> int:
    """The most microbatches alive at once on ``stage`` (1 without pipelining)."""
    if pp == 1:
        return 1
    peak = _simulate(schedule, pp, microbatches, 1.0, 2.0, 0.0).peak_in_flight[stage]
    return -(-peak // _virtual(schedule))

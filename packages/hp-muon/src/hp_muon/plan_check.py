"""``Muon(plan=...)``: the step plan Muon makes, compared with the one it was given.

A job planner hands the optimizer its part of the job's plan (:func:`hp_muon.plan_muon`);
Muon plans again from its parameters at its first step and refuses to run a plan it would not
have made, naming the rank group and the first difference (the owner of a matrix, the
batching of matrices into buckets, the bucket size ...), so a planner and the optimizer that
drift apart fail at the first step instead of balancing the work differently than planned.
"""

from __future__ import annotations

from dataclasses import fields

from hp_muon.plan import MatrixJob
from hp_muon.step_plan import MuonGroupPlan, MuonStepPlan

__all__ = ["check_muon_plan", "muon_plan_difference"]


def _job_difference(group: MuonGroupPlan, j: int, mine: MatrixJob, theirs: MatrixJob) -> str | None:
    for f in fields(MatrixJob):
        a, b = getattr(mine, f.name), getattr(theirs, f.name)
        if a != b:
            what = {"sources": "pieces gathered", "targets": "pieces scattered"}.get(f.name, f.name)
            return f"{group.matrix_label(j)}: {what} planned {a!r}, given {b!r}"
    return None


def _group_difference(mine: MuonGroupPlan, theirs: MuonGroupPlan) -> str | None:
    """The first difference of two plans of the same rank group, or None."""
    if mine.local != theirs.local:
        return f"single-rank group planned {mine.local}, given {theirs.local}"
    if mine.bucket_numel != theirs.bucket_numel:
        return (
            f"bucket size planned {mine.bucket_numel} elements, given {theirs.bucket_numel} "
            "(bucket_cap_mb differs)"
        )
    if mine.indices != theirs.indices:
        return f"parameters (positions) planned {mine.indices}, given {theirs.indices}"
    jobs, given = mine.plan.jobs, theirs.plan.jobs
    if len(jobs) != len(given):
        return f"number of matrices planned {len(jobs)}, given {len(given)}"
    for j, (a, b) in enumerate(zip(jobs, given, strict=True)):
        found = _job_difference(mine, j, a, b)
        if found is not None:
            return found
    if mine.plan.buckets != theirs.plan.buckets:
        planned, given_buckets = mine.plan.buckets, theirs.plan.buckets
        return f"batches (buckets of matrices) planned {planned}, given {given_buckets}"
    if mine.plan.ranks != theirs.plan.ranks:
        return f"ranks holding matrices planned {mine.plan.ranks}, given {theirs.plan.ranks}"
    return None if mine == theirs else "the plans differ"


def muon_plan_difference(planned: MuonStepPlan, given: MuonStepPlan) -> str | None:
    """A sentence naming the first difference of two step plans (group ranks first), or None
    when they are equal."""
    mine = [g.ranks for g in planned.groups]
    theirs = [g.ranks for g in given.groups]
    if mine != theirs:
        return f"rank groups planned {mine}, given {theirs}"
    for a, b in zip(planned.groups, given.groups, strict=True):
        found = _group_difference(a, b)
        if found is not None:
            return f"group of ranks {a.ranks}: {found}"
    return None


def check_muon_plan(planned: MuonStepPlan, given: object) -> None:
    """Raises TypeError (``given`` is not a MuonStepPlan) or ValueError (it differs from
    ``planned``, naming the group ranks, the first difference and both values)."""
    if not isinstance(given, MuonStepPlan):
        raise TypeError(
            f"Muon(plan=...) takes a hp_muon.MuonStepPlan (hp_muon.plan_muon), got "
            f"{type(given).__name__}"
        )
    found = muon_plan_difference(planned, given)
    if found is not None:
        raise ValueError(f"Muon: the given plan differs from what this step plans: {found}")

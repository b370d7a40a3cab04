"""Run ``hp_layout`` redistribution plans on this rank's torch tensor, differentiably.

Planning is ``hp_layout.plan_redistribute`` (pure, cached); this module checks the local
shape and runs the plan compiled by :mod:`hp_dtensor._moves`, whose steps are the
autograd-aware collectives of :mod:`hp_dtensor.collectives`, so the backward of a
redistribution is the true adjoint of its forward.
"""

from __future__ import annotations

import torch

from hp_dtensor._moves import compile_plan
from hp_dtensor.device_mesh import DeviceMesh
from hp_layout import (
    Layout,
    Partial,
    RedistributePlan,
    Replicate,
    Topology,
    plan_redistribute,
)

__all__ = ["execute_plan", "plan_for", "redistribute_local"]


def execute_plan(x: torch.Tensor, plan: RedistributePlan, mesh: DeviceMesh) -> torch.Tensor:
    """Run ``plan`` on this rank's local tensor ``x`` (its shard under ``plan.src``).

    Differentiable; every rank of the mesh must call it with the same plan.
    """
    if plan.src.mesh != mesh.mesh:
        raise ValueError(f"plan is for {plan.src.mesh!r}, not for {mesh!r}")
    rank = mesh.get_rank()
    expected = plan.src.local_shape(rank)
    if tuple(x.shape) != expected:
        raise ValueError(
            f"rank {rank} holds a local tensor of shape {tuple(x.shape)}, but {plan.src!r} "
            f"gives it {expected}"
        )
    return compile_plan(plan, mesh)(x)


def _repartition_midpoint(src: Layout, dst: Layout) -> Layout | None:
    """``dst`` with Replicate wherever it asks for a Partial that ``src`` cannot produce
    directly (``src`` is sharded there, or partial in another op); None if there is none."""
    placements = list(dst.placements)
    changed = False
    for axis, (p, q) in enumerate(zip(src.placements, dst.placements, strict=True)):
        if isinstance(q, Partial) and not (isinstance(p, Replicate) or p == q):
            placements[axis] = Replicate()
            changed = True
    if not changed:
        return None
    return dst.with_placements(placements, dst.shard_order)


def plan_for(src: Layout, dst: Layout, topology: Topology | None = None) -> RedistributePlan:
    """The plan from ``src`` to ``dst``, allowing a Partial destination from sharded data.

    ``hp_layout`` refuses a Partial destination from sharded (or differently partial) data,
    because for a user that is usually a mistake. Sharding rules do want it (a sharded bias
    added to a row-parallel partial product must itself become partial): such axes are first
    made Replicate, then partitioned; the two plans are joined into one.
    """
    midpoint = _repartition_midpoint(src, dst)
    if midpoint is None:
        return plan_redistribute(src, dst, topology)
    first = plan_redistribute(src, midpoint, topology)
    second = plan_redistribute(midpoint, dst, topology)
    return RedistributePlan(src, dst, first.steps + second.steps)


def redistribute_local(
    x: torch.Tensor,
    src: Layout,
    dst: Layout,
    mesh: DeviceMesh,
    topology: Topology | None = None,
    *,
    repartition: bool = False,
) -> torch.Tensor:
    """Turn this rank's shard ``x`` under ``src`` into its shard under ``dst`` (differentiable).

    With ``repartition=True`` a Partial destination may come from sharded data (see
    :func:`plan_for`); otherwise ``hp_layout``'s rules apply unchanged.
    """
    if src == dst:
        return x
    plan = plan_for(src, dst, topology) if repartition else plan_redistribute(src, dst, topology)
    return execute_plan(x, plan, mesh)

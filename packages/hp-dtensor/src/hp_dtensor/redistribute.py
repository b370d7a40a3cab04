"""Run ``hp_layout`` redistribution plans on this rank's torch tensor, differentiably.

Planning is ``hp_layout.plan_redistribute`` (pure, cached); this module only executes the
steps with the autograd-aware collectives of :mod:`hp_dtensor.collectives`, so the backward
of a redistribution is the true adjoint of its forward.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from hp_dtensor import collectives
from hp_dtensor.collectives import _apply
from hp_dtensor.device_mesh import DeviceMesh
from hp_layout import (
    Layout,
    Partial,
    RaggedShard,
    RedistributePlan,
    ReduceOp,
    Replicate,
    Shard,
    Step,
    StepKind,
    Topology,
    plan_redistribute,
)

__all__ = ["execute_plan", "plan_for", "redistribute_local"]


class _KeepOnFirst(torch.autograd.Function):
    """Replicate -> Partial(sum): coordinate 0 keeps the value, the others hold zeros."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: bool) -> torch.Tensor:
        ctx.keep = keep
        return x.clone() if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return (grad if ctx.keep else torch.zeros_like(grad)), None


@lru_cache(maxsize=65536)
def _piece_extents(layout: Layout, group: tuple[int, ...], dim: int | None) -> tuple[int, ...]:
    """Each group member's local extent along ``dim`` (numel when ``dim`` is None)."""
    if dim is None:
        return tuple(layout.local_numel(r) for r in group)
    return tuple(layout.local_shape(r)[dim] for r in group)


def _local_slice(x: torch.Tensor, step: Step, rank: int) -> torch.Tensor:
    before = step.before.local_region(rank)
    after = step.after.local_region(rank)
    out = x
    for d, ((a, b), (base, _)) in enumerate(zip(after.box, before.box, strict=True)):
        if (a - base, b - base) != (0, out.shape[d]):
            out = out.narrow(d, a - base, b - a)
    if after.flat is not None:
        out = out.reshape(-1).narrow(0, after.flat[0], after.flat[1] - after.flat[0])
    return out


def _run_step(x: torch.Tensor, step: Step, mesh: DeviceMesh) -> torch.Tensor:
    rank = mesh.get_rank()
    kind = step.kind
    if kind is StepKind.LOCAL_SLICE:
        return _local_slice(x, step, rank)
    if kind is StepKind.LOCAL_PARTITION:
        if step.reduce_op is ReduceOp.SUM:
            keep = mesh.get_local_rank(step.axis) == 0
            out: torch.Tensor = _apply(_KeepOnFirst)(x, keep)
            return out
        return x
    group = mesh.group_ranks(step.axis)
    src, dst = step.src_placement, step.dst_placement
    if kind is StepKind.ALL_GATHER:
        if isinstance(src, RaggedShard):
            flat = collectives.all_gather(
                x.reshape(-1), 0, mesh, step.axis, _piece_extents(step.before, group, None)
            )
            return flat.reshape(step.after.local_shape(rank))
        assert isinstance(src, Shard)
        return collectives.all_gather(
            x, src.dim, mesh, step.axis, _piece_extents(step.before, group, src.dim)
        )
    if kind is StepKind.ALL_REDUCE:
        assert step.reduce_op is not None
        return collectives.all_reduce(x, mesh, step.axis, step.reduce_op)
    if kind is StepKind.REDUCE_SCATTER:
        assert step.reduce_op is not None
        if isinstance(dst, RaggedShard):
            return collectives.reduce_scatter(
                x.reshape(-1), 0, mesh, step.axis, step.reduce_op, dst.local_numels
            )
        assert isinstance(dst, Shard)
        return collectives.reduce_scatter(
            x,
            dst.dim,
            mesh,
            step.axis,
            step.reduce_op,
            _piece_extents(step.after, group, dst.dim),
        )
    assert kind is StepKind.ALL_TO_ALL
    assert isinstance(src, Shard)
    assert isinstance(dst, Shard)
    return collectives.all_to_all(
        x,
        dst.dim,
        src.dim,
        mesh,
        step.axis,
        _piece_extents(step.after, group, dst.dim),
        _piece_extents(step.before, group, src.dim),
    )


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
    for step in plan.steps:
        x = _run_step(x, step, mesh)
    return x


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

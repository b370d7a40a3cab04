"""Layout conversions at module boundaries in production mode, planned once per shape.

A boundary turns this rank's plain local tensor from one placement on the parallel axis into
another. The first time a boundary sees a local shape, the global extent of a sharded dim is
learned (one tiny all-gather over the axis), the ``hp_layout`` plan is built, checked against
the local shape, and compiled into a :class:`Move`: its steps with every size, dim, slice and
reduction decided, so that a call only runs them (autograd functions with true adjoints) -- no
layout arithmetic, no group or rank look-ups beyond the axis group, no plan walking.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor import _comm, collectives
from hp_dtensor._comm import AxisGroup
from hp_dtensor.collectives import _apply
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.redistribute import _KeepOnFirst, _piece_extents
from hp_layout import (
    Layout,
    Placement,
    RaggedShard,
    RedistributePlan,
    ReduceOp,
    Shard,
    Step,
    StepKind,
    plan_redistribute,
)

__all__ = ["BoundaryConverter", "Move"]

Run = Callable[[torch.Tensor], torch.Tensor]
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Move:
    """One planned conversion of local tensors of one shape: its compiled steps.

    Attributes:
        steps: the steps in order, each a function of the local tensor.
        gathered_box: for a conversion that only all-gathers, this rank's region of the
            gathered tensor (its box, per dim ``(start, stop)``): as the model's output, the
            gradient of the source is that slice of the whole gradient. None otherwise.
    """

    steps: tuple[Run, ...]
    gathered_box: Box | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.steps:
            x = step(x)
        return x


class _SumInPlace(torch.autograd.Function):
    """Sum all-reduce of a tensor that nothing else holds, in place (Megatron's ``g``: no
    copy). Backward: the sum all-reduce of the gradient (the adjoint), with the pending
    gradient reductions riding along as in ``collectives.all_reduce``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh, axis: str) -> torch.Tensor:
        group = AxisGroup.of(mesh, axis)
        ctx.group = group
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group.process_group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _comm.all_reduce(grad, ReduceOp.SUM, ctx.group, riders=True), None, None


def _sum_in_place(mesh: DeviceMesh, axis: str) -> Run:
    def run(x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            # The wire needs a dense buffer; the out-of-place sum makes one (same result).
            return collectives.all_reduce(x, mesh, axis, ReduceOp.SUM)
        return _apply(_SumInPlace)(x, mesh, axis)

    return run


def _reduce(mesh: DeviceMesh, axis: str, op: ReduceOp) -> Run:
    return lambda x: collectives.all_reduce(x, mesh, axis, op)


def _narrows(step: Step, rank: int) -> tuple[tuple[int, int, int], ...]:
    """``(dim, start, length)`` narrows that keep this rank's piece (a local slice step)."""
    before, after = step.before.local_region(rank), step.after.local_region(rank)
    shape = step.before.local_shape(rank)
    out = []
    for d, ((a, b), (base, _)) in enumerate(zip(after.box, before.box, strict=True)):
        if (a - base, b - base) != (0, shape[d]):
            out.append((d, a - base, b - a))
    return tuple(out)


def _compile_slice(step: Step, rank: int) -> Run | None:
    narrows = _narrows(step, rank)
    flat = step.after.local_region(rank).flat
    if not narrows and flat is None:
        return None

    def run(x: torch.Tensor) -> torch.Tensor:
        for d, start, length in narrows:
            x = x.narrow(d, start, length)
        if flat is not None:
            x = x.reshape(-1).narrow(0, flat[0], flat[1] - flat[0])
        return x

    return run


def _compile_step(step: Step, mesh: DeviceMesh, owned: bool) -> Run | None:
    """One step as a function of the local tensor, everything about it decided now (None: it
    leaves the tensor as it is). ``owned``: the tensor it gets is held by nothing else."""
    rank = mesh.get_rank()
    kind = step.kind
    if kind is StepKind.LOCAL_SLICE:
        return _compile_slice(step, rank)
    if kind is StepKind.LOCAL_PARTITION:
        if step.reduce_op is not ReduceOp.SUM:
            return None
        keep = mesh.get_local_rank(step.axis) == 0
        return lambda x: _apply(_KeepOnFirst)(x, keep)
    group = mesh.group_ranks(step.axis)
    src, dst, axis = step.src_placement, step.dst_placement, step.axis
    ndim = len(step.before.global_shape)
    if kind is StepKind.ALL_GATHER:
        if isinstance(src, RaggedShard):
            numels = _piece_extents(step.before, group, None)
            after = step.after.local_shape(rank)
            return lambda x: collectives.all_gather(x.reshape(-1), 0, mesh, axis, numels).reshape(
                after
            )
        assert isinstance(src, Shard)
        dim = src.dim % ndim
        sizes = _piece_extents(step.before, group, dim)
        return lambda x: collectives.all_gather(x, dim, mesh, axis, sizes)
    op = step.reduce_op
    if kind is StepKind.ALL_REDUCE:
        assert op is not None
        if owned and op is ReduceOp.SUM:
            return _sum_in_place(mesh, axis)
        return _reduce(mesh, axis, op)
    if kind is StepKind.REDUCE_SCATTER:
        assert op is not None
        if isinstance(dst, RaggedShard):
            numels = dst.local_numels
            return lambda x: collectives.reduce_scatter(x.reshape(-1), 0, mesh, axis, op, numels)
        assert isinstance(dst, Shard)
        dim = dst.dim % ndim
        sizes = _piece_extents(step.after, group, dim)
        return lambda x: collectives.reduce_scatter(x, dim, mesh, axis, op, sizes)
    assert kind is StepKind.ALL_TO_ALL
    assert isinstance(src, Shard)
    assert isinstance(dst, Shard)
    split, concat = dst.dim % ndim, src.dim % ndim
    split_sizes = _piece_extents(step.after, group, split)
    concat_sizes = _piece_extents(step.before, group, concat)
    return lambda x: collectives.all_to_all(x, split, concat, mesh, axis, split_sizes, concat_sizes)


def compile_plan(plan: RedistributePlan, mesh: DeviceMesh, *, owned: bool = False) -> Move:
    """``plan`` compiled for this rank of ``mesh`` (see :class:`Move`).

    ``owned``: the tensors the move gets are held by nothing else (a module's fresh result),
    so a first sum all-reduce may run in place.
    """
    steps: list[Run] = []
    for i, step in enumerate(plan.steps):
        run = _compile_step(step, mesh, owned and i == 0)
        if run is not None:
            steps.append(run)
    gathers = bool(plan.steps) and all(s.kind is StepKind.ALL_GATHER for s in plan.steps)
    box = plan.src.local_region(mesh.get_rank()).box if gathers else None
    return Move(tuple(steps), box)


class BoundaryConverter:
    """Converts plain local tensors between placements on a 1-d (parallel-axis) mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        if mesh.ndim != 1:
            raise ValueError(f"a boundary converter works on a 1-d mesh, got {mesh!r}")
        self.mesh = mesh
        self._plans: dict[Any, RedistributePlan | None] = {}
        self._layouts: dict[Any, Layout] = {}

    def global_shape(self, local: torch.Tensor, placement: Placement) -> tuple[int, ...]:
        """The global shape of ``local`` laid out as ``placement`` (collective if sharded)."""
        shape = list(local.shape)
        if isinstance(placement, Shard):
            dim = placement.dim % max(local.dim(), 1)
            group = _comm.AxisGroup.of(self.mesh, 0)
            extent = torch.tensor([shape[dim]], dtype=torch.int64, device=local.device)
            extents = _comm.all_gather_dim(extent, 0, [1] * group.size, group)
            shape[dim] = int(extents.sum())
        return tuple(shape)

    def layout(self, local: torch.Tensor, placement: Placement) -> Layout:
        """The layout of ``local`` laid out as ``placement``, learned once per local shape
        (the first time collectively, as :meth:`global_shape`)."""
        key = (placement, local.shape)
        found = self._layouts.get(key)
        if found is None:
            found = Layout(self.global_shape(local, placement), self.mesh.mesh, [placement])
            self._layouts[key] = found
        return found

    def plan(self, local: torch.Tensor, src: Placement, dst: Placement) -> RedistributePlan | None:
        """The cached plan for ``local`` from ``src`` to ``dst`` (None when nothing moves)."""
        key = (src, dst, tuple(local.shape))
        if key not in self._plans:
            shape = self.global_shape(local, src)
            source = Layout(shape, self.mesh.mesh, [src])
            target = Layout(shape, self.mesh.mesh, [dst])
            self._plans[key] = None if source == target else plan_redistribute(source, target)
        return self._plans[key]

    def move(
        self, local: torch.Tensor, src: Placement, dst: Placement, *, owned: bool = False
    ) -> Move | None:
        """The compiled conversion of tensors shaped like ``local`` from ``src`` to ``dst``
        (None when nothing moves); the caller keeps it for that shape.

        Raises:
            ValueError: ``local`` is not this rank's piece of the layout its ranks' extents
                give (they are not split as ``torch.chunk`` splits).
        """
        plan = self.plan(local, src, dst)
        if plan is None:
            return None
        rank = self.mesh.get_rank()
        expected = plan.src.local_shape(rank)
        if tuple(local.shape) != expected:
            raise ValueError(
                f"rank {rank} holds a local tensor of shape {tuple(local.shape)}, but "
                f"{plan.src!r} gives it {expected}"
            )
        return compile_plan(plan, self.mesh, owned=owned)

    def convert(self, local: torch.Tensor, src: Placement, dst: Placement) -> torch.Tensor:
        """``local`` under ``src`` turned into its shard under ``dst`` (differentiable)."""
        move = self.move(local, src, dst)
        return local if move is None else move(local)

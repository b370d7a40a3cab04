"""A redistribution plan compiled for one rank: its steps as ready-to-run functions.

Compiling decides, once per plan, everything a step needs on this rank -- sizes, dims,
slices, the reduction and whether a sum may run in place -- so that running it is a short
sequence of autograd-aware collectives (true adjoints) with no layout arithmetic and no plan
walking. ``redistribute.execute_plan`` compiles and runs in one go; production-mode boundaries
keep the compiled :class:`Move` per local shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import _CachingTorchDispatchMode

import hp_dtensor._comm as _comm
import hp_dtensor.collectives as collectives
from hp_dtensor._comm import AxisGroup
from hp_dtensor.collectives import _apply
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.watchdog import watch
from hp_layout import (
    Layout,
    RaggedShard,
    RedistributePlan,
    ReduceOp,
    Shard,
    Step,
    StepKind,
)

__all__ = ["Move", "compile_plan"]


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
        with watch("all_reduce (tensor-parallel sum, in place)", group.process_group):
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group.process_group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _comm.all_reduce(grad, ReduceOp.SUM, ctx.group, riders=True), None, None


def _outputs_held_by_a_dispatch_mode() -> bool:
    """Whether an active dispatch mode may hold op outputs by reference: torch's selective
    checkpointing caches them to return in recompute, and so does any mode that sets a true
    ``holds_op_outputs`` attribute (hp-offload's). A collective's in-place write is invisible
    to such a cache: it would hold the sum, and recompute would sum it again."""
    return any(
        getattr(mode, "holds_op_outputs", False) or isinstance(mode, _CachingTorchDispatchMode)
        for mode in _get_current_dispatch_mode_stack()
    )


def _sum_in_place(mesh: DeviceMesh, axis: str) -> Run:
    def run(x: torch.Tensor) -> torch.Tensor:
        if (
            not x.is_contiguous()
            or _outputs_held_by_a_dispatch_mode()
            or _comm.counted_by_comm_debug_mode()
        ):
            # The wire needs a dense buffer, or ``x`` may be held elsewhere, or torch's
            # CommDebugMode counts only functional collectives: the out-of-place sum (same
            # result).
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

"""Autograd-aware collectives along one mesh axis.

Each rank's tensor is its own variable, and each backward is the true adjoint of its forward
over the group: all-gather <-> reduce-scatter(sum), all-reduce(sum) <-> all-reduce(sum),
all-to-all <-> the reverse all-to-all, broadcast <-> sum onto the source. AVG divides by the
group size; MAX and MIN send the gradient to the ranks holding the extreme value, split
evenly between ties (as ``torch.amax`` does). Uneven pieces are supported everywhere; pass
``sizes`` (the pieces' extents in coordinate order) when they are not the ``torch.chunk``
split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

import hp_dtensor._comm as _comm
from hp_dtensor._comm import AxisGroup
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.watchdog import watch
from hp_layout import ReduceOp, chunk_sizes

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_rows",
    "broadcast",
    "reduce_scatter",
    "ring_shift",
]


def _apply(function: type[torch.autograd.Function]) -> Callable[..., torch.Tensor]:
    """``function.apply`` with its result typed (torch leaves ``apply`` untyped)."""
    return cast(Callable[..., torch.Tensor], function.apply)


def _op(op: ReduceOp | str) -> ReduceOp:
    return op if isinstance(op, ReduceOp) else ReduceOp(op)


def _extreme_grad(
    grad_sum: torch.Tensor, mine: torch.Tensor, result: torch.Tensor, group: AxisGroup
) -> torch.Tensor:
    """Gradient of a MAX/MIN reduction for this rank: shared evenly by the ranks that tie."""
    hit = (mine == result).to(grad_sum.dtype)
    count = _comm.all_reduce(hit, ReduceOp.SUM, group)
    return grad_sum * hit / count.clamp_min(1)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, sizes: tuple[int, ...], group: AxisGroup
    ) -> torch.Tensor:
        ctx.dim, ctx.sizes, ctx.group = dim, sizes, group
        return _comm.all_gather_dim(x, dim, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (
            _comm.reduce_scatter_dim(grad, ctx.dim, ctx.sizes, ReduceOp.SUM, ctx.group),
            None,
            None,
            None,
        )


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        dim: int,
        sizes: tuple[int, ...],
        op: ReduceOp,
        group: AxisGroup,
    ) -> torch.Tensor:
        ctx.dim, ctx.sizes, ctx.op, ctx.group = dim, sizes, op, group
        out = _comm.reduce_scatter_dim(x, dim, sizes, op, group)
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full = _comm.all_gather_dim(grad.contiguous(), ctx.dim, ctx.sizes, ctx.group)
        if ctx.op is ReduceOp.AVG:
            full = full / ctx.group.size
        elif ctx.op in (ReduceOp.MAX, ReduceOp.MIN):
            x, out = ctx.saved_tensors
            result = _comm.all_gather_dim(out, ctx.dim, ctx.sizes, ctx.group)
            full = _extreme_grad(full, x, result, ctx.group)
        return full, None, None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: ReduceOp, group: AxisGroup) -> torch.Tensor:
        ctx.op, ctx.group = op, group
        out = _comm.all_reduce(x, op, group)
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Pending gradient reductions over this group ride along (see _comm.RIDER_SOURCES).
        total = _comm.all_reduce(grad, ReduceOp.SUM, ctx.group, riders=True)
        if ctx.op is ReduceOp.AVG:
            total = total / ctx.group.size
        elif ctx.op in (ReduceOp.MAX, ReduceOp.MIN):
            x, out = ctx.saved_tensors
            total = _extreme_grad(total, x, out, ctx.group)
        return total, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        split_dim: int,
        concat_dim: int,
        split_sizes: tuple[int, ...],
        concat_sizes: tuple[int, ...],
        group: AxisGroup,
    ) -> torch.Tensor:
        ctx.args = (split_dim, concat_dim, split_sizes, concat_sizes, group)
        return _comm.all_to_all_dims(x, split_dim, concat_dim, split_sizes, concat_sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        split_dim, concat_dim, split_sizes, concat_sizes, group = ctx.args
        back = _comm.all_to_all_dims(
            grad.contiguous(), concat_dim, split_dim, concat_sizes, split_sizes, group
        )
        return back, None, None, None, None, None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send_sizes: tuple[int, ...],
        recv_sizes: tuple[int, ...],
        group: AxisGroup,
    ) -> torch.Tensor:
        ctx.args = (send_sizes, recv_sizes, group)
        return _comm.all_to_all_rows(x, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        send_sizes, recv_sizes, group = ctx.args
        return _comm.all_to_all_rows(grad, recv_sizes, send_sizes, group), None, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, src_index: int, group: AxisGroup) -> torch.Tensor:
        ctx.src_index, ctx.group = src_index, group
        return _comm.broadcast(x, src_index, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = _comm.all_reduce(grad, ReduceOp.SUM, ctx.group)
        if ctx.group.index != ctx.src_index:
            total = torch.zeros_like(total)
        return total, None, None


def _sizes(length: int | None, sizes: Sequence[int] | None, group: AxisGroup) -> tuple[int, ...]:
    if sizes is not None:
        if len(sizes) != group.size:
            raise ValueError(f"sizes {list(sizes)} must have one entry per rank ({group.size})")
        return tuple(sizes)
    assert length is not None
    return chunk_sizes(length, group.size)


def all_gather(
    x: torch.Tensor,
    dim: int,
    mesh: DeviceMesh,
    axis: str | int,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Concatenate the group's ``x`` along ``dim`` (coordinate order); backward reduce-scatters.

    ``sizes`` are the pieces' extents along ``dim``; by default every piece is as long as
    this rank's.
    """
    group = AxisGroup.of(mesh, axis)
    dim = dim % x.dim()
    pieces = tuple(sizes) if sizes is not None else (x.shape[dim],) * group.size
    _sizes(None, pieces, group)
    out: torch.Tensor = _apply(_AllGather)(x, dim, pieces, group)
    return out


def reduce_scatter(
    x: torch.Tensor,
    dim: int,
    mesh: DeviceMesh,
    axis: str | int,
    op: ReduceOp | str = ReduceOp.SUM,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Reduce ``x`` over the group, keep this rank's piece of ``dim``; backward all-gathers.

    ``sizes`` split ``x.shape[dim]`` into per-coordinate pieces (default: ``torch.chunk``).
    """
    group = AxisGroup.of(mesh, axis)
    dim = dim % x.dim()
    out: torch.Tensor = _apply(_ReduceScatter)(
        x, dim, _sizes(x.shape[dim], sizes, group), _op(op), group
    )
    return out


def all_reduce(
    x: torch.Tensor, mesh: DeviceMesh, axis: str | int, op: ReduceOp | str = ReduceOp.SUM
) -> torch.Tensor:
    """Reduce ``x`` over the group (out of place); backward all-reduces the gradient."""
    out: torch.Tensor = _apply(_AllReduce)(x, _op(op), AxisGroup.of(mesh, axis))
    return out


def all_to_all(
    x: torch.Tensor,
    split_dim: int,
    concat_dim: int,
    mesh: DeviceMesh,
    axis: str | int,
    split_sizes: Sequence[int] | None = None,
    concat_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Send piece ``j`` of ``split_dim`` to coordinate ``j``, concatenate received pieces along
    ``concat_dim``; backward is the reverse all-to-all.

    ``split_sizes`` default to the ``torch.chunk`` split of this rank's extent;
    ``concat_sizes`` (every rank's extent along ``concat_dim``) default to this rank's.
    """
    group = AxisGroup.of(mesh, axis)
    split_dim, concat_dim = split_dim % x.dim(), concat_dim % x.dim()
    splits = _sizes(x.shape[split_dim], split_sizes, group)
    concats = (
        tuple(concat_sizes) if concat_sizes is not None else (x.shape[concat_dim],) * group.size
    )
    _sizes(None, concats, group)
    out: torch.Tensor = _apply(_AllToAll)(x, split_dim, concat_dim, splits, concats, group)
    return out


def all_to_all_rows(
    x: torch.Tensor,
    mesh: DeviceMesh,
    axis: str | int,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
) -> torch.Tensor:
    """Ragged all-to-all of rows (dim 0): the next ``send_sizes[j]`` rows of ``x`` go to
    coordinate ``j``; the result is the rows received, in coordinate order
    (``sum(recv_sizes)`` rows, ``recv_sizes[i]`` from coordinate ``i``; any size may be 0).
    Backward is the reverse exchange (its adjoint)."""
    group = AxisGroup.of(mesh, axis)
    _sizes(None, send_sizes, group)
    _sizes(None, recv_sizes, group)
    out: torch.Tensor = _apply(_AllToAllRows)(x, tuple(send_sizes), tuple(recv_sizes), group)
    return out


def broadcast(x: torch.Tensor, mesh: DeviceMesh, axis: str | int, src: int = 0) -> torch.Tensor:
    """Every rank of the group gets coordinate ``src``'s ``x``; backward sums onto ``src``."""
    group = AxisGroup.of(mesh, axis)
    if not 0 <= src < group.size:
        raise ValueError(f"src coordinate {src} is outside the axis of size {group.size}")
    out: torch.Tensor = _apply(_Broadcast)(x, src, group)
    return out


def _ring_shift_raw(x: torch.Tensor, shift: int, group: AxisGroup) -> torch.Tensor:
    """Send ``x`` to coordinate ``index + shift`` and receive from ``index - shift`` (mod size)."""
    if shift % group.size == 0:
        return x.clone()
    pg = group.process_group
    dst = dist.get_global_rank(pg, (group.index + shift) % group.size)
    src = dist.get_global_rank(pg, (group.index - shift) % group.size)
    send = x.contiguous()
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, dst, pg), dist.P2POp(dist.irecv, recv, src, pg)]
    with watch("ring_shift (send/recv)", pg):
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return recv


class _RingShift(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shift: int, group: AxisGroup) -> torch.Tensor:
        ctx.shift, ctx.group = shift, group
        return _ring_shift_raw(x, shift, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _ring_shift_raw(grad, -ctx.shift, ctx.group), None, None


def ring_shift(x: torch.Tensor, mesh: DeviceMesh, axis: str | int, shift: int = 1) -> torch.Tensor:
    """Rotate ``x`` around the axis: coordinate ``i`` gets coordinate ``i - shift``'s ``x``
    (mod the axis size; every rank's ``x`` must have the same shape and dtype); backward is the
    reverse rotation. Point-to-point: each rank sends and receives one tensor."""
    out: torch.Tensor = _apply(_RingShift)(x, shift, AxisGroup.of(mesh, axis))
    return out

"""Raw collectives over one mesh axis, uneven sizes included (no autograd).

Every function takes and returns plain tensors and orders pieces by coordinate along the
axis. Uneven pieces are padded to the largest for the wire and trimmed after; sizes are
passed in (the caller's layout knows them), so no size exchange happens.

While torch's ``CommDebugMode`` (``torch.distributed.tensor.debug``) watches, the all-reduce,
all-gather, reduce-scatter and all-to-all here run as torch's functional collectives
(``_c10d_functional``, the ops torch's own DTensor and tensor parallelism issue), so that the
mode counts them under the keys torch's tests read (``c10d_functional.all_reduce``, ...), one
per collective; otherwise they run as c10d's in-place ops. Same wire, same results; telling the
two apart costs one C call per collective (the length of the dispatch-mode stack).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.watchdog import watch
from hp_layout import ReduceOp

__all__ = [
    "AxisGroup",
    "all_gather_dim",
    "all_reduce",
    "all_to_all_dims",
    "all_to_all_rows",
    "broadcast",
    "counted_by_comm_debug_mode",
    "reduce_scatter_dim",
]


@dataclass(frozen=True)
class AxisGroup:
    """This rank's group along one mesh axis.

    Attributes:
        process_group: the group; its rank ``i`` is coordinate ``i`` along the axis.
        size: number of ranks along the axis.
        index: this rank's coordinate along the axis.
    """

    process_group: dist.ProcessGroup
    size: int
    index: int

    @classmethod
    def of(cls, mesh: DeviceMesh, axis: str | int) -> AxisGroup:
        """The group of the calling rank along ``axis`` of ``mesh`` (cached on the mesh)."""
        group: AxisGroup = mesh.axis_group(axis, cls)
        return group


_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


def _wire_op(op: ReduceOp) -> dist.ReduceOp.RedOpType:
    # AVG is not available on every backend (gloo); it is a SUM followed by a division.
    return _TORCH_OPS[ReduceOp.SUM if op is ReduceOp.AVG else op]


_FUNCTIONAL_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}
_COMM_MODE_MODULE = "torch.distributed.tensor.debug._comm_mode"


def counted_by_comm_debug_mode() -> bool:
    """Whether torch's CommDebugMode is active: collectives then run as functional ones (an
    in-place collective elsewhere should take its out-of-place path while this holds)."""
    if not torch._C._len_torch_dispatch_stack():
        return False
    module = sys.modules.get(_COMM_MODE_MODULE)
    return module is not None and any(
        isinstance(mode, module.CommDebugMode) for mode in _get_current_dispatch_mode_stack()
    )


def _wait(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops._c10d_functional.wait_tensor(x)
    return out


def _group_name(group: AxisGroup) -> str:
    return str(group.process_group.group_name)


def _functional_all_reduce(x: torch.Tensor, op: ReduceOp, group: AxisGroup) -> torch.Tensor:
    name = _FUNCTIONAL_OPS[ReduceOp.SUM if op is ReduceOp.AVG else op]
    return _wait(torch.ops._c10d_functional.all_reduce(x.contiguous(), name, _group_name(group)))


def _functional_all_gather(send: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Pieces stacked along dim 0 (``[size * n, ...]``), as ``all_gather_single`` fills."""
    return _wait(
        torch.ops._c10d_functional.all_gather_into_tensor(send, group.size, _group_name(group))
    )


def _pad_dim(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    if x.shape[dim] == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def all_gather_dim(
    x: torch.Tensor, dim: int, sizes: Sequence[int], group: AxisGroup
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in coordinate order.

    ``sizes[i]`` is the extent of coordinate ``i``'s piece along ``dim``.
    """
    if group.size == 1:
        return x
    if x.shape[dim] != sizes[group.index]:
        raise ValueError(
            f"all_gather_dim: local extent {x.shape[dim]} along dim {dim} differs from "
            f"sizes[{group.index}] = {sizes[group.index]}"
        )
    longest = max(sizes)
    if all(n == longest for n in sizes):
        # Equal pieces travel as they are, stacked ([p, *shape]), and one reshape puts the
        # stack axis in place: one copy, none when ``dim`` is 0 (a transposed send buffer
        # would cost a second).
        send = x.contiguous()
        if counted_by_comm_debug_mode():
            blocks = _functional_all_gather(send, group).view(group.size, *send.shape)
        else:
            blocks = send.new_empty((group.size, *send.shape))
            flat = blocks.view(group.size * send.shape[0], *send.shape[1:])
            with watch("all_gather", group.process_group):
                dist.all_gather_single(flat, send, group=group.process_group)
        shape = list(x.shape)
        shape[dim] = group.size * longest
        return blocks.movedim(0, dim).reshape(shape)
    send = _pad_dim(x, dim, longest).movedim(dim, 0).contiguous()
    if counted_by_comm_debug_mode():
        out = _functional_all_gather(send, group)
    else:
        out = send.new_empty((group.size * longest, *send.shape[1:]))
        with watch("all_gather", group.process_group):
            dist.all_gather_single(out, send, group=group.process_group)
    pieces = [out.narrow(0, i * longest, n) for i, n in enumerate(sizes)]
    return torch.cat(pieces, dim=0).movedim(0, dim).contiguous()


def reduce_scatter_dim(
    x: torch.Tensor, dim: int, sizes: Sequence[int], op: ReduceOp, group: AxisGroup
) -> torch.Tensor:
    """Reduce ``x`` over the group and keep this rank's piece along ``dim``.

    ``sizes`` splits ``x.shape[dim]`` into the pieces of coordinates ``0 .. size - 1``.
    """
    if sum(sizes) != x.shape[dim]:
        raise ValueError(
            f"reduce_scatter_dim: sizes {list(sizes)} do not split extent {x.shape[dim]}"
        )
    if group.size == 1:
        return x.clone()
    longest = max(sizes)
    pieces = [_pad_dim(p, dim, longest).movedim(dim, 0) for p in x.split(list(sizes), dim)]
    send = torch.cat(pieces, dim=0).contiguous()
    if counted_by_comm_debug_mode():
        name = _FUNCTIONAL_OPS[ReduceOp.SUM if op is ReduceOp.AVG else op]
        out = _wait(
            torch.ops._c10d_functional.reduce_scatter_tensor(
                send, name, group.size, _group_name(group)
            )
        )
    else:
        out = send.new_empty((longest, *send.shape[1:]))
        with watch("reduce_scatter", group.process_group):
            dist.reduce_scatter_single(out, send, op=_wire_op(op), group=group.process_group)
    if op is ReduceOp.AVG:
        out = out / group.size
    return out.narrow(0, 0, sizes[group.index]).movedim(0, dim)


Rider = tuple[torch.Tensor, Callable[[torch.Tensor], None]]
RIDER_SOURCES: list[Callable[[AxisGroup, torch.dtype], list[Rider]]] = []
"""Sources of tensors waiting to be summed over a group (e.g. parameter gradients). A sum
all-reduce asked to carry riders takes theirs along in the same collective and hands each its
reduced value: one collective instead of several."""


def all_reduce(
    x: torch.Tensor, op: ReduceOp, group: AxisGroup, *, riders: bool = False
) -> torch.Tensor:
    """Reduce ``x`` over the group; every rank gets the result (``x`` is not modified).

    With ``riders`` (SUM only), pending rider tensors for this group join the collective.
    """
    if group.size == 1:
        return x.clone()
    extra: list[Rider] = []
    if riders and op is ReduceOp.SUM:
        extra = [r for source in RIDER_SOURCES for r in source(group, x.dtype)]
    if not extra:
        if counted_by_comm_debug_mode():
            out = _functional_all_reduce(x, op, group)
        else:
            out = x.clone()
            with watch("all_reduce", group.process_group):
                dist.all_reduce(out, op=_wire_op(op), group=group.process_group)
        if op is ReduceOp.AVG:
            out = out / group.size
        return out
    flat = torch.cat([x.reshape(-1), *(t.reshape(-1) for t, _ in extra)])
    if counted_by_comm_debug_mode():
        flat = _functional_all_reduce(flat, op, group)
    else:
        with watch("all_reduce", group.process_group):
            dist.all_reduce(flat, op=_wire_op(op), group=group.process_group)
    offset = x.numel()
    for tensor, deliver in extra:
        deliver(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return flat[: x.numel()].view_as(x)


def all_to_all_dims(
    x: torch.Tensor,
    split_dim: int,
    concat_dim: int,
    split_sizes: Sequence[int],
    concat_sizes: Sequence[int],
    group: AxisGroup,
) -> torch.Tensor:
    """Send piece ``j`` of ``x`` along ``split_dim`` to coordinate ``j``; concatenate the
    received pieces along ``concat_dim`` in coordinate order.

    ``split_sizes`` splits this rank's ``x`` along ``split_dim``; ``concat_sizes[i]`` is the
    extent along ``concat_dim`` of the piece coordinate ``i`` sends (its local extent).
    """
    if split_dim == concat_dim:
        raise ValueError("all_to_all_dims needs two different dims")
    if sum(split_sizes) != x.shape[split_dim] or x.shape[concat_dim] != concat_sizes[group.index]:
        raise ValueError(
            f"all_to_all_dims: x of shape {tuple(x.shape)} does not match split sizes "
            f"{list(split_sizes)} on dim {split_dim} / extent {concat_sizes[group.index]} on "
            f"dim {concat_dim}"
        )
    if group.size == 1:
        return x.clone()
    send_pieces = [p.contiguous().reshape(-1) for p in x.split(list(split_sizes), split_dim)]
    send = torch.cat(send_pieces)
    recv_shapes = []
    for n in concat_sizes:
        shape = list(x.shape)
        shape[split_dim] = split_sizes[group.index]
        shape[concat_dim] = n
        recv_shapes.append(shape)
    recv_numels = [int(torch.Size(s).numel()) for s in recv_shapes]
    recv = _all_to_all(
        send, recv_numels, [p.numel() for p in send_pieces], group, "all_to_all", x.new_empty
    )
    pieces = [
        chunk.reshape(shape)
        for chunk, shape in zip(recv.split(recv_numels), recv_shapes, strict=True)
    ]
    return torch.cat(pieces, dim=concat_dim)


def all_to_all_rows(
    x: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int], group: AxisGroup
) -> torch.Tensor:
    """Send rows ``x[sum(send_sizes[:j]) : sum(send_sizes[:j + 1])]`` (dim 0) to coordinate
    ``j``; return the rows received, concatenated in coordinate order.

    ``recv_sizes[i]`` is the number of rows coordinate ``i`` sends here (any may be 0). The
    result has ``sum(recv_sizes)`` rows and ``x``'s trailing shape.
    """
    if len(send_sizes) != group.size or len(recv_sizes) != group.size:
        raise ValueError(
            f"all_to_all_rows: {len(send_sizes)} send and {len(recv_sizes)} receive sizes for a "
            f"group of {group.size}; give one per rank"
        )
    if sum(send_sizes) != x.shape[0]:
        raise ValueError(
            f"all_to_all_rows: send sizes {list(send_sizes)} do not add up to the "
            f"{x.shape[0]} rows of x"
        )
    row = int(torch.Size(x.shape[1:]).numel())
    if group.size == 1:
        out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        out.copy_(x)
        return out
    flat = _all_to_all(
        x.contiguous().reshape(-1),
        [n * row for n in recv_sizes],
        [n * row for n in send_sizes],
        group,
        "all_to_all_rows",
        x.new_empty,
    )
    return flat.view(sum(recv_sizes), *x.shape[1:])


def _all_to_all(
    send: torch.Tensor,
    recv_numels: list[int],
    send_numels: list[int],
    group: AxisGroup,
    what: str,
    new_empty: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """All-to-all of 1-d ``send`` split by ``send_numels``; the received pieces, joined."""
    if counted_by_comm_debug_mode():
        return _wait(
            torch.ops._c10d_functional.all_to_all_single(
                send, recv_numels, send_numels, _group_name(group)
            )
        )
    recv = new_empty(sum(recv_numels))
    with watch(what, group.process_group):
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=recv_numels,
            input_split_sizes=send_numels,
            group=group.process_group,
        )
    return recv


def broadcast(x: torch.Tensor, src_index: int, group: AxisGroup) -> torch.Tensor:
    """Every rank gets coordinate ``src_index``'s ``x`` (same shape on every rank)."""
    out = x.clone().contiguous()
    if group.size == 1:
        return out
    src = dist.get_global_rank(group.process_group, src_index)
    with watch("broadcast", group.process_group):
        dist.broadcast(out, src=src, group=group.process_group)
    return out

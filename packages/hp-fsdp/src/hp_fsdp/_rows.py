"""Executing a group's per-parameter layout (``param_layout="per_param"``, FSDP2's layout).

Each rank's chunk holds, for every parameter, its rows (dim 0 cut as ``torch.chunk`` cuts it)
at the parameter's slot (:class:`~hp_fsdp.group_plan.RowShardLayout`). The sharded parameters
are torch DTensors (``Shard(0)`` on the shard axis, ``Replicate`` on the replicate axis) whose
local tensors are views of the chunk, so user code sees global shapes, ``placements`` and
``full_tensor()``. The all-gather of the chunks is rank-major: the unsharded parameters are
copied out of it into the (parameter-major) unsharded buffer, and the gradients copied into
rank-major order before the reduce-scatter: one copy each way per group and step, as FSDP2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hp_dtensor import DeviceMesh
from hp_fsdp.group_plan import RowShardLayout
from hp_layout import FlatBufferLayout

__all__ = [
    "as_torch_dtensor",
    "copy_in",
    "copy_out",
    "local_shape",
    "pack_rows",
    "torch_placements",
]


def local_shape(
    rows: RowShardLayout, index: int, shape: tuple[int, ...], coordinate: int
) -> tuple[int, ...]:
    """The shape of parameter ``index``'s rows on the rank at ``coordinate``."""
    return (rows.slots[index].local_rows(coordinate), *shape[1:])


def pack_rows(
    rows: RowShardLayout, coordinate: int, tensors: Sequence[torch.Tensor], chunk: torch.Tensor
) -> None:
    """Copy this rank's rows of each whole tensor of ``tensors`` into its slot of ``chunk``."""
    for slot, tensor in zip(rows.slots, tensors, strict=True):
        start = coordinate * slot.rows_per_rank
        n = slot.local_rows(coordinate)
        piece = tensor.reshape(slot.rows, slot.inner)[start : start + n].reshape(-1)
        chunk[slot.offset : slot.offset + piece.numel()].copy_(piece)


def _rank_major(rows: RowShardLayout, buffer: torch.Tensor, index: int) -> torch.Tensor:
    """Parameter ``index``'s slots in a rank-major buffer of every rank's chunk, as a
    ``[ranks, rows_per_rank, inner]`` view."""
    slot = rows.slots[index]
    grid = buffer.view(rows.shard_size, rows.chunk_numel)
    return grid[:, slot.offset : slot.offset + slot.capacity].view(
        rows.shard_size, slot.rows_per_rank, slot.inner
    )


def _move_rows(rank_major: torch.Tensor, whole: torch.Tensor, into_whole: bool) -> None:
    """Copy between ``[ranks, rows_per_rank, inner]`` slots and the ``[rows, inner]`` tensor
    they cut (ranks past the last row hold padding): one copy for the full ranks, one for the
    rank holding the remainder."""
    per_rank = rank_major.shape[1]
    full, remainder = divmod(whole.shape[0], per_rank) if per_rank else (0, 0)
    pairs = [(rank_major[:full], whole[: full * per_rank].view(full, per_rank, -1))]
    if remainder:
        pairs.append((rank_major[full, :remainder], whole[full * per_rank :]))
    for slots, rows_of_whole in pairs:
        if into_whole:
            rows_of_whole.copy_(slots)
        else:
            slots.copy_(rows_of_whole)


def copy_out(
    rows: RowShardLayout, gathered: torch.Tensor, flat: FlatBufferLayout, unsharded: torch.Tensor
) -> None:
    """Copy every parameter from the rank-major ``gathered`` chunks into its slot of the
    parameter-major ``unsharded`` buffer."""
    for index, slot in enumerate(flat.slots):
        target = unsharded[slot.offset : slot.end].view(rows.slots[index].rows, -1)
        _move_rows(_rank_major(rows, gathered, index), target, into_whole=True)


def copy_in(
    rows: RowShardLayout, grads: torch.Tensor, flat: FlatBufferLayout, out: torch.Tensor
) -> None:
    """Copy every parameter's gradient from its slot of the parameter-major ``grads`` into
    the rank-major ``out`` (the reduce-scatter's input; its padding must be zero already)."""
    for index, slot in enumerate(flat.slots):
        source = grads[slot.offset : slot.end].view(rows.slots[index].rows, -1)
        _move_rows(_rank_major(rows, out, index), source, into_whole=False)


def torch_placements(mesh: DeviceMesh, shard_axis: str) -> list[Any]:
    """FSDP2's placements: ``Shard(0)`` on the shard axis, ``Replicate`` on the others."""
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(0) if axis == shard_axis else Replicate() for axis in mesh.mesh.axis_names]


def as_torch_dtensor(
    local: torch.Tensor, mesh: DeviceMesh, shard_axis: str, shape: tuple[int, ...]
) -> Any:
    """``local`` (this rank's rows) as a torch DTensor of global ``shape`` (no communication)."""
    from torch.distributed.tensor import DTensor

    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local,
        mesh.to_torch(),
        torch_placements(mesh, shard_axis),
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )

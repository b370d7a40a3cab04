"""Flat-buffer packing: many tensors in one buffer cut into equal per-rank chunks.

This is the arithmetic behind zero-copy FSDP: the parameters of one group are laid end to end
(each start aligned) in one flat buffer whose length is a multiple of the shard count; rank
``c`` owns elements ``[c * chunk_numel, (c + 1) * chunk_numel)``. Each tensor's slice of a
rank's chunk is a contiguous range of the tensor's flattening, i.e. a :class:`RaggedShard`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hp_layout.errors import PlacementError
from hp_layout.layout import Layout
from hp_layout.mesh import Mesh
from hp_layout.placement import RaggedShard, Replicate

__all__ = ["FlatBufferLayout", "FlatSlot", "FlatSpan", "plan_flat_buffer"]


@dataclass(frozen=True)
class FlatSlot:
    """Where one tensor sits in the unsharded flat buffer.

    Attributes:
        index: position of the tensor in the list given to :func:`plan_flat_buffer`.
        shape: the tensor's shape.
        offset: index of its first element in the unsharded buffer.
    """

    index: int
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements of the tensor."""
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        """One past the tensor's last element in the unsharded buffer."""
        return self.offset + self.numel


@dataclass(frozen=True)
class FlatSpan:
    """The part of one tensor that lies in one rank's chunk.

    Attributes:
        index: the tensor's index.
        start: first element, in the tensor's row-major flattening.
        stop: one past the last element, in the tensor's flattening.
        chunk_offset: where ``start`` lies in the rank's chunk.
    """

    index: int
    start: int
    stop: int
    chunk_offset: int


@dataclass(frozen=True)
class FlatBufferLayout:
    """Tensors packed into one flat buffer of ``shards * chunk_numel`` elements.

    Attributes:
        slots: one per tensor, in the order given, at increasing aligned offsets.
        shards: number of equal chunks (ranks along the sharding axis).
        alignment: every slot offset and the chunk size are multiples of this (elements).
        chunk_numel: elements per rank's chunk.
    """

    slots: tuple[FlatSlot, ...]
    shards: int
    alignment: int
    chunk_numel: int

    @property
    def padded_numel(self) -> int:
        """Length of the unsharded buffer, padding included."""
        return self.shards * self.chunk_numel

    @property
    def used_numel(self) -> int:
        """Elements that belong to tensors (the rest is alignment and tail padding)."""
        return sum(s.numel for s in self.slots)

    def spans(self, coordinate: int) -> tuple[FlatSpan, ...]:
        """The tensor parts inside chunk ``coordinate``, in buffer order (empty parts omitted)."""
        if not 0 <= coordinate < self.shards:
            raise PlacementError(f"chunk {coordinate} is outside [0, {self.shards})")
        lo = coordinate * self.chunk_numel
        hi = lo + self.chunk_numel
        out = []
        for slot in self.slots:
            start, stop = max(slot.offset, lo), min(slot.end, hi)
            if start < stop:
                out.append(
                    FlatSpan(slot.index, start - slot.offset, stop - slot.offset, start - lo)
                )
        return tuple(out)

    def ragged_shard(self, index: int) -> RaggedShard:
        """Tensor ``index``'s placement along the sharding axis."""
        slot = self.slots[index]
        numels = []
        for c in range(self.shards):
            lo = c * self.chunk_numel
            numels.append(max(0, min(slot.end, lo + self.chunk_numel) - max(slot.offset, lo)))
        return RaggedShard(tuple(numels))

    def layout(self, index: int, mesh: Mesh, axis: str, base: Layout | None = None) -> Layout:
        """Tensor ``index``'s layout with its RaggedShard on ``axis`` of ``mesh``.

        ``base`` describes how the other mesh axes already distribute the tensor (for
        example tensor parallel shards); the packed shape must then be ``base``'s local shape,
        ``base`` must be Replicate on ``axis``, and the result keeps its other placements.
        Without ``base`` the packed shape is the global shape and other axes replicate.
        """
        slot = self.slots[index]
        if mesh.axis_size(axis) != self.shards:
            raise PlacementError(
                f"mesh axis {axis!r} has size {mesh.axis_size(axis)} but the buffer has "
                f"{self.shards} chunks"
            )
        if base is None:
            base = Layout(slot.shape, mesh, [Replicate()] * mesh.ndim)
        if base.mesh != mesh or not isinstance(base.placement(axis), Replicate):
            raise PlacementError(
                f"base layout {base!r} must be on {mesh!r} and Replicate on {axis!r}"
            )
        placements = list(base.placements)
        placements[mesh.axis_index(axis)] = self.ragged_shard(index)
        return Layout(base.global_shape, mesh, placements, (*base.shard_order, axis))


def plan_flat_buffer(
    shapes: Sequence[Sequence[int]], shards: int, alignment: int = 1
) -> FlatBufferLayout:
    """Pack tensors of ``shapes`` end to end into a buffer of ``shards`` equal chunks.

    Postconditions: slots are in the given order, disjoint, at offsets that are multiples of
    ``alignment``; the buffer length is ``shards * chunk_numel`` with ``chunk_numel`` the
    smallest multiple of ``alignment`` that holds every slot; for each tensor, the
    RaggedShard's numels sum to its numel.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise PlacementError(f"shards must be a positive int, got {shards!r}")
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise PlacementError(f"alignment must be a positive int, got {alignment!r}")
    slots = []
    offset = 0
    for i, shape in enumerate(shapes):
        dims = tuple(shape)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in dims):
            raise PlacementError(f"tensor {i} has an invalid shape {dims}")
        offset = -(-offset // alignment) * alignment
        slots.append(FlatSlot(i, dims, offset))
        offset += math.prod(dims)
    chunk = -(-offset // shards)
    chunk = -(-chunk // alignment) * alignment
    return FlatBufferLayout(tuple(slots), shards, alignment, chunk)

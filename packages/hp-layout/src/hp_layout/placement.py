"""Placements: how one mesh axis distributes a tensor.

A layout gives one placement per mesh axis. The placements are immutable and hashable, and
their names and semantics follow ``torch.distributed.tensor`` where PyTorch has the concept:

* :class:`Replicate` -- every rank along the axis holds the same data.
* :class:`Shard` -- the axis splits one tensor dimension with ``torch.chunk`` semantics
  (uneven and empty shards are legal).
* :class:`Partial` -- every rank holds a partial value; the true value is the reduction
  (sum, avg, max or min) over the axis.
* :class:`RaggedShard` -- the axis splits the row-major flattening of the tensor into
  contiguous ranges of given, possibly uneven, lengths: what one parameter gets from a flat
  FSDP buffer cut into equal per-rank chunks.

Two mesh axes sharding the same tensor dimension nest; which one splits first is given by the
layout's ``shard_order`` (see :class:`hp_layout.Layout`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias

from hp_layout.errors import PlacementError

__all__ = [
    "Partial",
    "Placement",
    "RaggedShard",
    "ReduceOp",
    "Replicate",
    "Shard",
    "is_sharding",
]


class ReduceOp(enum.Enum):
    """The reduction that turns the partial values of a :class:`Partial` axis into the value."""

    SUM = "sum"
    """The value is the sum of the ranks' partial values."""
    AVG = "avg"
    """The value is the mean of the ranks' partial values."""
    MAX = "max"
    """The value is the element-wise maximum of the ranks' partial values."""
    MIN = "min"
    """The value is the element-wise minimum of the ranks' partial values."""


@dataclass(frozen=True)
class Replicate:
    """Every rank along the mesh axis holds the same, whole data."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """The mesh axis splits tensor dimension ``dim`` with ``torch.chunk`` semantics.

    Attributes:
        dim: the tensor dimension split. Negative values count from the end and are
            normalized by :class:`hp_layout.Layout`, which knows the tensor's rank.
    """

    dim: int

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise PlacementError(f"Shard(dim=...) needs an int dimension, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Partial:
    """Every rank along the mesh axis holds a partial value; ``op`` over the axis gives the value.

    Attributes:
        op: the pending reduction (``"sum"``, ``"avg"``, ``"max"`` or ``"min"``).
    """

    op: ReduceOp = ReduceOp.SUM

    def __init__(self, op: ReduceOp | str = ReduceOp.SUM) -> None:
        try:
            resolved = op if isinstance(op, ReduceOp) else ReduceOp(op)
        except ValueError:
            names = ", ".join(repr(o.value) for o in ReduceOp)
            raise PlacementError(
                f"Partial(op={op!r}) is not a known reduction; use one of {names}"
            ) from None
        object.__setattr__(self, "op", resolved)

    def __repr__(self) -> str:
        return f"Partial({self.op.value!r})"


@dataclass(frozen=True)
class RaggedShard:
    """The mesh axis splits the row-major flattened tensor into contiguous, uneven ranges.

    Coordinate ``i`` along the axis holds elements ``[sum(local_numels[:i]),
    sum(local_numels[:i + 1]))`` of the flattened tensor (or of the flattened block that the
    axes sharding before it leave, see :class:`hp_layout.Layout`). The local data is 1-D.

    Attributes:
        local_numels: number of elements held at each coordinate of the axis; its length is
            the axis size and its sum the number of elements split.
    """

    local_numels: tuple[int, ...]

    def __init__(self, local_numels: tuple[int, ...] | list[int]) -> None:
        numels = tuple(local_numels)
        for n in numels:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise PlacementError(
                    f"RaggedShard(local_numels={numels!r}) needs non-negative ints, got {n!r}"
                )
        if not numels:
            raise PlacementError("RaggedShard(local_numels=()) needs one entry per axis coordinate")
        object.__setattr__(self, "local_numels", numels)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start offsets of each coordinate's range, followed by the total (length axis + 1)."""
        out = [0]
        for n in self.local_numels:
            out.append(out[-1] + n)
        return tuple(out)

    def __repr__(self) -> str:
        return f"RaggedShard({list(self.local_numels)})"


Placement: TypeAlias = Replicate | Shard | Partial | RaggedShard
"""Any of the placements a mesh axis can have."""


def is_sharding(placement: Placement) -> bool:
    """True for the placements that split the tensor (``Shard`` and ``RaggedShard``)."""
    return isinstance(placement, Shard | RaggedShard)

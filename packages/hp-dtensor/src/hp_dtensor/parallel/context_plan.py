"""Context parallelism, the pure part: how a sequence is sharded, and the plan of the style.

A sequence of ``seq_len`` positions is sharded over ``cp`` ranks of a context-parallel axis.

* Load-balanced (``balanced=True``, the default; "zigzag"): the sequence is cut into ``2 * cp``
  equal chunks and rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``, in that order. Under a
  causal mask every rank then has the same attention work (an early chunk, with few keys
  before it, pairs with a late one).
* Contiguous (``balanced=False``): rank ``i`` holds the ``i``-th of ``cp`` equal chunks.

Uneven lengths are rejected (:class:`ContextParallelError`): ``seq_len`` must divide by
``2 * cp`` (balanced) or ``cp`` (contiguous); pad the sequence (and ignore the padded targets
in the loss) to get there. Every rank then holds the same number of positions, which the
all-to-all and ring exchanges rely on.

Model code sees, on each rank, the *local* sequence: the rank's positions in the order above.
Viewed globally (validation mode's DTensors), a ``Shard(seq_dim)`` tensor is the whole sequence
reordered by :meth:`SequenceSharding.permutation` (the ranks' positions concatenated in rank
order). Only attention (the causal mask) and position embeddings depend on the true positions;
everything token-wise is indifferent to the reordering.

:meth:`SequenceSharding.ring_blocks` plans the blockwise causal attention of the ring variant:
which pieces of a (query shard, key shard) pair are fully visible, causally masked, or skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from hp_dtensor.parallel.plan import PlanError, ShardingPlan

__all__ = [
    "BlockKind",
    "ContextParallelError",
    "ContextParallelPlan",
    "RingBlock",
    "SequenceSharding",
    "Variant",
    "inverse_permutation",
]

Variant = Literal["ring", "ulysses"]
VARIANTS: tuple[str, ...] = ("ring", "ulysses")


class ContextParallelError(PlanError):
    """A sequence, a head count or a variant that context parallelism cannot shard."""


class BlockKind(Enum):
    """How a block of queries sees a block of keys under the causal mask."""

    FULL = "full"  # every key precedes (or is) every query: no mask
    CAUSAL = "causal"  # the same positions: the lower-triangular mask


@dataclass(frozen=True)
class RingBlock:
    """One piece of attention work: local query rows ``q_rows`` against the key block's rows
    ``k_rows`` (half-open ranges of the local order), masked as ``kind`` says."""

    q_rows: tuple[int, int]
    k_rows: tuple[int, int]
    kind: BlockKind


@dataclass(frozen=True)
class SequenceSharding:
    """A sequence of ``seq_len`` positions over ``cp`` ranks (see the module docstring).

    Raises:
        ContextParallelError: ``cp < 1``, or ``seq_len`` does not divide into equal chunks.
    """

    seq_len: int
    cp: int
    balanced: bool = True

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ContextParallelError(f"a context-parallel axis needs cp >= 1, got {self.cp}")
        chunks = self.num_chunks
        if self.seq_len < 0 or self.seq_len % chunks:
            how = "2 * cp" if self.balanced else "cp"
            raise ContextParallelError(
                f"sequence length {self.seq_len} does not split into {chunks} equal chunks "
                f"({how}, cp={self.cp}, balanced={self.balanced}); pad it to a multiple of "
                f"{chunks} and ignore the padded targets in the loss"
            )

    @property
    def num_chunks(self) -> int:
        """``2 * cp`` (balanced) or ``cp`` chunks."""
        return 2 * self.cp if self.balanced else self.cp

    @property
    def chunk_len(self) -> int:
        """Positions per chunk."""
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        """Positions per rank (the same on every rank)."""
        return self.seq_len // self.cp

    def chunks(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The half-open global position ranges rank ``rank`` holds, in local order.

        Postcondition: the ranges of all ranks partition ``range(seq_len)``; each is
        ``chunk_len`` long; balanced: ``(i, 2cp-1-i)``-th chunks, else the ``i``-th.
        """
        if not 0 <= rank < self.cp:
            raise ContextParallelError(
                f"rank {rank} is outside a context-parallel axis of {self.cp}"
            )
        n = self.chunk_len
        ids = (rank, 2 * self.cp - 1 - rank) if self.balanced else (rank,)
        return tuple((c * n, (c + 1) * n) for c in ids)

    def positions(self, rank: int) -> tuple[int, ...]:
        """The global positions rank ``rank`` holds, in local order (``local_len`` of them)."""
        return tuple(p for a, b in self.chunks(rank) for p in range(a, b))

    def permutation(self) -> tuple[int, ...]:
        """``perm`` with ``sharded_global[j] = natural[perm[j]]``: every rank's positions
        concatenated in rank order (a permutation of ``range(seq_len)``)."""
        return tuple(p for r in range(self.cp) for p in self.positions(r))

    def ring_blocks(self, q_rank: int, k_rank: int) -> tuple[RingBlock, ...]:
        """The attention work of rank ``q_rank``'s queries against rank ``k_rank``'s keys.

        Postcondition: pieces of the pair that the causal mask hides entirely are left out; a
        piece is ``CAUSAL`` only for identical position ranges (so every masked row keeps its
        diagonal key), ``FULL`` when every key position is at most every query position. The
        union of the pieces of all ``k_rank`` covers exactly the causal pairs of ``q_rank``.
        """
        out: list[RingBlock] = []
        n = self.chunk_len
        for qi, (qa, qb) in enumerate(self.chunks(q_rank)):
            for ki, (ka, kb) in enumerate(self.chunks(k_rank)):
                if n == 0 or ka > qb - 1:
                    continue  # every key is after every query
                q_rows, k_rows = (qi * n, (qi + 1) * n), (ki * n, (ki + 1) * n)
                if kb - 1 <= qa:
                    out.append(RingBlock(q_rows, k_rows, BlockKind.FULL))
                elif (ka, kb) == (qa, qb):
                    out.append(RingBlock(q_rows, k_rows, BlockKind.CAUSAL))
                else:  # cannot happen for equal, disjoint chunks
                    raise AssertionError(f"overlapping chunks {(qa, qb)} and {(ka, kb)}")
        return tuple(out)

    def work(self, rank: int) -> int:
        """Query-key pairs rank ``rank`` computes over the whole ring (causal halves count
        half): the load the balancing evens out."""
        n = self.chunk_len
        total = 0
        for k_rank in range(self.cp):
            for block in self.ring_blocks(rank, k_rank):
                total += n * n if block.kind is BlockKind.FULL else n * (n + 1) // 2
        return total


def inverse_permutation(perm: tuple[int, ...]) -> tuple[int, ...]:
    """``inv`` with ``inv[perm[j]] = j`` (raises ValueError if ``perm`` is no permutation)."""
    inv = [-1] * len(perm)
    for j, p in enumerate(perm):
        if not 0 <= p < len(perm) or inv[p] != -1:
            raise ValueError(f"{perm} is not a permutation of range({len(perm)})")
        inv[p] = j
    return tuple(inv)


@dataclass(frozen=True)
class ContextParallelPlan(ShardingPlan):
    """The lowered :class:`~hp_dtensor.parallel.styles.ContextParallel` style: the general
    plan (sequence-sharded query, key, value and output) plus the attention variant.

    Attributes:
        variant: ``"ring"`` or ``"ulysses"``.
        seq_dim: the sequence dim of query, key, value and output.
        head_dim_index: the heads dim (Ulysses shards it).
        balanced: the load-balanced (zigzag) sharding of the sequence.
        scale: the softmax scale (None: ``1 / sqrt(head size)``, as SDPA).
    """

    variant: str = "ring"
    seq_dim: int = 2
    head_dim_index: int = 1
    balanced: bool = True
    scale: float | None = None

    def describe(self, axis_size: int) -> str:
        sharding = "zigzag (load-balanced)" if self.balanced else "contiguous"
        how = (
            "key/value blocks passed around the ring"
            if self.variant == "ring"
            else "all-to-all between sequence and heads"
        )
        return f"{self.variant}: {how}; {sharding} sequence sharding of dim {self.seq_dim}"

    def collectives(self, axis_size: int) -> Mapping[str, int]:
        if axis_size == 1:
            return {}
        if self.variant == "ring":
            # cp - 1 rotations of the key/value blocks forward, as many reversed in backward.
            return {"ring_shift": 2 * (axis_size - 1)}
        # Query, key and value to heads and the output back, forward; their adjoints backward.
        return {"all_to_all": 4}

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ContextParallelError(
                f"context-parallel variant must be one of {VARIANTS}, got {self.variant!r}"
            )

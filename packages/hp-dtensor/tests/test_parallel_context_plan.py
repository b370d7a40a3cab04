"""Pure tests of the context-parallel sequence sharding (zigzag and contiguous) and of the
ring attention's block schedule: no processes, many sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hp_dtensor.parallel import ContextParallel, ContextParallelError, PlanError, SequenceSharding
from hp_dtensor.parallel.context_plan import BlockKind, ContextParallelPlan, inverse_permutation


@st.composite
def shardings(draw: st.DrawFn) -> SequenceSharding:
    cp = draw(st.integers(1, 9))
    balanced = draw(st.booleans())
    chunks = 2 * cp if balanced else cp
    return SequenceSharding(chunks * draw(st.integers(0, 6)), cp, balanced)


@settings(max_examples=200, deadline=None)
@given(shardings())
def test_positions_partition_the_sequence(s: SequenceSharding) -> None:
    held = [s.positions(r) for r in range(s.cp)]
    assert all(len(p) == s.local_len for p in held)
    assert sorted(p for ps in held for p in ps) == list(range(s.seq_len))
    perm = s.permutation()
    assert perm == tuple(p for ps in held for p in ps)
    inv = inverse_permutation(perm)
    assert all(perm[inv[i]] == i for i in range(s.seq_len))
    for r in range(s.cp):
        ids = (r, 2 * s.cp - 1 - r) if s.balanced else (r,)
        n = s.chunk_len
        assert s.chunks(r) == tuple((c * n, (c + 1) * n) for c in ids)


@settings(max_examples=150, deadline=None)
@given(shardings())
def test_ring_blocks_cover_exactly_the_causal_pairs(s: SequenceSharding) -> None:
    for q_rank in range(s.cp):
        qpos = s.positions(q_rank)
        pairs: list[tuple[int, int]] = []
        for k_rank in range(s.cp):
            kpos = s.positions(k_rank)
            for block in s.ring_blocks(q_rank, k_rank):
                (qa, qb), (ka, kb) = block.q_rows, block.k_rows
                for i in range(qa, qb):
                    for j in range(ka, kb):
                        visible = kpos[j] <= qpos[i]
                        if block.kind is BlockKind.FULL:
                            assert visible
                        else:
                            assert block.q_rows == block.k_rows
                            assert k_rank == q_rank
                        if visible:
                            pairs.append((qpos[i], kpos[j]))
        want = [(q, k) for q in qpos for k in range(s.seq_len) if k <= q]
        assert sorted(pairs) == sorted(want)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_balanced_sharding_evens_the_causal_work(cp: int) -> None:
    balanced = SequenceSharding(16 * cp, cp, balanced=True)
    assert len({balanced.work(r) for r in range(cp)}) == 1
    contiguous = SequenceSharding(16 * cp, cp, balanced=False)
    work = [contiguous.work(r) for r in range(cp)]
    assert work == sorted(work)
    assert cp == 1 or work[-1] > work[0]
    assert sum(work) == sum(balanced.work(r) for r in range(cp)) == 16 * cp * (16 * cp + 1) // 2


@pytest.mark.parametrize(("seq", "cp", "balanced"), [(6, 2, True), (7, 1, True), (5, 2, False)])
def test_uneven_lengths_are_rejected(seq: int, cp: int, balanced: bool) -> None:
    with pytest.raises(ContextParallelError, match="pad it to a multiple"):
        SequenceSharding(seq, cp, balanced)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ContextParallelError, match="cp >= 1"):
        SequenceSharding(4, 0)
    with pytest.raises(ContextParallelError, match="outside"):
        SequenceSharding(8, 2).chunks(2)
    with pytest.raises(ValueError, match="not a permutation"):
        inverse_permutation((0, 0))
    with pytest.raises(ContextParallelError, match="variant"):
        ContextParallelPlan(variant="flash")
    linear = torch.nn.Linear(2, 2)
    with pytest.raises(PlanError, match="parameter-free"):
        ContextParallel().lower(linear, "attn")

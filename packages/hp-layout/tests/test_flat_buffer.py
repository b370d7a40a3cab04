from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hp_layout import Layout, Mesh, PlacementError, Replicate, Shard, plan_flat_buffer
from hp_layout.reference import scatter

shape_lists = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), max_size=6)


@given(shape_lists, st.integers(1, 6), st.sampled_from([1, 2, 4]))
def test_packing_postconditions(shapes: list[tuple[int, ...]], shards: int, align: int) -> None:
    packed = plan_flat_buffer(shapes, shards, align)
    assert packed.padded_numel % shards == 0
    assert packed.chunk_numel % align == 0
    end = 0
    for slot, shape in zip(packed.slots, shapes, strict=True):
        assert slot.shape == shape
        assert slot.offset % align == 0
        assert slot.offset >= end
        end = slot.end
    assert end <= packed.padded_numel
    assert packed.padded_numel - end < shards * align + align
    for slot in packed.slots:
        assert sum(packed.ragged_shard(slot.index).local_numels) == slot.numel
    # The spans of each chunk sit at their buffer positions, in order.
    for c in range(shards):
        for span in packed.spans(c):
            slot = packed.slots[span.index]
            assert slot.offset + span.start == c * packed.chunk_numel + span.chunk_offset
            assert span.stop - span.start == packed.ragged_shard(span.index).local_numels[c]


@given(shape_lists.filter(lambda s: len(s) > 0), st.integers(1, 4))
def test_ragged_layouts_give_each_rank_its_chunk(
    shapes: list[tuple[int, ...]], shards: int
) -> None:
    packed = plan_flat_buffer(shapes, shards)
    mesh = Mesh((shards,), ("dp",))
    buffer = np.arange(packed.padded_numel)
    for slot in packed.slots:
        layout = packed.layout(slot.index, mesh, "dp")
        tensor = buffer[slot.offset : slot.end].reshape(slot.shape)
        local = scatter(tensor, layout)
        for c, rank in enumerate(mesh.ranks):
            lo = c * packed.chunk_numel
            chunk = buffer[lo : lo + packed.chunk_numel]
            expected = chunk[(chunk >= slot.offset) & (chunk < slot.end)]
            assert local[rank].tolist() == expected.tolist()


def test_layout_over_tensor_parallel_shards() -> None:
    mesh = Mesh((2, 2), ("dp", "tp"))
    tp = Layout((8, 3), mesh, [Replicate(), Shard(0)])
    packed = plan_flat_buffer([(4, 3), (5,)], shards=2)
    layout = packed.layout(0, mesh, "dp", base=tp)
    assert layout.shard_order == ("tp", "dp")
    assert math.prod(layout.local_shape(0)) + math.prod(layout.local_shape(2)) == 12
    with pytest.raises(PlacementError, match="must be on"):
        packed.layout(0, mesh, "tp", base=tp)
    with pytest.raises(PlacementError, match="has size 2 but the buffer has 3"):
        plan_flat_buffer([(4,)], shards=3).layout(0, mesh, "dp")
    with pytest.raises(PlacementError, match="shards must be a positive int"):
        plan_flat_buffer([(4,)], shards=0)
    with pytest.raises(PlacementError, match="tensor 1 has an invalid shape"):
        plan_flat_buffer([(4,), (-1,)], shards=2)

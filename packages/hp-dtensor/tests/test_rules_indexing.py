"""Concatenation, splitting and indexing rules: on gloo ranks against the single-device ops,
and as pure decisions (including each rank's local piece, simulated without processes)."""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _harness import CheckReport, check_op, placement_options
from hp_dtensor.rules.indexing import plan_index
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    canonical_name,
    rule_for,
)
from hp_layout import Layout, Mesh, Partial, Placement, ReduceOp, Replicate, Shard
from hp_testing import run_on_ranks

Case = tuple[Callable[..., Any], list[torch.Tensor], list[list[Placement]] | None]


def _t(*shape: int, grad: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 31 * len(shape) + sum(shape))
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_(grad)


def _cases() -> dict[str, Case]:
    x = _t(5, 6, 3)  # dim 0 splits unevenly over an axis of 2
    m = _t(5, 7, seed=1)
    index = torch.tensor([4, 0, 2, 2])
    index_options: list[Placement] = [Replicate(), Shard(0)]
    with_index = [placement_options(3), index_options]
    unary: dict[str, Callable[..., Any]] = {
        "split": lambda a: a.split(2, dim=1),
        "split_sizes": lambda a: torch.split(a, [1, 4], 0),
        "split_with_sizes": lambda a: a.split_with_sizes([2, 4], 1),
        "chunk": lambda a: a.chunk(3, -1),
        "chunk_torch": lambda a: torch.chunk(a, 2, 0),
        "tensor_split": lambda a: torch.tensor_split(a, 4, 1),
        "unbind": lambda a: a.unbind(1),
        "unbind_torch": lambda a: torch.unbind(a, -1),
        "iterate": lambda a: list(a),
        "narrow": lambda a: a.narrow(1, 1, 3),
        "narrow_whole": lambda a: torch.narrow(a, 0, 0, 5),
        "narrow_negative": lambda a: a.narrow(-1, -2, 2),
        "select": lambda a: a.select(-1, 1),
        "select_torch": lambda a: torch.select(a, 0, -1),
        "getitem_int": lambda a: a[1],
        "getitem_ints": lambda a: a[-1, 2],
        "getitem_slice_step": lambda a: a[:, 1:5:2],
        "getitem_whole_slice": lambda a: a[:, 0:6],
        "getitem_ellipsis_none": lambda a: a[..., None, :],
        "getitem_mixed": lambda a: a[None, 1:, ..., 2],
        "getitem_bool": lambda a: a[True, :, 0],
        "getitem_false": lambda a: a[False],
        "getitem_0d_tensor": lambda a: a[:, torch.tensor(3)],
        "getitem_int_list": lambda a: a[:, :, [2, 0]],
        "roll": lambda a: a.roll(2, 1),
        "roll_flat": lambda a: torch.roll(a, 3),
        "roll_dims": lambda a: a.roll((1, -2), (0, 2)),
        "flip": lambda a: a.flip(0, 2),
        "flip_torch": lambda a: torch.flip(a, [1]),
        "fliplr": torch.fliplr,
        "flipud": lambda a: a.flipud(),
        "tril_batched": lambda a: a.tril(1),
        # Hugging Face's causal-LM loss pads its shifted labels this way.
        "pad_last": lambda a: F.pad(a, (0, 1), value=-100.0),
        "pad_two_dims_zero": lambda a: F.pad(a, (1, 0, 2, 1)),
        "pad_reflect": lambda a: F.pad(a, (1, 1), mode="reflect"),
        "constant_pad_nd": lambda a: torch.constant_pad_nd(a, (0, 2), 0.5),
        "index_select_0d": lambda a: torch.index_select(a, 1, torch.tensor(2)),
    }
    cases: dict[str, Case] = {name: (op, [x], None) for name, op in unary.items()}
    for name, op in {
        "tril": lambda a: a.tril(1),
        "triu": lambda a: torch.triu(a, -2),
        "tril_inplace": lambda a: (a * 1.0).tril_(),
        "triu_inplace": lambda a: (a * 1.0).triu_(3),
    }.items():
        cases[name] = (op, [m], None)
    cases.update(
        {
            "cat": (lambda a, b: torch.cat([a, b], dim=1), [x, _t(5, 2, 3, seed=2)], None),
            "concat_negative": (lambda a, b: torch.concat((a, b), -3), [x, _t(2, 6, 3)], None),
            "concatenate": (
                lambda a, b: torch.concatenate([a, b, a], axis=2),  # type: ignore[call-arg]
                [x, _t(5, 6, 1, seed=3)],
                None,
            ),
            "stack": (lambda a, b: torch.stack([a, b], -2), [x, _t(5, 6, 3, seed=4)], None),
            "index_select": (lambda a, i: torch.index_select(a, 1, i), [x, index], with_index),
            "index_select_method": (lambda a, i: a.index_select(-1, i % 3), [x, index], with_index),
            "getitem_dtensor_index": (lambda a, i: a[:, i], [x, index], with_index),
            "getitem_replicated_index": (
                lambda a, i: a[i, ..., i % 3],
                [x, index],
                [placement_options(3), [Replicate()]],
            ),
        }
    )
    return cases


# Combinations each case may reject (on a 1-d mesh, every combination is tried).
EXPECTED_REJECTIONS = {
    "getitem_int_list": 1,
    "getitem_dtensor_index": 6,
    "getitem_replicated_index": 2,
}
REJECTION_MESSAGES = ("is only supported on dims that are not sharded", "fully replicated")
ALL = sorted(_cases())
ON_2D = [
    "cat",
    "stack",
    "split_sizes",
    "narrow_whole",
    "getitem_mixed",
    "getitem_replicated_index",
    "index_select",
    "tril_batched",
    "roll_dims",
    "pad_two_dims_zero",
]


def _check(
    names: list[str], mesh_shape: tuple[int, ...], limit: int | None
) -> dict[str, CheckReport]:
    torch.set_num_threads(1)
    cases = _cases()
    reports = {}
    # Scoped: the rank pool's processes outlive this test, and a global filter would hide
    # the warnings later tests look for.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for name in names:
            op, inputs, options = cases[name]
            reports[name] = check_op(
                op, inputs, mesh_shape, options=options, max_combinations=limit
            )
    return reports


def _assert_reports(results: list[dict[str, CheckReport]], exhaustive: bool) -> None:
    for rank, reports in enumerate(results):
        for name, report in reports.items():
            assert not report.failures, f"rank {rank} {name}:\n" + "\n".join(report.failures)
            assert report.accepted, f"{name}: no combination was accepted"
            for line in report.rejected:
                assert any(m in line for m in REJECTION_MESSAGES), f"{name}: {line}"
            if exhaustive:
                expected = EXPECTED_REJECTIONS.get(name, 0)
                assert len(report.rejected) == expected, f"{name}:\n" + "\n".join(report.rejected)


@pytest.mark.multiprocess
def test_indexing_rules_on_a_1d_mesh_every_combination() -> None:
    _assert_reports(run_on_ranks(2, _check, ALL, (2,), None, timeout=600), exhaustive=True)


@pytest.mark.multiprocess
def test_indexing_rules_on_a_2d_mesh_sampled() -> None:
    results = run_on_ranks(4, _check, ON_2D, (2, 2), 10, timeout=600)
    _assert_reports(results, exhaustive=False)


# Pure decisions ---------------------------------------------------------------------------------

MESH = Mesh((2,), ("tp",))
MESH2 = Mesh((2, 2), ("dp", "tp"))


def _decide(func: Any, *args: Any, rank: int = 0, **kwargs: Any) -> ShardingDecision:
    rule = rule_for(func)
    assert rule is not None, func
    name, inplace = canonical_name(func)
    return rule(OpCall(func, name, args, kwargs, rank, inplace))


def _layout(shape: Sequence[int], *placements: Placement, mesh: Mesh = MESH) -> Layout:
    return Layout(tuple(shape), mesh, placements)


def _local(value: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    return value[tuple(slice(a, b) for a, b in layout.local_region(rank).box)]


def test_cat_takes_the_first_inputs_layout_with_the_cat_dim_whole() -> None:
    a = _layout((5, 6), Shard(1), Shard(0), mesh=MESH2)
    b = _layout((5, 2), Replicate(), Partial(), mesh=MESH2)
    decision = _decide(torch.cat, [a, b], 1)
    assert decision.inputs == (
        _layout((5, 6), Replicate(), Shard(0), mesh=MESH2),
        _layout((5, 2), Replicate(), Shard(0), mesh=MESH2),
    )
    assert decision.outputs == _layout((5, 8), Replicate(), Shard(0), mesh=MESH2)
    partial = _decide(torch.concat, (_layout((5, 6), Partial()), _layout((5, 6), Replicate())))
    assert partial.inputs[1] == _layout((5, 6), Partial())
    assert partial.outputs == _layout((10, 6), Partial())


def test_stack_shifts_shards_past_the_new_dim() -> None:
    a = _layout((5, 6), Shard(1))
    decision = _decide(torch.stack, [a, _layout((5, 6), Shard(0))], 1)
    assert decision.inputs == (a, a)
    assert decision.outputs == _layout((5, 2, 6), Shard(2))


def test_split_and_friends_make_their_dim_whole_and_keep_other_shards() -> None:
    layout = _layout((5, 6, 3), Shard(1), Partial(ReduceOp.MAX), mesh=MESH2)
    pieces = _decide(torch.split, layout, [2, 4], 1)
    target = _layout((5, 6, 3), Replicate(), Partial(ReduceOp.MAX), mesh=MESH2)
    assert pieces.inputs == (target,)
    assert [p.global_shape for p in pieces.outputs] == [(5, 2, 3), (5, 4, 3)]
    kept = _decide(torch.Tensor.chunk, layout, 2, 0)
    assert kept.inputs == (layout,)
    assert [p.placements for p in kept.outputs] == [layout.placements] * 2
    unbound = _decide(torch.unbind, _layout((5, 6, 3), Shard(2)), 1)
    assert unbound.outputs == tuple([_layout((5, 3), Shard(1))] * 6)
    selected = _decide(torch.Tensor.select, _layout((5, 6, 3), Shard(0)), 0, 1)
    assert selected.inputs == (_layout((5, 6, 3), Replicate()),)


def test_narrow_keeps_a_shard_when_it_keeps_the_whole_dim() -> None:
    layout = _layout((5, 6), Shard(0))
    whole = _decide(torch.narrow, layout, 0, -5, 5, rank=1)
    assert whole.inputs == (layout,)
    assert whole.outputs == layout
    assert whole.local_args == (layout, 0, 0, 2)
    part = _decide(torch.narrow, layout, 0, 1, 3)
    assert part.inputs == (_layout((5, 6), Replicate()),)
    assert part.outputs == _layout((3, 6), Replicate())


def test_getitem_keeps_shards_under_whole_slices_and_gathers_cut_dims() -> None:
    layout = _layout((5, 6, 3), Shard(1), Shard(2), mesh=MESH2)
    whole = _decide(torch.Tensor.__getitem__, layout, (None, slice(0, 6), Ellipsis, 1))
    assert whole.inputs == (_layout((5, 6, 3), Shard(1), Replicate(), mesh=MESH2),)
    assert whole.outputs == _layout((1, 5, 6), Shard(2), Replicate(), mesh=MESH2)
    assert whole.local_args == (whole.inputs[0], (None, slice(None), Ellipsis, 1))
    cut = _decide(torch.Tensor.__getitem__, layout, (slice(None), slice(1, 5, 2)))
    assert cut.inputs[0].placements == (Replicate(), Shard(2))
    assert cut.outputs.global_shape == (5, 2, 3)


def test_advanced_indexing_on_a_sharded_dim_is_refused_with_a_fix() -> None:
    layout = _layout((5, 6, 3), Shard(1))
    with pytest.raises(ShardingRuleError) as info:
        _decide(torch.Tensor.__getitem__, layout, (slice(None), [0, 2]))
    message = str(info.value)
    assert "dim 1" in message
    assert "sharded over mesh axes ['tp']" in message
    assert "redistribute dim 1 to Replicate first" in message
    index = _layout((4,), Shard(0))
    with pytest.raises(ShardingRuleError, match="must be fully replicated"):
        _decide(torch.Tensor.__getitem__, _layout((5, 6, 3), Replicate()), (slice(None), index))
    with pytest.raises(ShardingRuleError, match="boolean tensor index"):
        _decide(torch.Tensor.__getitem__, layout, torch.tensor(True))
    with pytest.raises(ShardingRuleError, match="boolean masks"):
        _decide(torch.Tensor.__getitem__, layout, (0, [True, False]))


def test_advanced_indexing_keeps_other_shards_where_torch_puts_the_dims() -> None:
    x = _layout((5, 6, 3, 4), Shard(0), Partial(), mesh=MESH2)
    index = _layout((2, 2), Replicate(), Replicate(), mesh=MESH2)
    adjacent = _decide(torch.Tensor.__getitem__, x, (slice(None), index, index))
    assert adjacent.inputs == (x, index, index)
    assert adjacent.outputs == _layout((5, 2, 2, 4), Shard(0), Partial(), mesh=MESH2)
    apart = _decide(torch.Tensor.__getitem__, x, (slice(None), index, slice(None), index))
    assert apart.outputs == _layout((2, 2, 5, 3), Shard(2), Partial(), mesh=MESH2)


def test_index_select_with_a_sharded_index_shards_the_output() -> None:
    x = _layout((5, 6), Shard(1), Shard(0), mesh=MESH2)
    index = _layout((4,), Shard(0), Replicate(), mesh=MESH2)
    decision = _decide(torch.index_select, x, 1, index)
    assert decision.inputs == (
        _layout((5, 6), Replicate(), Shard(0), mesh=MESH2),
        index,
    )
    assert decision.outputs == _layout((5, 4), Shard(1), Shard(0), mesh=MESH2)
    replicated = _decide(
        torch.Tensor.index_select, _layout((5, 6), Partial()), 0, _layout((3,), Partial())
    )
    assert replicated.inputs[1] == _layout((3,), Replicate())
    assert replicated.outputs == _layout((3, 6), Partial())


def test_tril_and_triu_shift_the_diagonal_by_the_ranks_offsets() -> None:
    layout = _layout((5, 7), Shard(0), Shard(1), mesh=MESH2)
    for rank in range(4):
        decision = _decide(torch.tril, layout, 1, rank=rank)
        assert decision.inputs == (layout,)
        assert decision.outputs == layout
        row, col = layout.local_offset(rank)
        assert decision.local_args == (layout, 1 + row - col)


def test_roll_and_flip_make_their_dims_whole() -> None:
    layout = _layout((5, 6), Shard(0), Shard(1), mesh=MESH2)
    rolled = _decide(torch.roll, layout, 1, 1)
    assert rolled.inputs[0].placements == (Shard(0), Replicate())
    flat = _decide(torch.Tensor.roll, layout, 2)
    assert flat.inputs[0].placements == (Replicate(), Replicate())
    flipped = _decide(torch.Tensor.flip, layout, 0)
    assert flipped.inputs[0].placements == (Replicate(), Shard(1))
    assert _decide(torch.fliplr, layout).inputs[0].placements == (Shard(0), Replicate())


def _random_item(rng: random.Random) -> Any:
    k = rng.random()
    if k < 0.12:
        return None
    if k < 0.17:
        return Ellipsis
    if k < 0.22:
        return rng.choice([True, False])
    if k < 0.4:
        return rng.randint(-1, 1)
    if k < 0.47:
        return torch.tensor(rng.randint(0, 1))
    if k < 0.8:
        start = rng.choice([None, 0, 1, -2])
        return slice(start, rng.choice([None, 2, 5, -1, 100]), rng.choice([None, 1, 2]))
    return rng.choice([[0, 1], [[0], [1]], [1]])


def _random_layout(rng: random.Random, shape: tuple[int, ...], mesh: Mesh) -> Layout:
    options: list[Placement] = [Replicate(), *(Shard(d) for d in range(len(shape)))]
    return Layout(shape, mesh, [rng.choice(options) for _ in range(mesh.ndim)])


def test_plan_index_matches_torch_and_each_rank_gets_its_piece() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(1500):
        shape = tuple(rng.randint(2, 5) for _ in range(rng.randint(1, 4)))
        items = tuple(_random_item(rng) for _ in range(rng.randint(1, 4)))
        index = items if rng.random() < 0.8 else items[0]
        value = torch.arange(math.prod(shape)).reshape(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                want = value[index]
            except (IndexError, RuntimeError, ValueError):
                continue
        layout = _random_layout(rng, shape, rng.choice([MESH, MESH2]))
        try:
            plan = plan_index(layout, index)
        except ShardingRuleError:
            continue  # index forms the rule refuses (bool masks, several bools, ...)
        assert plan.shape == tuple(want.shape), (shape, index)
        if any(layout.dim_sharding(d) for d in plan.advanced):
            with pytest.raises(ShardingRuleError, match="dims that are not sharded"):
                _decide(torch.Tensor.__getitem__, layout, index)
            continue
        for rank in layout.mesh.ranks:
            decision = _decide(torch.Tensor.__getitem__, layout, index, rank=rank)
            target, local_index = decision.local_args or ()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = _local(value, target, rank)[local_index]
            assert torch.equal(got, _local(want, decision.outputs, rank)), (shape, index, layout)
            checked += 1
    assert checked > 1000


def test_tril_triu_pieces_are_exact_for_every_rank() -> None:
    rng = random.Random(3)
    for _ in range(60):
        shape = (rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 6))
        layout = _random_layout(rng, shape, rng.choice([MESH, MESH2, Mesh((3,), ("x",))]))
        value = torch.arange(1, math.prod(shape) + 1).reshape(shape)
        diagonal = rng.randint(-3, 3)
        for func in (torch.tril, torch.triu):
            want = func(value, diagonal)
            for rank in layout.mesh.ranks:
                decision = _decide(func, layout, diagonal, rank=rank)
                _, local_diagonal = decision.local_args or ()
                got = func(_local(value, layout, rank), local_diagonal)
                assert torch.equal(got, _local(want, layout, rank))


def test_every_entry_point_has_a_rule() -> None:
    funcs = [
        torch.cat,
        torch.concat,
        torch.concatenate,
        torch.stack,
        torch.split,
        torch.Tensor.split,
        torch.split_with_sizes,
        torch.Tensor.split_with_sizes,
        torch.tensor_split,
        torch.Tensor.tensor_split,
        torch.chunk,
        torch.Tensor.chunk,
        torch.unbind,
        torch.Tensor.unbind,
        torch.narrow,
        torch.Tensor.narrow,
        torch.select,
        torch.Tensor.select,
        torch.Tensor.__getitem__,
        torch.index_select,
        torch.Tensor.index_select,
        torch.tril,
        torch.Tensor.tril,
        torch.Tensor.tril_,
        torch.triu,
        torch.Tensor.triu,
        torch.Tensor.triu_,
        torch.roll,
        torch.Tensor.roll,
        torch.flip,
        torch.Tensor.flip,
        torch.fliplr,
        torch.Tensor.fliplr,
        torch.flipud,
        torch.Tensor.flipud,
    ]
    assert not [f for f in funcs if rule_for(f) is None]

"""View and shape rules: against the single-device ops on gloo ranks, and as pure decisions."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from _harness import CheckReport, check_op
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    canonical_name,
    rule_for,
)
from hp_dtensor.rules.views import dim_groups, movedim_permutation
from hp_layout import Layout, Mesh, Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard
from hp_testing import run_on_ranks

Case = tuple[Callable[..., Any], list[torch.Tensor]]


def _t(*shape: int, grad: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 31 * len(shape) + sum(shape))
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_(grad)


def _cases() -> dict[str, Case]:
    x = _t(5, 6, 3)  # dim 0 splits unevenly over an axis of 2
    even = _t(4, 6, 3, seed=1)
    m = _t(5, 7, seed=2)
    ones = _t(5, 1, 3, seed=3)
    return {
        # reshapes (the view of dim 0 = 5 needs a gather: its split is uneven)
        "view_merge_uneven": (lambda a: a.view(30, 3), [x]),
        "view_merge_even": (lambda a: a.view(24, 3), [even]),
        "view_minus_one": (lambda a: a.view(-1, 2, 9), [x]),
        "view_flat": (lambda a: a.view(-1), [even]),
        "view_split": (lambda a: a.view(5, 2, 3, 3), [x]),
        "view_size_tuple": (lambda a: a.view((2, 2, 18)), [even]),
        "reshape": (lambda a: torch.reshape(a, (5, 18)), [x]),
        "reshape_transposed": (lambda a: a.transpose(0, 1).reshape(6, 15), [x]),
        "reshape_regroup": (lambda a: a.reshape(6, 4, 3), [even]),
        "view_as": (lambda a, b: a.view_as(b), [x, _t(10, 9, grad=False)]),
        "reshape_as": (lambda a, b: a.reshape_as(b), [x, _t(3, 30, grad=False)]),
        "flatten": (lambda a: a.flatten(1), [x]),
        "flatten_all": (torch.flatten, [even]),
        "flatten_head": (lambda a: a.flatten(0, -2), [even]),
        "unflatten": (lambda a: a.unflatten(1, (2, -1)), [x]),
        "unflatten_torch": (lambda a: torch.unflatten(a, -1, (3, 1)), [x]),
        # permutations
        "transpose": (lambda a: a.transpose(0, -1), [x]),
        "swapaxes": (lambda a: torch.swapaxes(a, 0, 1), [x]),
        "swapdims": (lambda a: a.swapdims(1, 2), [x]),
        "permute": (lambda a: a.permute(2, 0, 1), [x]),
        "permute_torch": (lambda a: torch.permute(a, (1, -1, 0)), [x]),
        "t": (lambda a: a.t(), [m]),
        "t_torch": (torch.t, [m]),
        "T": (lambda a: a.T, [m]),
        "H": (lambda a: a.H, [m]),
        "mT": (lambda a: a.mT, [x]),
        "mH": (lambda a: a.mH, [x]),
        "adjoint": (torch.adjoint, [x]),
        "movedim": (lambda a: torch.movedim(a, 0, -1), [x]),
        "moveaxis": (lambda a: a.moveaxis((0, 1), (2, 0)), [x]),
        # squeeze / unsqueeze
        "unsqueeze": (lambda a: a.unsqueeze(-2), [x]),
        "unsqueeze_torch": (lambda a: torch.unsqueeze(a, 0), [x]),
        "squeeze_all": (lambda a: a.squeeze(), [ones]),
        "squeeze_dim": (lambda a: a.squeeze(1), [ones]),
        "squeeze_dims": (lambda a: torch.squeeze(a, (0, 1)), [ones]),
        "squeeze_noop": (lambda a: a.squeeze(-1), [ones]),  # keeps a sharded size-1 dim
        "squeeze_inplace_noop": (lambda a: a.clone().squeeze_(0), [x]),
        # expand
        "expand": (lambda a: a.expand(2, 5, 4, 3), [ones]),
        "expand_minus_one": (lambda a: a.expand(-1, 6, -1), [ones]),
        "expand_keeps_size_one": (lambda a: a.expand(2, 5, 1, 3), [ones]),
        "expand_as": (lambda a, b: a.expand_as(b), [ones, _t(5, 6, 3, grad=False)]),
        "broadcast_to": (lambda a: torch.broadcast_to(a, (2, 5, 6, 3)), [ones]),
        "broadcast_to_method": (lambda a: a.broadcast_to((5, 2, 3)), [ones]),
    }


ALL = sorted(_cases())
# On the 2-d mesh: the cases where nested and mixed shards matter most (kept short for time).
ON_2D = [
    "view_merge_uneven",
    "view_merge_even",
    "view_minus_one",
    "view_split",
    "view_as",
    "reshape_regroup",
    "reshape_transposed",
    "flatten_head",
    "unflatten",
    "transpose",
    "permute",
    "mT",
    "movedim",
    "squeeze_all",
    "unsqueeze",
    "expand",
    "expand_as",
]


def _check(
    names: list[str], mesh_shape: tuple[int, ...], limit: int | None
) -> dict[str, CheckReport]:
    torch.set_num_threads(1)
    cases = _cases()
    return {
        name: check_op(cases[name][0], cases[name][1], mesh_shape, max_combinations=limit)
        for name in names
    }


def _assert_reports(results: list[dict[str, CheckReport]]) -> None:
    for rank, reports in enumerate(results):
        for name, report in reports.items():
            assert not report.failures, f"rank {rank} {name}:\n" + "\n".join(report.failures)
            assert not report.rejected, f"rank {rank} {name}:\n" + "\n".join(report.rejected)
            assert report.accepted, f"{name}: no combination was tried"


@pytest.mark.multiprocess
def test_view_rules_on_a_1d_mesh_every_combination() -> None:
    _assert_reports(run_on_ranks(2, _check, ALL, (2,), None, timeout=600))


@pytest.mark.multiprocess
def test_view_rules_on_a_2d_mesh_sampled() -> None:
    _assert_reports(run_on_ranks(4, _check, ON_2D, (2, 2), 12, timeout=600))


# Pure decisions ---------------------------------------------------------------------------------

MESH = Mesh((2,), ("tp",))
MESH2 = Mesh((2, 2), ("dp", "tp"))


def _decide(func: Any, *args: Any, rank: int = 0, **kwargs: Any) -> ShardingDecision:
    rule = rule_for(func)
    assert rule is not None, func
    name, inplace = canonical_name(func)
    return rule(OpCall(func, name, args, kwargs, rank, inplace))


def _getter(name: str) -> Any:
    """What ``__torch_function__`` receives for reading the property ``Tensor.<name>``."""
    return getattr(torch.Tensor, name).__get__


def _layout(
    shape: Sequence[int],
    *placements: Placement,
    mesh: Mesh = MESH,
    order: Sequence[str] | None = None,
) -> Layout:
    return Layout(tuple(shape), mesh, placements, order)


def _local(value: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    box = layout.local_region(rank).box
    return value[tuple(slice(a, b) for a, b in box)]


def _simulate(func: Any, value: torch.Tensor, layout: Layout, *args: Any) -> ShardingDecision:
    """Run the rule's local call on every rank's shard of ``value`` and compare each local
    result with its piece of the single-device result (no processes: Shard/Replicate only)."""
    want = func(value, *args)
    decision = ShardingDecision((), None)
    for rank in layout.mesh.ranks:
        decision = _decide(func, layout, *args, rank=rank)
        (target,) = decision.inputs
        flat, spec = tree_flatten(
            decision.local_args if decision.local_args is not None else (layout, *args)
        )
        flat = [_local(value, target, rank) if isinstance(v, Layout) else v for v in flat]
        local_args = tree_unflatten(flat, spec)
        got = (decision.local_func or func)(*local_args, **(decision.local_kwargs or {}))
        expected = _local(want, decision.outputs, rank)
        assert torch.equal(got, expected), (func, layout, args, rank, decision)
    return decision


def test_merge_keeps_an_even_batch_shard_and_gathers_others() -> None:
    b_sharded = _decide(torch.Tensor.view, _layout((4, 3, 8), Shard(0)), 12, 8)
    assert b_sharded.inputs == (_layout((4, 3, 8), Shard(0)),)
    assert b_sharded.outputs == _layout((12, 8), Shard(0))
    s_sharded = _decide(torch.Tensor.view, _layout((4, 3, 8), Shard(1)), 12, 8)
    assert s_sharded.inputs == (_layout((4, 3, 8), Replicate()),)
    assert s_sharded.outputs == _layout((12, 8), Replicate())
    h_sharded = _decide(torch.Tensor.view, _layout((4, 3, 8), Shard(2)), 12, 8)
    assert h_sharded.outputs == _layout((12, 8), Shard(1))


def test_view_of_an_uneven_split_redistributes() -> None:
    # 5 rows over 2 ranks: [0, 3) and [3, 5); as 15 rows they would need [0, 8) and [8, 15).
    decision = _decide(torch.Tensor.view, _layout((5, 3, 4), Shard(0)), -1, 4)
    assert decision.inputs == (_layout((5, 3, 4), Replicate()),)
    assert decision.outputs == _layout((15, 4), Replicate())
    # ... but a dim that keeps its size keeps an uneven shard.
    same = _decide(torch.Tensor.reshape, _layout((5, 6), Shard(0)), 5, 2, 3)
    assert same.outputs == _layout((5, 2, 3), Shard(0))


def test_split_dim_keeps_the_shard_only_when_chunks_line_up() -> None:
    keeps = _decide(torch.Tensor.view, _layout((12,), Shard(0)), 4, 3)
    assert keeps.outputs == _layout((4, 3), Shard(0))
    gathers = _decide(torch.Tensor.view, _layout((12,), Shard(0)), 3, 4)
    assert gathers.inputs == (_layout((12,), Replicate()),)
    regroup = _decide(torch.Tensor.reshape, _layout((6, 4), Shard(0)), (4, 6))
    assert regroup.outputs == _layout((4, 6), Shard(0))


def test_nested_shards_keep_the_longest_prefix_that_lines_up() -> None:
    both = _layout((8, 3), Shard(0), Shard(0), mesh=MESH2)
    decision = _decide(torch.Tensor.view, both, 24)
    assert decision.inputs == (both,)
    assert decision.outputs == _layout((24,), Shard(0), Shard(0), mesh=MESH2)
    outer_only = _decide(torch.Tensor.view, _layout((6, 3), Shard(0), Shard(0), mesh=MESH2), 18)
    assert outer_only.inputs[0].placements == (Shard(0), Replicate())
    assert outer_only.outputs == _layout((18,), Shard(0), Replicate(), mesh=MESH2)
    reordered = _layout((6, 3), Shard(0), Shard(0), mesh=MESH2, order=["tp", "dp"])
    kept = _decide(torch.Tensor.view, reordered, 18)
    assert kept.inputs[0].placements == (Replicate(), Shard(0))


def test_partial_passes_through_views_and_the_local_call_gets_local_sizes() -> None:
    layout = _layout((5, 6, 3), Partial(ReduceOp.MAX), Shard(1), mesh=MESH2)
    decision = _decide(torch.Tensor.view, layout, 5, -1, rank=3)
    assert decision.inputs == (layout,)
    assert decision.outputs == _layout((5, 18), Partial(ReduceOp.MAX), Shard(1), mesh=MESH2)
    assert decision.local_func is not None
    local = decision.local_func(torch.empty(layout.local_shape(3)))
    assert tuple(local.shape) == decision.outputs.local_shape(3) == (5, 9)


def test_permutations_renumber_shards() -> None:
    layout = _layout((6, 3, 2), Shard(0), Partial(), mesh=MESH2)
    transposed = _decide(torch.transpose, layout, 0, -1)
    assert transposed.inputs == (layout,)
    assert transposed.outputs == _layout((2, 3, 6), Shard(2), Partial(), mesh=MESH2)
    permuted = _decide(torch.Tensor.permute, layout, 1, 2, 0)
    assert permuted.outputs == _layout((3, 2, 6), Shard(2), Partial(), mesh=MESH2)
    matrix = _decide(_getter("mT"), _layout((6, 3, 2), Shard(2)))
    assert matrix.outputs == _layout((6, 2, 3), Shard(1))
    moved = _decide(torch.movedim, _layout((6, 3, 2), Shard(0)), 0, -1)
    assert moved.outputs == _layout((3, 2, 6), Shard(2))


def test_movedim_permutation_matches_torch() -> None:
    rng = random.Random(0)
    for _ in range(200):
        ndim = rng.randint(1, 5)
        k = rng.randint(1, ndim)
        source = rng.sample(range(ndim), k)
        destination = rng.sample(range(ndim), k)
        x = torch.empty(*range(2, 2 + ndim), device="meta")
        perm = movedim_permutation(ndim, source, destination)
        want = torch.movedim(x, source, destination).shape
        assert tuple(x.shape[p] for p in perm) == tuple(want)


def test_squeeze_and_unsqueeze_shift_shards() -> None:
    layout = _layout((6, 1, 4), Shard(1), Shard(2), mesh=MESH2)
    squeezed = _decide(torch.Tensor.squeeze, layout)
    assert squeezed.inputs[0].placements == (Replicate(), Shard(2))
    assert squeezed.outputs == _layout((6, 4), Replicate(), Shard(1), mesh=MESH2)
    unsqueezed = _decide(torch.unsqueeze, _layout((6, 4), Shard(1)), -2)
    assert unsqueezed.outputs == _layout((6, 1, 4), Shard(2))


def test_expand_replicates_an_expanded_sharded_dim_and_keeps_others() -> None:
    layout = _layout((1, 5), Shard(0), Shard(1), mesh=MESH2)
    decision = _decide(torch.Tensor.expand, layout, 2, 4, -1, rank=1)
    assert decision.inputs[0].placements == (Replicate(), Shard(1))
    assert decision.outputs == _layout((2, 4, 5), Replicate(), Shard(2), mesh=MESH2)
    assert decision.local_func is not None
    local = decision.local_func(torch.empty(decision.inputs[0].local_shape(1)))
    assert tuple(local.shape) == (2, 4, 2)


def test_inplace_views_are_refused_when_they_change_the_shape_or_layout() -> None:
    with pytest.raises(ShardingRuleError, match="out-of-place transpose"):
        _decide(torch.Tensor.transpose_, _layout((4, 4), Shard(0)), 0, 1)
    with pytest.raises(ShardingRuleError, match="out-of-place unsqueeze"):
        _decide(torch.Tensor.unsqueeze_, _layout((4, 4), Replicate()), 0)
    same = _decide(torch.Tensor.transpose_, _layout((4, 4), Partial()), 0, 1)
    assert same.outputs == _layout((4, 4), Partial())


def test_view_dtype_is_refused_with_a_reason() -> None:
    with pytest.raises(ShardingRuleError, match="dtype"):
        _decide(torch.Tensor.view, _layout((4, 4), Shard(0)), torch.int64)


def test_ragged_shard_survives_a_reshape_and_is_gathered_for_a_transpose() -> None:
    ragged = _layout((4, 3), RaggedShard((7, 5)))
    reshaped = _decide(torch.Tensor.reshape, ragged, 3, 4)
    assert reshaped.inputs == (ragged,)
    assert reshaped.outputs == _layout((3, 4), RaggedShard((7, 5)))
    transposed = _decide(torch.Tensor.t, ragged)
    assert transposed.inputs == (_layout((4, 3), Replicate()),)
    mixed = _layout((4, 6), Shard(0), RaggedShard((5, 7)), mesh=MESH2)
    flat = _decide(torch.Tensor.view, mixed, -1)
    assert flat.inputs == (_layout((4, 6), Shard(0), Replicate(), mesh=MESH2),)
    assert flat.outputs == _layout((24,), Shard(0), Replicate(), mesh=MESH2)


@pytest.mark.parametrize(
    ("old", "new", "groups"),
    [
        ((4, 3, 8), (12, 8), [((0, 1), (0,)), ((2,), (1,))]),
        ((6, 4), (4, 6), [((0, 1), (0, 1))]),
        ((1, 6), (6,), [((0, 1), (0,))]),
        ((6, 1), (6,), [((0,), (0,)), ((1,), ())]),
        ((2, 3), (2, 1, 3), [((0,), (0,)), ((1,), (1, 2))]),
    ],
)
def test_dim_groups(
    old: tuple[int, ...], new: tuple[int, ...], groups: list[tuple[tuple[int, ...], ...]]
) -> None:
    assert dim_groups(old, new) == groups


def _random_layout(rng: random.Random, shape: tuple[int, ...], mesh: Mesh) -> Layout:
    options: list[Placement] = [Replicate(), *(Shard(d) for d in range(len(shape)))]
    placements = [rng.choice(options) for _ in range(mesh.ndim)]
    order = list(mesh.axis_names)
    rng.shuffle(order)
    return Layout(shape, mesh, placements, order)


def _factor_shapes(numel: int, rng: random.Random) -> tuple[int, ...]:
    dims: list[int] = []
    rest = numel
    while rest > 1 and len(dims) < 4:
        divisors = [d for d in range(2, rest + 1) if rest % d == 0]
        d = rng.choice(divisors)
        dims.append(d)
        rest //= d
    if rng.random() < 0.3:
        dims.insert(rng.randint(0, len(dims)), 1)
    return tuple(dims) or (1,)


def test_random_reshapes_give_each_rank_exactly_its_piece() -> None:
    rng = random.Random(1)
    meshes = [MESH, MESH2, Mesh((3,), ("x",)), Mesh((2, 3), ("a", "b"))]
    for _ in range(300):
        numel = rng.choice([12, 24, 30, 36, 60])
        old = _factor_shapes(numel, rng)
        new = _factor_shapes(numel, rng)
        layout = _random_layout(rng, old, rng.choice(meshes))
        value = torch.arange(math.prod(old)).reshape(old)
        _simulate(torch.Tensor.reshape, value, layout, new)


def test_random_permutations_and_expands_give_each_rank_exactly_its_piece() -> None:
    rng = random.Random(2)
    for _ in range(100):
        shape = tuple(rng.choice([1, 2, 3, 5]) for _ in range(3))
        layout = _random_layout(rng, shape, rng.choice([MESH, MESH2]))
        value = torch.arange(math.prod(shape)).reshape(shape)
        perm = rng.sample(range(3), 3)
        _simulate(torch.Tensor.permute, value, layout, perm)
        _simulate(torch.Tensor.squeeze, value, layout)
        _simulate(torch.Tensor.unsqueeze, value, layout, rng.randint(-4, 3))
        sizes = [n if n != 1 else rng.choice([1, 4]) for n in shape]
        _simulate(torch.Tensor.expand, value, layout, [2, *sizes])


def test_every_entry_point_has_a_rule() -> None:
    funcs = [
        torch.Tensor.view,
        torch.reshape,
        torch.Tensor.reshape,
        torch.Tensor.view_as,
        torch.Tensor.reshape_as,
        torch.flatten,
        torch.Tensor.flatten,
        torch.unflatten,
        torch.Tensor.unflatten,
        torch.transpose,
        torch.Tensor.transpose,
        torch.Tensor.transpose_,
        torch.swapaxes,
        torch.Tensor.swapaxes,
        torch.Tensor.swapaxes_,
        torch.swapdims,
        torch.Tensor.swapdims,
        torch.Tensor.swapdims_,
        torch.permute,
        torch.Tensor.permute,
        torch.t,
        torch.Tensor.t,
        torch.Tensor.t_,
        torch.movedim,
        torch.Tensor.movedim,
        torch.moveaxis,
        torch.Tensor.moveaxis,
        torch.squeeze,
        torch.Tensor.squeeze,
        torch.Tensor.squeeze_,
        torch.unsqueeze,
        torch.Tensor.unsqueeze,
        torch.Tensor.unsqueeze_,
        torch.Tensor.expand,
        torch.Tensor.expand_as,
        torch.broadcast_to,
        torch.Tensor.broadcast_to,
        torch.adjoint,
        torch.Tensor.adjoint,
        *(_getter(name) for name in ("T", "mT", "H", "mH")),
    ]
    missing = [f for f in funcs if rule_for(f) is None]
    assert not missing


def test_every_combination_of_small_layouts_is_decided() -> None:
    # Every placement pair on a 2-d mesh gives a valid decision for a few representative ops.
    options: list[Placement] = [Replicate(), Shard(0), Shard(1), Shard(2), Partial()]
    for pair in itertools.product(options, repeat=2):
        layout = _layout((5, 6, 3), *pair, mesh=MESH2)
        for func, args in [
            (torch.Tensor.view, (30, 3)),
            (torch.Tensor.flatten, ()),
            (torch.Tensor.transpose, (0, 2)),
            (torch.Tensor.unsqueeze, (1,)),
        ]:
            decision = _decide(func, layout, *args)
            assert decision.outputs.partial_axes == layout.partial_axes

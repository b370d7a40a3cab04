"""Rules for the ops of mixture-of-experts routers (``topk``, ``one_hot``, ``scatter``,
``index_add``, ``cumsum``, ``diff``, ``all``, ``any``, ``nonzero`` / ``torch.where``) on gloo
ranks against the single-device ops, and as pure decisions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _harness import CheckReport, check_op, placement_options
from hp_dtensor import (
    DeviceMesh,
    DTensor,
    ShardingRuleError,
    distribute_tensor,
    implicit_replication,
)
from hp_dtensor.rules.registry import OpCall, ReplicatedResult, ShardingDecision, rule_for
from hp_layout import Layout, Mesh, Partial, Placement, ReduceOp, Replicate, Shard
from hp_testing import run_on_ranks

Case = tuple[Callable[..., Any], list[torch.Tensor], list[list[Placement]] | None]

NO_PARTIAL_2D: list[Placement] = [Replicate(), Shard(0), Shard(1)]
INDEX_1D: list[Placement] = [Replicate(), Shard(0)]


def _t(*shape: int, grad: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 13 * sum(shape))
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_(grad)


def _ties() -> torch.Tensor:
    """Rows with repeated values at the top and in the middle (ties decide the indices)."""
    rows = [[1, 3, 3, 2, 3], [0, 0, 0, 0, 0], [5, 1, 5, 1, 4], [2, 2, 7, 7, 1], [-1, 4, 4, 0, 4]]
    return (torch.tensor(rows, dtype=torch.float64) * 0.5).requires_grad_()


def _selection_cases() -> dict[str, Case]:
    ties = _ties()
    ids = torch.tensor([[0, 5, 3], [5, 5, 1], [2, 4, 0], [1, 0, 3]])
    return {
        "topk_ties_last_dim": (lambda a: torch.topk(a, 3), [ties], None),
        "topk_ties_dim0_smallest": (
            lambda a: a.topk(2, dim=0, largest=False, sorted=True),
            [ties],
            None,
        ),
        "topk_router": (
            lambda a: torch.topk(torch.softmax(a, dim=-1), 2, dim=-1),
            [_t(6, 4, seed=1)],
            None,
        ),
        "one_hot": (lambda i: F.one_hot(i, num_classes=7), [ids], [NO_PARTIAL_2D]),
        "one_hot_replicated_count": (lambda i: F.one_hot(i), [ids], [[Replicate()]]),
        "nonzero_and_where": (
            lambda m: (torch.nonzero(m), m.nonzero(as_tuple=True), torch.where(m)),
            [ids > 2],
            [[Replicate()]],
        ),
        "where_elementwise": (
            lambda m, a: torch.where(m, a, torch.zeros_like(a)),
            [ids > 2, _t(4, 3, seed=2)],
            [NO_PARTIAL_2D, placement_options(2)],
        ),
    }


def _scatter_cases() -> dict[str, Case]:
    # Unique rows per column (overwrite order is then defined); the index has fewer rows than
    # the input, so dim 0 is scattered into and dim 1 is element-wise.
    index = torch.tensor([[4, 0, 2, 1], [0, 3, 4, 4], [2, 1, 0, 3]])
    add_index = torch.tensor([[1, 1, 0], [2, 4, 4], [0, 0, 0], [3, 1, 3]])
    options = [placement_options(2), NO_PARTIAL_2D, placement_options(2)]
    return {
        "scatter_src": (
            lambda a, i, s: torch.scatter(a, 0, i, s),
            [_t(5, 4), index, _t(3, 4, seed=1)],
            options,
        ),
        "scatter_value_reduce": (
            lambda a, i: a.scatter(0, i, 2.5, reduce="multiply"),  # no derivative in torch
            [_t(5, 4, grad=False), index],
            options[:2],
        ),
        # In place, self keeps its layout: it may be sharded only off the written dim.
        "scatter_in_place": (
            lambda a, i, s: (a * 1.0).scatter_(0, i, s),
            [_t(5, 4), index, _t(3, 4, seed=1)],
            [[Replicate(), Shard(1)], *options[1:]],
        ),
        # Duplicate positions add up.
        "scatter_add": (
            lambda a, i, s: a.scatter_add(1, i, s),
            [_t(4, 5, seed=2), add_index, _t(4, 3, seed=3)],
            options,
        ),
        "index_add": (
            lambda a, i, s: torch.index_add(a, 0, i, s, alpha=0.5),
            [_t(5, 3, seed=4), torch.tensor([0, 2, 2, 4]), _t(4, 3, seed=5)],
            [placement_options(2), INDEX_1D, placement_options(2)],
        ),
        "index_add_dim1_in_place": (
            lambda a, i, s: (a * 1.0).index_add_(1, i, s),
            [_t(3, 5, seed=6), torch.tensor([4, 4, 1]), _t(3, 3, seed=7)],
            [[Replicate(), Shard(0), Partial()], INDEX_1D, placement_options(2)],
        ),
    }


def _set(a: torch.Tensor, index: Any, value: torch.Tensor) -> torch.Tensor:
    out = a * 1.0  # a non-leaf copy to write into
    out[index] = value
    return out


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(perm)
    with implicit_replication():  # the plain arange, as model code writes it
        out[perm] = torch.arange(perm.shape[0])
    return out


def _write_cases() -> dict[str, Case]:
    rows = torch.tensor([3, 0, 4])
    return {
        # x[perm] = arange(...), as transformers' grouped_mm experts invert a permutation.
        "setitem_inverse_permutation": (
            _inverse,
            [torch.tensor([2, 0, 4, 1, 3])],
            [[Replicate()]],
        ),
        # Rows chosen by a tensor: the row dim whole, the column shards kept (value alike).
        "setitem_rows": (
            lambda a, i, v: _set(a, i, v),
            [_t(5, 4), rows, _t(3, 4, seed=1)],
            [[Replicate(), Shard(1)], [Replicate()], placement_options(2)],
        ),
        # A column slice, with a value broadcast over the rows.
        "setitem_slice_broadcast": (
            lambda a, v: _set(a, (slice(None), slice(1, 3)), v),
            [_t(5, 4), _t(2, seed=2)],
            [[Replicate(), Shard(0)], placement_options(1)],
        ),
    }


def _grouped_mm_cases() -> dict[str, Case]:
    # fp32 with every stride a multiple of 16 bytes (the CPU kernel's requirement), groups of
    # 2, 0 and 4 rows (an expert without tokens).
    g = torch.Generator().manual_seed(9)
    a = torch.randn(6, 8, generator=g).requires_grad_()
    b = torch.randn(3, 8, 8, generator=g).requires_grad_()
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)
    return {
        "grouped_mm_offs": (
            lambda x, w, o: torch._grouped_mm(x, w, offs=o),
            [a, b, offs],
            [placement_options(2), placement_options(3), INDEX_1D],
        ),
        "grouped_mm_batched": (
            lambda x, w: torch._grouped_mm(x, w),
            [torch.randn(3, 4, 8, generator=g).requires_grad_(), b],
            None,
        ),
    }


def _scan_cases() -> dict[str, Case]:
    bools = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]])
    flags = bools.bool()
    return {
        "cumsum": (lambda a: (torch.cumsum(a, 0), a.cumsum(-1)), [_t(5, 4)], None),
        "cumsum_counts": (
            lambda i: torch.cumsum(i, 0, dtype=torch.int32),
            [torch.tensor([3, 0, 2, 5, 1])],
            [INDEX_1D],
        ),
        "diff": (lambda a: (torch.diff(a, dim=0), a.diff(n=2)), [_t(5, 4)], None),
        "diff_prepend_append": (
            lambda a, p, q: torch.diff(a, n=2, dim=-1, prepend=p, append=q),
            [_t(5, 4), _t(5, 1, seed=1), _t(5, 2, seed=2)],
            None,
        ),
        "all_any": (
            lambda m: (
                torch.all(m),
                m.all(dim=1),
                torch.any(m, dim=0, keepdim=True),
                m.any(),
                torch.all(m, dim=(0, 1)),
            ),
            [flags],
            [NO_PARTIAL_2D],
        ),
    }


def _all_cases() -> dict[str, Case]:
    return {
        **_selection_cases(),
        **_scatter_cases(),
        **_write_cases(),
        **_grouped_mm_cases(),
        **_scan_cases(),
    }


ALL = sorted(_all_cases())
SAMPLE_1D, SAMPLE_2D = 24, 4
# fp32 cases (float64 elsewhere): a K-split product sums its partial products in another
# order than one device.
ATOL = {"grouped_mm_offs": 1e-5, "grouped_mm_batched": 1e-5}


def _check(names: list[str], mesh_shape: tuple[int, ...]) -> dict[str, CheckReport]:
    torch.set_num_threads(1)
    cases = _all_cases()
    limit = SAMPLE_1D if len(mesh_shape) == 1 else SAMPLE_2D
    return {
        name: check_op(
            cases[name][0],
            cases[name][1],
            mesh_shape,
            options=cases[name][2],
            max_combinations=limit,
            atol=ATOL.get(name, 1e-12),
        )
        for name in names
    }


def _assert_reports(results: list[dict[str, CheckReport]]) -> None:
    for rank, reports in enumerate(results):
        for name, report in reports.items():
            assert not report.failures, f"rank {rank} {name}:\n" + "\n".join(report.failures)
            assert not report.rejected, f"rank {rank} {name}:\n" + "\n".join(report.rejected)
            assert report.accepted, f"{name}: no combination was tried"


@pytest.mark.multiprocess
def test_routing_rules_on_a_1d_mesh() -> None:
    _assert_reports(run_on_ranks(2, _check, ALL, (2,), timeout=300))


@pytest.mark.multiprocess
def test_routing_rules_on_a_2d_mesh_sampled() -> None:
    _assert_reports(run_on_ranks(4, _check, ALL, (2, 2), timeout=300))


# Data-dependent shapes on sharded inputs are refused ---------------------------------------


def _refusals() -> list[str]:
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    ids = distribute_tensor(torch.tensor([[0, 3], [2, 1], [3, 3]]), mesh, [Shard(0)])
    messages = []
    for attempt in (
        lambda: F.one_hot(ids),
        lambda: torch.nonzero(ids),
        lambda: torch.where(ids > 1),
    ):
        try:
            attempt()
            messages.append("no error")
        except ShardingRuleError as exc:
            messages.append(str(exc))
    rows = distribute_tensor(torch.zeros(4, 3), mesh, [Shard(0)])
    try:
        with implicit_replication():
            rows.index_add_(0, torch.tensor([1, 3]), torch.ones(2, 3))
        messages.append("no error")
    except ShardingRuleError as exc:
        messages.append(str(exc))
    kept = F.one_hot(ids, num_classes=4)
    assert isinstance(kept, DTensor)
    messages.append(repr(kept.placements))
    return messages


@pytest.mark.multiprocess
def test_sharded_inputs_the_ops_cannot_use_are_refused_naming_the_layout() -> None:
    one_hot, nonzero, where, in_place, kept = run_on_ranks(2, _refusals)[0]
    assert "one_hot of Layout([3, 2], {tp: Shard(0)})" in one_hot
    assert "pass num_classes" in one_hot
    assert "nonzero of Layout([3, 2], {tp: Shard(0)})" in nonzero
    assert "the positions of the nonzero elements are data" in where
    assert "in-place index_add cannot change the layout of its self argument" in in_place
    assert kept == "(Shard(0),)"


# Pure decisions -------------------------------------------------------------------------------

MESH2 = Mesh((2, 2), ("dp", "tp"))


def _decide(func: Any, *args: Any, **kwargs: Any) -> ShardingDecision:
    rule = rule_for(func)
    assert rule is not None, func
    return rule(OpCall(func, getattr(func, "__name__", "op"), args, kwargs, 0))


def _layout(shape: tuple[int, ...], *placements: Placement) -> Layout:
    return Layout(shape, MESH2, placements)


def test_topk_gathers_only_its_dim_and_reduces_partial() -> None:
    decision = _decide(torch.topk, _layout((8, 6), Shard(0), Shard(1)), 2)
    assert decision.inputs[0].placements == (Shard(0), Replicate())
    values, indices = decision.outputs
    assert values == indices
    assert values.global_shape == (8, 2)
    partial = _decide(torch.Tensor.topk, _layout((8, 6), Partial(), Shard(0)), 3, dim=1)
    assert partial.inputs[0].placements == (Replicate(), Shard(0))


def test_index_add_with_a_split_index_is_a_partial_sum_without_gathering() -> None:
    x = _layout((6, 4), Replicate(), Shard(1))
    index = _layout((5,), Shard(0), Replicate())
    source = _layout((5, 4), Replicate(), Replicate())
    decision = _decide(torch.index_add, x, 0, index, source)
    assert [t.placements for t in decision.inputs] == [
        (Partial(ReduceOp.SUM), Shard(1)),
        (Shard(0), Replicate()),
        (Shard(0), Shard(1)),
    ]
    assert decision.outputs.placements == (Partial(ReduceOp.SUM), Shard(1))
    in_place = _decide(
        torch.Tensor.index_add_, x, 0, _layout((5,), Replicate(), Replicate()), source
    )
    assert in_place.outputs == x


def test_scatter_keeps_element_wise_dims_of_equal_extent_only() -> None:
    x = _layout((6, 4), Shard(1), Shard(0))
    index = _layout((3, 4), Replicate(), Replicate())
    decision = _decide(torch.scatter, x, 0, index, _layout((3, 4), Replicate(), Replicate()))
    assert [t.placements for t in decision.inputs] == [(Shard(1), Replicate())] * 3
    narrow = _decide(torch.scatter, x, 0, _layout((3, 2), Replicate(), Replicate()), 1.0)
    assert narrow.inputs[0].placements == (Replicate(), Replicate())


def test_cumsum_and_diff_keep_partial_and_other_shards() -> None:
    x = _layout((6, 4), Partial(), Shard(1))
    assert _decide(torch.cumsum, x, 0).outputs.placements == (Partial(), Shard(1))
    assert _decide(torch.cumsum, x, 1).inputs[0].placements == (Partial(), Replicate())
    diff = _decide(torch.diff, x, dim=0, prepend=_layout((1, 4), Replicate(), Replicate()))
    assert [t.placements for t in diff.inputs] == [(Replicate(), Shard(1))] * 2
    assert diff.outputs.global_shape == (6, 4)


def test_all_and_any_are_min_and_max_partials() -> None:
    flags = _layout((6, 4), Shard(0), Shard(1))
    assert _decide(torch.all, flags).outputs.placements == (Partial("min"), Partial("min"))
    assert _decide(torch.Tensor.any, flags, 1).outputs.placements == (Shard(0), Partial("max"))


def test_data_dependent_outputs_are_replicated_results() -> None:
    mask = _layout((6, 4), Partial(), Replicate())
    decision = _decide(torch.nonzero, mask)
    assert decision.inputs[0].is_replicated
    assert decision.outputs == ReplicatedResult(MESH2)
    assert _decide(torch.where, mask).outputs == (ReplicatedResult(MESH2),) * 2

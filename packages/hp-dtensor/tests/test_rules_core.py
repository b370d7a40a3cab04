"""Pointwise, contraction and reduction rules against the single-device ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _harness import CheckReport, check_op
from hp_dtensor.rules.registry import OpCall, ShardingRuleError, rule_for
from hp_layout import Layout, Mesh, Partial, ReduceOp, Replicate, Shard
from hp_testing import run_on_ranks


def _t(*shape: int, grad: bool = True, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_(grad)


def _cases() -> dict[str, tuple[Callable[..., Any], list[torch.Tensor]]]:
    x = _t(5, 3, 4)
    return {
        "add_broadcast": (torch.add, [x, _t(3, 1, seed=1)]),
        "sub_scalar": (lambda a: 2.0 - a * 3.0, [x]),
        "mul": (torch.mul, [x, _t(5, 3, 4, seed=2)]),
        "div": (torch.div, [x, _t(4, seed=3).exp()]),
        "silu_gelu": (lambda a: F.gelu(F.silu(a)), [x]),
        "rsqrt_pow": (lambda a: torch.rsqrt(a.pow(2) + 1.0), [x]),
        "where": (lambda a, b: torch.where(a > 0, a, b), [x, _t(5, 3, 4, seed=4)]),
        "lerp": (lambda a, b: torch.lerp(a, b, 0.3), [x, _t(5, 3, 4, seed=5)]),
        "linear": (F.linear, [x, _t(6, 4, seed=6), _t(6, seed=7)]),
        "matmul_batched": (torch.matmul, [x, _t(4, 7, seed=8)]),
        "matmul_vec": (torch.matmul, [_t(3, 5), _t(5, seed=9)]),
        "bmm": (torch.bmm, [x, _t(5, 4, 2, seed=10)]),
        "addmm": (torch.addmm, [_t(3, seed=11), _t(5, 4), _t(4, 3, seed=12)]),
        "sum_dims": (lambda a: a.sum((0, 2)), [x]),
        "sum_all": (lambda a: a.sum(), [x]),
        "mean_keepdim": (lambda a: a.mean(-1, keepdim=True), [x]),
        "amax": (lambda a: a.amax(1), [x]),
        "max_dim": (lambda a: torch.max(a, 0), [x]),
    }


def _check(
    names: list[str], mesh_shape: tuple[int, ...], limit: int | None
) -> dict[str, CheckReport]:
    torch.set_num_threads(1)
    cases = _cases()
    return {
        name: check_op(cases[name][0], cases[name][1], mesh_shape, max_combinations=limit)
        for name in names
    }


ALL = sorted(_cases())


def _assert_reports(results: list[dict[str, CheckReport]]) -> None:
    for rank, reports in enumerate(results):
        for name, report in reports.items():
            assert not report.failures, f"rank {rank} {name}:\n" + "\n".join(report.failures)
            assert report.accepted, f"{name}: no combination was accepted"


@pytest.mark.multiprocess
def test_rules_on_a_1d_mesh_every_combination() -> None:
    _assert_reports(run_on_ranks(2, _check, ALL, (2,), None, timeout=600))


@pytest.mark.multiprocess
def test_rules_on_a_2d_mesh_sampled() -> None:
    _assert_reports(run_on_ranks(4, _check, ALL, (2, 2), 24, timeout=600))


MESH = Mesh((2,), ("tp",))


def _call(func: Any, *args: Any, **kwargs: Any) -> OpCall:
    return OpCall(func, getattr(func, "__name__", "op"), args, kwargs, rank=0)


def _decide(func: Any, *args: Any, **kwargs: Any) -> Any:
    rule = rule_for(func)
    assert rule is not None
    return rule(_call(func, *args, **kwargs))


def test_linear_decisions_follow_megatron_styles() -> None:
    x_r = Layout((4, 8), MESH, [Replicate()])
    col = Layout((6, 8), MESH, [Shard(0)])
    row = Layout((6, 8), MESH, [Shard(1)])
    bias = Layout((6,), MESH, [Replicate()])
    assert _decide(F.linear, x_r, col).outputs.placements == (Shard(1),)
    decision = _decide(F.linear, x_r, row, bias)
    assert decision.outputs.placements == (Partial(),)
    # Row-parallel: the activation is sliced for free, the bias is partitioned.
    assert decision.inputs[0].placements == (Shard(1),)
    assert decision.inputs[2].placements == (Partial(),)


def test_pointwise_keeps_partial_only_where_exact() -> None:
    p = Layout((4,), MESH, [Partial()])
    r = Layout((4,), MESH, [Replicate()])
    assert _decide(torch.add, p, p).outputs.placements == (Partial(),)
    # add(P, R): the replicated term is partitioned, no communication.
    decision = _decide(torch.add, p, r)
    assert decision.outputs.placements == (Partial(),)
    assert decision.inputs[1].placements == (Partial(),)
    # add(P, 1.0) would add the scalar once per rank: reduce first.
    assert _decide(torch.add, p, 1.0).outputs.placements == (Replicate(),)
    assert _decide(torch.mul, p, r).outputs.placements == (Partial(),)
    assert _decide(torch.mul, p, p).outputs.placements == (Partial(),)
    assert _decide(torch.mul, p, p).inputs[1].placements == (Replicate(),)
    assert _decide(torch.exp, p).inputs[0].placements == (Replicate(),)


def test_mean_over_a_sharded_dim_divides_by_the_global_count() -> None:
    x = Layout((5, 3), MESH, [Shard(0)])
    decision = _decide(torch.mean, x, 0)
    assert decision.outputs.placements == (Partial(ReduceOp.SUM),)
    assert decision.local_func is not None
    local = torch.ones(3, 3)
    assert torch.allclose(decision.local_func(local, 0), torch.full((3,), 3 / 5))


def test_inplace_ops_cannot_change_self() -> None:
    p = Layout((4,), MESH, [Partial()])
    rule = rule_for(torch.Tensor.exp_)
    assert rule is not None
    with pytest.raises(ShardingRuleError, match="in-place exp on a Partial"):
        rule(OpCall(torch.Tensor.exp_, "exp", (p,), {}, 0, inplace=True))

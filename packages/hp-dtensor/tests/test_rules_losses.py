"""Loss rules (element-wise losses, and cross-entropy / nll_loss inputs where the code
matters) on gloo ranks against the single-device functions, and as pure decisions: batch and
sequence shards are never gathered, the reductions are a local one plus a sum."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F

from _harness import CheckReport, check_op, placement_options
from hp_dtensor.rules.registry import OpCall, ShardingDecision, ShardingRuleError, rule_for
from hp_layout import Layout, Mesh, Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard
from hp_testing import run_on_ranks

Case = tuple[Callable[..., Any], list[torch.Tensor], list[list[Placement]] | None]

REDUCTIONS = ("none", "sum", "mean")
# torch's stubs lack the ``weight`` these two take since torch 2.6.
MSE_LOSS = cast(Callable[..., torch.Tensor], F.mse_loss)
L1_LOSS = cast(Callable[..., torch.Tensor], F.l1_loss)
INDEX_OPTIONS: list[Placement] = [Replicate(), Shard(0), Shard(1)]


def _t(*shape: int, grad: bool = True, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 17 * sum(shape))
    x = scale * torch.randn(*shape, dtype=torch.float64, generator=g)
    return x.requires_grad_(grad)


def _positive(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.25 + torch.rand(*shape, dtype=torch.float64, generator=g)).requires_grad_()


def _elementwise_cases() -> dict[str, Case]:
    # (5, 3): dim 0 splits unevenly over an axis of 2, and (on a 2 x 2 mesh) leaves a rank
    # of a nested split with one row.
    x, y = _t(5, 3), _t(5, 3, seed=1)
    cases: dict[str, Case] = {
        f"mse_loss_{r}": (lambda a, b, r=r: F.mse_loss(a, b, reduction=r), [x, y], None)
        for r in REDUCTIONS
    }
    # Weighted means divide by the global sum of the weight (differentiable).
    cases["mse_loss_weighted_mean"] = (
        lambda a, b, w: MSE_LOSS(a, b, weight=w),
        [x, y, _positive(5, 3, seed=2)],
        None,
    )
    cases["mse_loss_weighted_none"] = (
        lambda a, b, w: MSE_LOSS(a, b, reduction="none", weight=w),
        [x, y, _positive(5, 3, seed=2)],
        None,
    )
    # torch hands l1_loss's weight to no tensor subclass; the dispatcher reads it back.
    cases["l1_loss_weighted_mean"] = (
        lambda a, b, w: L1_LOSS(a, b, weight=w),
        [x, y, _positive(5, 3, seed=3)],
        None,
    )
    cases["l1_loss_legacy_sum"] = (lambda a, b: F.l1_loss(a, b, size_average=False), [x, y], None)
    # beta = 0.5 puts elements on both sides of the quadratic / linear switch.
    cases["smooth_l1_loss_mean"] = (lambda a, b: F.smooth_l1_loss(a, b, beta=0.5), [x, y], None)
    cases["smooth_l1_loss_beta_0_sum"] = (
        lambda a, b: F.smooth_l1_loss(a, b, reduction="sum", beta=0.0),
        [x, y],
        None,
    )
    # A target broadcast over the batch (torch warns; the mean counts the broadcast shape).
    cases["mse_loss_broadcast_target"] = (
        lambda a, b: F.mse_loss(a, b),
        [_t(5, 3, seed=4), _t(3, seed=5)],
        [placement_options(2), placement_options(1)],
    )
    log_p = torch.log_softmax(_t(4, 3, 5, grad=False, seed=6), 1).requires_grad_()
    q = torch.softmax(_t(4, 3, 5, grad=False, seed=7), 1).requires_grad_()
    for r in ("none", "mean", "batchmean"):
        cases[f"kl_div_{r}"] = (lambda a, b, r=r: F.kl_div(a, b, reduction=r), [log_p, q], None)
    cases["kl_div_log_target_sum"] = (
        lambda a, b: F.kl_div(a, b, reduction="sum", log_target=True),
        [log_p, q.detach().log().requires_grad_()],
        None,
    )
    return cases


def _class_cases() -> dict[str, Case]:
    # Logits of order 1e4: a naive exp overflows; ignore_index rows, class weights and label
    # smoothing all change the value and the 'mean' denominator.
    logits = _t(6, 5, 3, scale=1e4, seed=8)
    target = torch.tensor(
        [[0, 4, -100], [2, 2, 1], [-100, 3, 0], [1, 0, 4], [4, -100, 2], [3, 1, 1]]
    )
    weight = torch.tensor([0.5, 2.0, 1.0, 0.25, 3.0], dtype=torch.float64)
    options: list[list[Placement]] = [
        placement_options(3),
        INDEX_OPTIONS,
        [Replicate(), Shard(0)],
    ]
    cases: dict[str, Case] = {
        f"cross_entropy_large_{r}": (
            lambda x, y, w, r=r: F.cross_entropy(x, y, w, reduction=r, label_smoothing=0.15),
            [logits, target, weight],
            options,
        )
        for r in REDUCTIONS
    }
    for r in ("none", "mean"):
        cases[f"nll_loss_weighted_{r}"] = (
            lambda x, y, w, r=r: F.nll_loss(F.log_softmax(x, 1), y, w, ignore_index=4, reduction=r),
            [logits, target.clamp_min(0), weight],
            options,
        )
    return cases


def _all_cases() -> dict[str, Case]:
    return {**_elementwise_cases(), **_class_cases()}


ALL = sorted(_all_cases())


# Every placement combination for these on the 1-d mesh; a fixed sample for the others (the
# test budget: about 0.1 s per combination).
EVERY_COMBINATION_1D = {"mse_loss_mean", "mse_loss_weighted_mean", "cross_entropy_large_mean"}
SAMPLE_1D, SAMPLE_2D = 8, 3


def _check(names: list[str], mesh_shape: tuple[int, ...]) -> dict[str, CheckReport]:
    torch.set_num_threads(1)
    cases = _all_cases()
    reports = {}
    for name in names:
        op, inputs, options = cases[name]
        if len(mesh_shape) > 1:
            limit: int | None = SAMPLE_2D
        else:
            limit = None if name in EVERY_COMBINATION_1D else SAMPLE_1D
        reports[name] = check_op(
            op, inputs, mesh_shape, options=options, max_combinations=limit, atol=1e-9
        )
    return reports


def _assert_reports(results: list[dict[str, CheckReport]]) -> None:
    for rank, reports in enumerate(results):
        for name, report in reports.items():
            assert not report.failures, f"rank {rank} {name}:\n" + "\n".join(report.failures)
            assert not report.rejected, f"rank {rank} {name}:\n" + "\n".join(report.rejected)
            assert report.accepted, f"{name}: no combination was tried"


@pytest.mark.multiprocess
def test_loss_rules_on_a_1d_mesh() -> None:
    _assert_reports(run_on_ranks(2, _check, ALL, (2,), timeout=300))


@pytest.mark.multiprocess
def test_loss_rules_on_a_2d_mesh_sampled() -> None:
    _assert_reports(run_on_ranks(4, _check, ALL, (2, 2), timeout=300))


# bf16: the local sums and their cross-rank sum round in bf16 ------------------------------------


def _check_bf16() -> dict[str, CheckReport]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(11)
    logits = (8.0 * torch.randn(6, 5, generator=g)).bfloat16().requires_grad_()
    labels = torch.tensor([0, 4, -100, 2, 2, 1])
    target = torch.randn(6, 5, generator=g).bfloat16().requires_grad_()
    no_partial: list[Placement] = [Replicate(), Shard(0), Shard(1)]
    cases: dict[str, Case] = {
        "cross_entropy_bf16": (
            lambda x, y: F.cross_entropy(x, y, label_smoothing=0.1),
            [logits, labels],
            [no_partial, [Replicate(), Shard(0)]],
        ),
        "mse_loss_bf16": (F.mse_loss, [logits, target], [no_partial, no_partial]),
    }
    # Each rank's sum and their sum round once each in bf16: measured one bf16 ulp (MSE 75.0
    # against one device's 75.5; fp32 gives 75.37); asserted 2% of the value (about two ulps).
    return {
        name: check_op(op, inputs, (2,), options=options, atol=2e-2)
        for name, (op, inputs, options) in cases.items()
    }


@pytest.mark.multiprocess
def test_bf16_losses_over_sharded_batches_round_like_one_device() -> None:
    _assert_reports(run_on_ranks(2, _check_bf16, timeout=120))


# Pure decisions --------------------------------------------------------------------------------

MESH = Mesh((2,), ("tp",))
MESH2 = Mesh((2, 2), ("dp", "tp"))


def _decide(func: Any, *args: Any, rank: int = 0, **kwargs: Any) -> ShardingDecision:
    rule = rule_for(func)
    assert rule is not None, func
    return rule(OpCall(func, getattr(func, "__name__", "op"), args, kwargs, rank))


def _layout(shape: tuple[int, ...], *placements: Placement, mesh: Mesh = MESH2) -> Layout:
    return Layout(shape, mesh, placements)


@pytest.mark.parametrize("loss", [F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.kl_div])
def test_batch_and_sequence_shards_are_kept_and_the_mean_is_partial(loss: Any) -> None:
    x = _layout((8, 6, 4), Shard(0), Shard(1))
    target = _layout((8, 6, 4), Replicate(), Replicate())
    decision = _decide(loss, x, target)
    assert [t.placements for t in decision.inputs] == [(Shard(0), Shard(1))] * 2
    assert decision.outputs.global_shape == ()
    assert decision.outputs.placements == (Partial(ReduceOp.SUM),) * 2
    kept = _decide(loss, x, target, reduction="none")
    assert kept.outputs.placements == (Shard(0), Shard(1))
    one_axis = _decide(
        loss,
        _layout((8, 6), Shard(0), Replicate()),
        target=_layout((8, 6), Replicate(), Replicate()),
        reduction="sum",
    )
    assert one_axis.outputs.placements == (Partial(ReduceOp.SUM), Replicate())


def test_a_sharded_target_shards_a_replicated_input_and_partial_inputs_are_reduced() -> None:
    decision = _decide(
        F.mse_loss, _layout((8, 6), Partial(), Replicate()), _layout((8, 6), Replicate(), Shard(1))
    )
    assert [t.placements for t in decision.inputs] == [(Replicate(), Shard(1))] * 2
    assert decision.outputs.placements == (Replicate(), Partial(ReduceOp.SUM))


def test_a_ragged_shard_stays_and_gives_a_partial_loss() -> None:
    ragged = Layout((8, 6), MESH, [RaggedShard((20, 28))])
    decision = _decide(F.l1_loss, ragged, ragged, reduction="mean")
    assert decision.inputs == (ragged, ragged)
    assert decision.outputs.placements == (Partial(ReduceOp.SUM),)


def test_unreplicated_losses_run_the_single_device_op_locally() -> None:
    x = _layout((8, 6), Replicate(), Replicate())
    decision = _decide(F.kl_div, x, x, reduction="batchmean")
    assert decision.outputs.placements == (Replicate(), Replicate())
    local = decision.local_func
    assert local is not None
    a, b = torch.randn(8, 6).log_softmax(1), torch.randn(8, 6).softmax(1)
    assert torch.equal(local(a, b), F.kl_div(a, b, reduction="batchmean"))


def test_bad_reductions_are_refused_naming_the_op() -> None:
    x = _layout((8, 6), Shard(0), Replicate())
    with pytest.raises(
        ShardingRuleError,
        match=r"mse_loss: reduction must be one of 'none', 'sum', 'mean', got 'batchmean'",
    ):
        _decide(F.mse_loss, x, x, reduction="batchmean")
    with pytest.raises(ShardingRuleError, match="kl_div: reduction must be"):
        _decide(F.kl_div, x, x, reduction="avg")


def test_class_index_losses_refuse_a_ragged_shard_instead_of_gathering_it() -> None:
    ragged = Layout((8, 6), MESH, [RaggedShard((20, 28))])
    labels = Layout((8,), MESH, [Replicate()])
    for loss in (F.cross_entropy, F.nll_loss):
        with pytest.raises(ShardingRuleError, match=r"RaggedShard input has no batch or class"):
            _decide(loss, ragged, labels)
    kept = _decide(F.cross_entropy, Layout((8, 6), MESH, [Shard(0)]), labels, reduction="sum")
    assert [t.placements for t in kept.inputs] == [(Shard(0),), (Shard(0),)]
    assert kept.outputs.placements == (Partial(ReduceOp.SUM),)

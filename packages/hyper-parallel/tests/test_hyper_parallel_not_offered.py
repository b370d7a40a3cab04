"""Upstream arguments with no meaning here fail with :class:`hyper_parallel.NotOfferedError`
(or TypeError for a misuse), naming the upstream spelling and what to use instead. None of
these needs processes: every check runs before any collective."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import hyper_parallel as hp
from hp_dtensor.parallel import ShardingPlan as HpShardingPlan
from hyper_parallel import NotOfferedError


def _linear() -> nn.Linear:
    return nn.Linear(4, 4)


def _stage(**kwargs: object) -> object:
    return hp.PipelineStage(_linear(), 0, 2, **kwargs)  # type: ignore[arg-type]


CASES: list[tuple[str, Callable[[], object], type[Exception], tuple[str, ...]]] = [
    (
        "fully_shard sharded_accumulated_grad",
        lambda: hp.fully_shard(_linear(), sharded_accumulated_grad=True),
        NotOfferedError,
        ("MindSpore", "before_weight_gradients", "set_requires_all_reduce"),
    ),
    (
        "fully_shard replicate_params",
        lambda: hp.fully_shard(_linear(), replicate_params={nn.Parameter(torch.ones(1))}),
        NotOfferedError,
        ("replicate_params", "hp_mpmd.all_reduce_gradients"),
    ),
    (
        "fully_shard shard_placement_fn",
        lambda: hp.fully_shard(_linear(), shard_placement_fn=lambda p: None),
        NotOfferedError,
        ("shard_placement_fn", "dim 0"),
    ),
    (
        "shard_module return_local_tensor",
        lambda: hp.shard_module(
            _linear(),
            None,  # type: ignore[arg-type]
            hp.ShardingPlan(plan={}, return_local_tensor=["relu"]),
        ),
        NotOfferedError,
        ("return_local_tensor", ".to_local()"),
    ),
    (
        "shard_module with hp-dtensor's plan",
        lambda: hp.shard_module(_linear(), None, HpShardingPlan()),  # type: ignore[arg-type]
        TypeError,
        ("hyper_parallel.parallelize_module",),
    ),
    (
        "parallelize_module without a mesh",
        lambda: hp.parallelize_module(_linear(), None, {"": hp.ColwiseParallel()}),
        NotOfferedError,
        ("device_mesh", "mesh['tp']"),
    ),
    (
        "init_parameters stage_index",
        lambda: hp.init_parameters(_linear(), stage_index=1),
        NotOfferedError,
        ("stage_index=1", "hp_dtensor.parallel.materialize"),
    ),
    (
        "PipelineStage dyn_shape",
        lambda: _stage(dyn_shape=True),
        NotOfferedError,
        ("dyn_shape", "fixed"),
    ),
    (
        "PipelineStage shared_parameters",
        lambda: _stage(shared_parameters=[]),
        NotOfferedError,
        ("shared_parameters", "hp_mpmd.TiedParameter"),
    ),
    (
        "PipelineStage src_stage",
        lambda: _stage(src_stage=3),
        NotOfferedError,
        ("src_stage=3", "hp_mpmd.StagePlacement"),
    ),
    (
        "get_hyper_optimizer matched_adamw_rms",
        lambda: hp.get_hyper_optimizer(
            _linear(), [_linear().weight], [], muon_kwargs={"muon_matched_adamw_rms": 0.3}
        ),
        NotOfferedError,
        ("matched_adamw_rms", "0.2", "scale lr"),
    ),
    (
        "get_hyper_optimizer hsdp_replica_count",
        lambda: hp.get_hyper_optimizer(
            _linear(), [_linear().weight], [], muon_kwargs={"muon_hsdp_replica_count": 2}
        ),
        NotOfferedError,
        ("hsdp_replica_count", "layouts"),
    ),
    (
        "get_hyper_optimizer unknown option",
        lambda: hp.get_hyper_optimizer(
            _linear(), [_linear().weight], [_linear().bias], adamw_kwargs={"x": 1}
        ),
        TypeError,
        ("'x'", "betas"),
    ),
    (
        "swap_wrapper policy_fn",
        lambda: hp.swap_wrapper(_linear(), lambda t: True),
        NotOfferedError,
        ("policy_fn", "hp_offload.Swapper", "ActivationPolicy"),
    ),
    (
        "swap_wrapper group_swap",
        lambda: hp.swap_wrapper(_linear(), group_swap=True),
        NotOfferedError,
        ("group_swap", "share one hp_offload.Swapper"),
    ),
    (
        "checkpoint_wrapper context_fn",
        lambda: hp.checkpoint_wrapper(_linear(), context_fn=lambda: None),
        NotOfferedError,
        ("context_fn", "hp_offload.ActivationPolicy", "BudgetPolicy"),
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [pytest.param(call, error, words, id=name) for name, call, error, words in CASES],
)
def test_refused_with_what_to_use(
    call: Callable[[], object], error: type[Exception], words: tuple[str, ...]
) -> None:
    with pytest.raises(error) as caught:
        call()
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))

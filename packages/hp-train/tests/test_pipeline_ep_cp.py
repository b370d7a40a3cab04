"""Expert and context parallelism inside pipeline stages, against runs without pipelining.

Each stage's meshes carry the ``ep`` and ``cp`` axes (cut from job-wide meshes, so every rank
creates the same process groups); a context-parallel rank's columns cross to the same ``cp``
rank of the next stage, which looks up their global positions itself. The oracles are runs
on the same batches without pipelining, to the composition tolerances of
``test_compositions`` (fp32):

* one rank, for a dense model under ``pp x cp`` and a MoE model without load-balancing loss
  under ``pp x fsdp x ep``;
* with a large load-balancing weight, ``fsdp 2 x ep 2`` with two accumulation micro-steps:
  the load-balancing loss is a function of the tokens routed together, and a pipeline's
  microbatch ``m`` on data-parallel rank ``r`` is the same rows as that run's micro-step ``m``
  on rank ``r``, so the two compute the same loss terms; one rank (or the whole batch at once)
  would route other groups of tokens. The pipeline must weigh each microbatch's term by
  ``1 / microbatches``, as accumulation does.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hp_layout import Mesh, Topology
from hp_planner.price import DryRun, StepShape, dry_run
from hp_planner.price.workload import Precision
from hp_train.config.combinations import check_combination
from hp_train.config.schema import ModelConfig, MoEConfig, ParallelConfig
from hp_train.dryrun import TrainerModel
from hp_train.parallel.pipeline import _stage_groups
from test_compositions import (
    DEEP,
    FP32_LOSS_TOLERANCE,
    FP32_NORM_TOLERANCE,
    _config,
    _differences,
    _launch,
)


def _deep_moe(aux: float, every: int = 2) -> ModelConfig:
    """Four blocks, every ``every``-th one a 4-expert MoE (``every=2``: each of two stages
    holds one; 4: only the last stage holds one)."""
    moe = MoEConfig(
        n_experts=4,
        top_k=2,
        expert_ffn_dim=32,
        every=every,
        n_shared_experts=1,
        aux_loss_weight=aux,
    )
    return ModelConfig(
        dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, moe=moe
    )


MOE_AUX = _deep_moe(0.5)
MOE_NO_AUX = _deep_moe(0.0)

#: name -> (model, pipelined layout, training options, reference layout, reference options).
CASES: dict[str, tuple[ModelConfig, ParallelConfig, dict[str, Any], ParallelConfig, dict[str, Any]]]
CASES = {
    "pp2 x cp2 ring": (
        DEEP,
        ParallelConfig(pp=2, cp=2),
        {"microbatches": 2},
        ParallelConfig(),
        {},
    ),
    "pp2 x cp2 ulysses": (
        DEEP,
        ParallelConfig(pp=2, cp=2, cp_variant="ulysses"),
        {"microbatches": 2},
        ParallelConfig(),
        {},
    ),
    "pp2 x fsdp2 x ep2 (MoE)": (
        MOE_NO_AUX,
        ParallelConfig(pp=2, dp_shard=2, ep=2),
        {"microbatches": 2},
        ParallelConfig(),
        {},
    ),
    # A stage without MoE layers creates the expert groups the other stage uses all the same.
    "pp2 x fsdp2 x ep2 (MoE in the last stage only)": (
        _deep_moe(0.0, every=4),
        ParallelConfig(pp=2, dp_shard=2, ep=2),
        {"microbatches": 2},
        ParallelConfig(),
        {},
    ),
    "pp2 x fsdp2 x ep2 (MoE, aux 0.5) vs fsdp2 x ep2 accum 2": (
        MOE_AUX,
        ParallelConfig(pp=2, dp_shard=2, ep=2),
        {"microbatches": 2},
        ParallelConfig(dp_shard=2, ep=2),
        {"grad_accum": 2},
    ),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_ep_and_cp_match_the_run_without_pipelining(case: str, tmp_path: Path) -> None:
    """Losses of every step and the step-0 gradient norm agree with the reference run's."""
    model, parallel, extra, reference, reference_extra = CASES[case]
    (want, *_) = _launch(model, reference, _config(**reference_extra), tmp_path / "ref")
    got = _launch(model, parallel, _config(**extra), tmp_path / "pp")
    assert all(r["losses"] == got[0]["losses"] for r in got)
    loss, norm = _differences(want, got[0])
    print(f"{case}: max |loss - reference| {loss:.3g}, step-0 grad norm relative {norm:.3g}")
    assert loss <= FP32_LOSS_TOLERANCE
    assert norm <= FP32_NORM_TOLERANCE


def _formula_rank(p: int, s: int, c: int, t: int, shape: tuple[int, int, int, int]) -> int:
    """Rank ``(p, s, c, t)`` of a row-major ``(pp, dp_shard, cp, tp)`` grid."""
    _, shards, cps, tps = shape
    return ((p * shards + s) * cps + c) * tps + t


def test_stage_groups_pair_the_same_context_and_data_coordinates() -> None:
    """A plan rank's groups: per stage, the tp ranks at this rank's dp and cp coordinates
    (from the rank formula), whether cp is an axis of its own or flattened into the shard
    axis; a grid without pp first or tp last is refused."""
    shape = (2, 2, 2, 2)
    grid = Mesh(shape, ("pp", "dp_shard", "cp", "tp"))
    flat = grid.flatten(["dp_shard", "cp"], "dp_shard_cp")
    for rank in range(16):
        p, s, c, _ = grid.coordinate(rank)
        want = tuple(tuple(_formula_rank(q, s, c, t, shape) for t in range(2)) for q in range(2))
        assert _stage_groups(grid, rank) == want
        assert _stage_groups(flat, rank) == want
        assert rank in want[p]
    with pytest.raises(ValueError, match="pp first and tp last"):
        _stage_groups(Mesh((2, 2), ("tp", "pp")), 0)


FP32 = Precision()  # 4 bytes per element of every kind


def _priced(model: ModelConfig, parallel: ParallelConfig) -> DryRun:
    shape = StepShape(global_batch=8, seq_len=64, microbatches=2, optimizer="adamw", precision=FP32)
    topology = Topology.single_host(parallel.world_size)
    return dry_run(TrainerModel(model), parallel, topology, shape)


def test_dry_run_prices_ep_and_cp_inside_pipeline_stages() -> None:
    """Neither pair is refused, and the dry run prices each: a context-parallel stage sends
    its columns only (microbatch rows x seq / cp x dim, fp32, per microbatch each way on the
    slowest stage), an expert-parallel stage its all-to-alls."""
    deep = replace(DEEP, max_seq_len=64)
    moe = replace(MOE_NO_AUX, max_seq_len=64)
    check_combination(deep, ParallelConfig(pp=2, cp=2), _config(microbatches=2))
    check_combination(moe, ParallelConfig(pp=2, dp_shard=2, ep=2), _config(microbatches=2))
    for cp in (1, 2):
        pp = _priced(deep, ParallelConfig(pp=2, cp=cp)).kind("pp")
        rows = 8 // 2  # the whole batch on one data-parallel rank, in two microbatches
        assert pp.calls == 2
        assert pp.nbytes == 2 * rows * (64 // cp) * deep.dim * 4, cp
    ep = _priced(moe, ParallelConfig(pp=2, dp_shard=2, ep=2))
    assert ep.kind("ep").calls > 0
    assert ep.kind("pp").nbytes == 2 * (8 // 2 // 2) * 64 * moe.dim * 4


@pytest.mark.multiprocess
def test_held_out_evaluation_under_pp_x_cp_matches_one_rank(tmp_path: Path) -> None:
    """pp 2 x cp 2: the forward-only schedule evaluates this rank's columns of the held-out
    batches (their positions looked up by each stage); the held-out losses equal one rank's."""
    from test_pipeline_eval_accum import EVAL, _close
    from test_pipeline_eval_accum import _launch as _launch_deep

    common = {**EVAL, "steps": 4}
    (one,) = _launch_deep(ParallelConfig(), _config(**common), tmp_path / "one")
    four = _launch_deep(
        ParallelConfig(pp=2, cp=2), _config(**common, microbatches=2), tmp_path / "pp"
    )
    assert sorted(four[0]["eval"]) == [1, 3]
    held_out = _close(one["eval"], four[0]["eval"])
    print(f"pp2 x cp2 held-out: max |loss - one rank| {held_out:.3g}")
    assert held_out <= FP32_LOSS_TOLERANCE

"""Interleaved 1F1B, ZB-H1 and DualPipeV in the trainer, with virtual stages, against one rank.

Each case trains at world 4 and compares its global losses and step-0 gradient norm with one
rank without pipelining (``test_compositions``' tolerances). The bubble each run measures
(per pipeline rank, the compute time of its plan's actions against the step's wall time) is
printed beside hp-mpmd's simulation of the same plan; only the simulator's numbers are
asserted (timings on a shared 2-core machine are noise).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from hp_mpmd import PipelineSchedule
from hp_mpmd.actions import ActionKind
from hp_mpmd.schedules import dualpipev, interleaved_1f1b, zero_bubble_h1
from hp_mpmd.simulate import simulate
from hp_testing import run_on_ranks
from hp_train.config.schema import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hp_train.parallel.job import plan_run
from test_compositions import (
    DEEP,
    FP32_LOSS_TOLERANCE,
    FP32_NORM_TOLERANCE,
    _config,
    _differences,
    _launch,
    _run,
)

# Eight blocks: pp 2 x 2 virtual stages of two blocks, or pp 4 x 2 of one.
EIGHT = ModelConfig(dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)

CASES: dict[str, tuple[ModelConfig, ParallelConfig, dict[str, Any]]] = {
    "interleaved pp2 x v2 x fsdp2": (
        DEEP,
        ParallelConfig(pp=2, dp_shard=2),
        {"pp_schedule": "interleaved", "microbatches": 4},
    ),
    "zbh1 pp2 x fsdp2": (
        DEEP,
        ParallelConfig(pp=2, dp_shard=2),
        {"pp_schedule": "zbh1", "microbatches": 4},
    ),
    "dualpipev pp2 x fsdp2": (
        DEEP,
        ParallelConfig(pp=2, dp_shard=2),
        {"pp_schedule": "dualpipev", "microbatches": 4},
    ),
    "dualpipev pp2 x tp2": (
        DEEP,
        ParallelConfig(pp=2, tp=2),
        {"pp_schedule": "dualpipev", "microbatches": 4},
    ),
    "interleaved pp4 x v2": (
        EIGHT,
        ParallelConfig(pp=4),
        {"pp_schedule": "interleaved", "microbatches": 4},
    ),
}


def _timed_run(
    model: ModelConfig, parallel: ParallelConfig, config: TrainConfig, out: str
) -> dict[str, Any]:
    """:func:`test_compositions._run`, timing the training schedule's compute actions and
    steps on this rank (per action kind: total seconds and count) and returning its plan."""
    busy: dict[str, list[float]] = {}
    wall = [0.0]
    plans: list[Any] = []
    compute, step = PipelineSchedule._compute, PipelineSchedule.step

    def timed_compute(self: PipelineSchedule, a: Any) -> None:
        if self.forward_only:  # evaluation and the divergence probe: not the step's bubble
            compute(self, a)
            return
        start = time.perf_counter()
        compute(self, a)
        spent = busy.setdefault(a.kind.name, [0.0, 0.0])
        spent[0] += time.perf_counter() - start
        spent[1] += 1

    def timed_step(self: PipelineSchedule, *args: Any, **kwargs: Any) -> Any:
        if self.forward_only:
            return step(self, *args, **kwargs)
        if not plans:
            plans.append(self.plan)
        start = time.perf_counter()
        result = step(self, *args, **kwargs)
        wall[0] += time.perf_counter() - start
        return result

    PipelineSchedule._compute = timed_compute  # type: ignore[method-assign]
    PipelineSchedule.step = timed_step  # type: ignore[method-assign]
    try:
        result = _run(model, parallel, config, out)
    finally:
        PipelineSchedule._compute = compute  # type: ignore[method-assign]
        PipelineSchedule.step = step  # type: ignore[method-assign]
    return {**result, "busy": busy, "wall": wall[0], "plan": plans[0] if plans else None}


def _report_bubble(case: str, ranks: list[dict[str, Any]]) -> None:
    """Print the measured bubble (pipeline ranks of data-parallel coordinate 0 are all ranks
    here or the tp group's first) beside the simulator's for the plan, at unit costs and at
    the measured mean cost of each action kind."""
    plan = ranks[0]["plan"]
    busy = sum(sum(v[0] for v in r["busy"].values()) for r in ranks)
    measured = 1.0 - busy / sum(r["wall"] for r in ranks)
    total: dict[str, list[float]] = {}
    for r in ranks:
        for kind, (seconds, count) in r["busy"].items():
            acc = total.setdefault(kind, [0.0, 0.0])
            acc[0] += seconds
            acc[1] += count
    mean = {k: s / n for k, (s, n) in total.items() if n}
    costs = {
        name: mean[kind.name]
        for name, kind in (
            ("forward", ActionKind.FORWARD),
            ("backward", ActionKind.BACKWARD),
            ("backward_input", ActionKind.BACKWARD_INPUT),
            ("backward_weight", ActionKind.BACKWARD_WEIGHT),
        )
        if kind.name in mean
    }
    unit = simulate(plan).bubble_fraction
    timed = simulate(
        plan,
        forward=costs["forward"],
        backward=costs.get("backward", 2.0 * costs["forward"]),
        backward_input=costs.get("backward_input", costs["forward"]),
        backward_weight=costs.get("backward_weight", costs["forward"]),
    ).bubble_fraction
    print(
        f"{case}: plan {plan.name} ({plan.num_ranks} ranks, {plan.num_stages} stages, "
        f"{plan.num_microbatches} microbatches): bubble measured {measured:.1%}, simulated "
        f"{unit:.1%} at unit costs, {timed:.1%} at the measured mean action costs "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in costs.items())
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_schedule_matches_one_rank(case: str, tmp_path: Path) -> None:
    """Losses and the step-0 gradient norm agree with one rank without pipelining."""
    model, parallel, extra = CASES[case]
    (one,) = _launch(model, ParallelConfig(), _config(), tmp_path / "one")
    config = _config(**extra)
    many = run_on_ranks(
        parallel.world_size, _timed_run, model, parallel, config, str(tmp_path / "many"),
        timeout=600,
    )  # fmt: skip
    assert all(r["losses"] == many[0]["losses"] for r in many)
    loss, norm = _differences(one, many[0])
    print(f"{case}: max |loss - one rank| {loss:.3g}, step-0 grad norm relative {norm:.3g}")
    # The pipeline of data-parallel / tensor-parallel coordinate 0: one rank per stage group.
    grid = [r for r in many if r["plan"] is not None]
    pipeline = grid[:: parallel.world_size // parallel.pp]
    assert len(pipeline) == parallel.pp
    _report_bubble(case, pipeline)
    assert loss <= FP32_LOSS_TOLERANCE
    assert norm <= FP32_NORM_TOLERANCE
    if parallel.dp_shard > 1:
        # FSDP reduce-scatters once per (stage, microbatch) backward, after the weight pass
        # of a split one (never after its input pass): each of the stage's blocks' groups and
        # the rank's root group (whose pre-backward hook every stage's output carries) where
        # the rank holds the embedding or the head (a middle rank's root has no parameters).
        plan = many[0]["plan"]
        v, last = config.virtual_stages, plan.num_stages - 1
        for rank, r in enumerate(many):
            held = plan.stages_of(rank // (parallel.world_size // parallel.pp))
            root = int(0 in held or last in held)
            per_backward = model.n_layers // (parallel.pp * v) + root
            expected = config.steps * config.microbatches * v * per_backward
            assert r["calls"]["grad_reduce_scatter"] == expected, (rank, expected, r["calls"])


def test_simulated_bubbles_of_the_trainer_plans() -> None:
    """The plans the cases run, and their simulated bubbles at unit costs (F = I = W = 1,
    B = 2): the textbook values for interleaved 1F1B ``(p - 1) / (v m + p - 1)`` and ZB-H1
    ``(p - 1) / (3 m + p - 1)``; DualPipeV's below both at two ranks."""
    p, m = 2, 4
    interleaved = simulate(interleaved_1f1b(p, 2, m)).bubble_fraction
    zbh1 = simulate(zero_bubble_h1(p, m)).bubble_fraction
    dual = simulate(dualpipev(p, m)).bubble_fraction
    assert interleaved == pytest.approx((p - 1) / (2 * m + p - 1))
    assert zbh1 == pytest.approx((p - 1) / (3 * m + p - 1))
    assert dual < min(interleaved, zbh1)


def test_each_rank_keeps_its_virtual_stages() -> None:
    """The JobPlan's per-rank models keep the blocks of the stages the schedule places there:
    interleaved at pp 2 x v 2 over 4 blocks, rank r runs stages r and r + 2; DualPipeV, rank r
    runs stages r and 3 - r (rank 0 the embedding and the head)."""
    parallel = ParallelConfig(pp=2, dp_shard=2)
    for schedule, blocks, head in (
        ("interleaved", [{0, 2}, {1, 3}], [False, True]),
        ("dualpipev", [{0, 3}, {1, 2}], [True, False]),
    ):
        job = plan_run(DEEP, parallel, _config(pp_schedule=schedule, microbatches=4))
        assert job.schedule is not None
        assert job.schedule.num_stages == 4
        for rank, stage in enumerate(job.stages):
            names = {p.fqn for p in stage.parallel.params}
            kept = {int(n.split(".")[1]) for n in names if n.startswith("layers.")}
            assert kept == blocks[rank], (schedule, rank, kept)
            assert ("tok_embeddings.weight" in names) == (rank == 0)
            assert ("output.weight" in names) == head[rank], (schedule, rank)


@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        (
            DEEP,
            {"pp_schedule": "interleaved", "pp_virtual_stages": 3, "microbatches": 4},
            "pp_virtual_stages=3: interleaved cuts the model into pp x pp_virtual_stages = 6 "
            "stages, which must divide its n_layers=4; with pp=2 use pp_virtual_stages in [1, 2]",
        ),
        (
            ModelConfig(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32),
            {"pp_schedule": "dualpipev", "microbatches": 4},
            "dualpipev runs 2 stages per rank: use n_layers a multiple of 4",
        ),
        (
            DEEP,
            {"pp_schedule": "interleaved", "microbatches": 3},
            "microbatches=3: the interleaved schedule runs microbatches in groups of pp=2; use "
            "a multiple of 2 (2 or 4)",
        ),
        (
            DEEP,
            {"pp_schedule": "dualpipev", "microbatches": 2, "global_batch": 8},
            "dualpipev needs at least 2 x pp = 4 microbatches",
        ),
    ],
)
def test_bad_pipeline_shapes_are_refused(
    model: ModelConfig, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        plan_run(model, ParallelConfig(pp=2, dp_shard=2), _config(**extra))
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"pp_schedule": "dualpipev", "pp_virtual_stages": 3}, "'dualpipev' runs 2 stage(s)"),
        ({"pp_schedule": "zbh1", "pp_virtual_stages": 2}, "'zbh1' runs 1 stage(s)"),
        ({"pp_schedule": "interleaved", "pp_virtual_stages": 0}, "positive integer, got 0"),
    ],
)
def test_virtual_stage_counts_the_schedule_cannot_run(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**extra)
    assert message in str(info.value)
    assert "pp_virtual_stages" in str(info.value)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["interleaved", "dualpipev"])
def test_virtual_stages_with_hsdp_accumulation_and_evaluation(
    schedule: str, tmp_path: Path
) -> None:
    """pp 2 x HSDP (dp_replicate 2), two virtual stages per rank, 2 accumulation steps of 4
    microbatches and held-out evaluation through the forward-only plan: training and held-out
    losses and the step-0 gradient norm match one rank. The replicas' all-reduce of a block
    group runs once per optimizer step; the rank's root group, which every one of its stages'
    backwards reduce-scatters, is all-reduced at each stage's last weight pass (the sum of
    pending parts: still the whole gradient), so at most twice per step."""
    from test_pipeline_eval_accum import EVAL, _close, _norm
    from test_pipeline_eval_accum import _launch as launch_eval

    steps = 2
    common = {**EVAL, "steps": steps, "global_batch": 16}
    (one,) = launch_eval(ParallelConfig(), _config(**common), tmp_path / "one")
    config = _config(**common, grad_accum=2, microbatches=4, pp_schedule=schedule)
    four = launch_eval(ParallelConfig(pp=2, dp_replicate=2), config, tmp_path / "pp")
    loss, held_out = _close(one["losses"], four[0]["losses"]), _close(one["eval"], four[0]["eval"])
    norm = abs(_norm(four[0]) - _norm(one)) / _norm(one)
    print(f"{schedule}: loss {loss:.3g}, held-out {held_out:.3g}, step-1 norm relative {norm:.3g}")
    assert sorted(four[0]["eval"]) == [1]
    assert loss <= FP32_LOSS_TOLERANCE
    assert held_out <= FP32_LOSS_TOLERANCE
    assert norm <= FP32_NORM_TOLERANCE
    for result in four:
        assert steps <= result["all_reduces"] <= 2 * steps, result["all_reduces"]


def test_print_plan_names_each_ranks_virtual_stages() -> None:
    """``--print-plan`` heads each pipeline rank's table with the stages the schedule places
    there (DualPipeV: rank 0 the first and the last, rank 1 the two middle ones)."""
    from hp_train.parallel.run_plan import plan_report

    config = _config(pp_schedule="dualpipev", microbatches=4)
    report = plan_report(DEEP, ParallelConfig(pp=2), config)
    assert (
        "=== stage 0 of 2: the embedding, stage 0 (block 0), stage 3 (block 3), the final norm "
        "and the head; ranks 0..0"
    ) in report
    assert "=== stage 1 of 2: stage 1 (block 1), stage 2 (block 2); ranks 1..1" in report


def _train_resumable(config: TrainConfig, out: str, resume: bool) -> dict[int, float]:
    """Train DEEP at pp 2 x dp_shard 2 (checkpointing at the end); the global losses."""
    from hp_train.runtime import init_runtime
    from hp_train.trainer import RunOptions, train

    runtime = init_runtime("cpu", threads=1)
    options = RunOptions(Path(out), quiet=True, resume=resume)
    summary = train(DEEP, ParallelConfig(pp=2, dp_shard=2), config, options, runtime)
    return dict(summary.losses)


@pytest.mark.multiprocess
def test_virtual_stage_checkpoint_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Interleaved at pp 2 x 2 virtual stages: 2 steps, a checkpoint, 2 more resumed from it
    give the losses of 4 steps straight, bit for bit (the per-rank models keep global
    parameter names, so the checkpoint is the same as with one stage per rank)."""
    extra = {"pp_schedule": "interleaved", "microbatches": 4, "checkpoint_every": 2}
    straight = run_on_ranks(
        4, _train_resumable, _config(steps=4, **extra), str(tmp_path / "a"), False, timeout=600
    )[0]
    run_on_ranks(4, _train_resumable, _config(steps=2, **extra), str(tmp_path / "b"), False)
    resumed = run_on_ranks(
        4, _train_resumable, _config(steps=4, **extra), str(tmp_path / "b"), True, timeout=600
    )[0]
    assert sorted(resumed) == [2, 3]
    assert all(resumed[s] == straight[s] for s in resumed), (resumed, straight)

"""The training loop on gloo ranks: FSDP x TP x Muon against one rank, determinism, MoE,
validation.

Runs inside the persistent rank pool (``hp_testing.run_on_ranks``): :func:`hp_train.trainer.train`
is collective and uses the pool's process group.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_testing import run_on_ranks
from hp_train.config.schema import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.data.loader import Batch, TrainData
from hp_train.runtime import init_runtime
from hp_train.trainer import RunOptions, train

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=64, max_seq_len=32)
MOE_MODEL = ModelConfig(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    max_seq_len=32,
    moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32, every=2, n_shared_experts=1),
)
# Four blocks: pp=4 runs one per stage.
PP_MODEL = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=64, max_seq_len=32)


def _run(
    model: ModelConfig,
    dims: tuple[int, ...],
    config: TrainConfig,
    out: str,
    validate: bool = False,
) -> dict[str, Any]:
    runtime = init_runtime("cpu", threads=1)
    parallel = ParallelConfig(dims[0], dims[1], dims[2], dims[3] if len(dims) > 3 else 1)
    options = RunOptions(out_dir=Path(out) / f"rank{runtime.rank}", quiet=True, validate=validate)
    try:
        summary = train(model, parallel, config, options, runtime)
    finally:
        torch.use_deterministic_algorithms(False)
    return {"losses": summary.losses}


def _config(**kwargs: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "steps": 20,
        "global_batch": 8,
        "seq_len": 16,
        "data": "synthetic",
        "log_every": 5,
        "warmup_steps": 2,
    }
    return TrainConfig(**{**base, **kwargs})


# Bounds on the largest |loss of the parallel run - loss of one rank| over 20 steps, 3-4x what
# was measured (torch 2.13, x86 CPU; the README lists each figure), so that another CPU's
# rounding passes but not much more. AdamW: fp32 rounding only (measured 7.2e-7 under
# FSDP x TP, 4.8e-7 under both pipelines), about 4 ulps of a loss near 5.5.
ADAMW_LOSS_TOLERANCE = 2e-6
# Muon's Newton-Schulz runs in bf16: gradients that differ by fp32 rounding (FSDP and TP reduce
# in another order than one rank) can round to different bf16 inputs, so its losses agree to
# bf16 rounding (measured 8.8e-5 under FSDP x TP, 1.0e-4 under PP x TP).
MUON_LOSS_TOLERANCE = 3e-4
# MoE routing is discrete: a rounding difference near a tie of two experts' scores sends a
# token elsewhere (measured 4.9e-4).
MOE_LOSS_TOLERANCE = 1.5e-3


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_fsdp_x_tp_matches_one_rank_for_20_steps(optimizer: str, tmp_path: Path) -> None:
    """FSDP 2 x TP 2 trains like one rank: every rank reports the same losses, the loss falls,
    and for 20 steps it stays within the optimizer's bound of the one-rank run's."""
    config = _config(optimizer=optimizer)
    (one,) = run_on_ranks(1, _run, MODEL, (1, 1, 1), config, str(tmp_path / "one"), timeout=300)
    four = run_on_ranks(4, _run, MODEL, (1, 2, 2), config, str(tmp_path / "four"), timeout=300)
    ref = one["losses"]
    assert all(r["losses"] == four[0]["losses"] for r in four)
    worst = max(abs(four[0]["losses"][s] - ref[s]) for s in ref)
    tolerance = ADAMW_LOSS_TOLERANCE if optimizer == "adamw" else MUON_LOSS_TOLERANCE
    print(f"{optimizer}: loss {ref[0]:.4f} -> {ref[19]:.4f}; max |4 ranks - 1 rank| = {worst:.3g}")
    assert ref[19] < ref[0] - 0.1
    assert worst <= tolerance


class _RowsReversed:
    """The run's data with every batch's rows in reverse order: the same sequences, so the
    same loss up to rounding, but each rank adds its rows' gradient contributions up in
    another order (a two-way data-parallel sum is commutative, so swapping whole rank slices
    would change no bit)."""

    def __init__(self, data: TrainData) -> None:
        self.data = data

    def batch(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> Batch:
        rows = self.data.batch(step, global_batch, dp_rank, dp_size)
        return Batch(rows.inputs.flip(0).contiguous(), rows.targets.flip(0).contiguous())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.data, name)


def _run_observed(
    model: ModelConfig,
    dims: tuple[int, int, int],
    config: TrainConfig,
    out: str,
    reverse_rows: bool = False,
) -> dict[str, Any]:
    """:func:`_run`, also returning the trained parameters (whole tensors) and, at every
    step's loss, whether this rank ran with deterministic algorithms on and whether fresh
    memory came NaN-filled, as they make it (``torch.utils.deterministic
    .fill_uninitialized_memory``); ``reverse_rows`` feeds :class:`_RowsReversed` batches."""
    from hp_train import trainer

    captured: dict[str, Any] = {"modes": []}
    # Looked up by name where the trainer looks them up (it does not export them).
    real = {name: getattr(trainer, name) for name in ("parallelize", "lm_loss", "build_data")}

    def keep(m: Any, layout: Any, **kw: Any) -> Any:
        captured["model"] = m
        return real["parallelize"](m, layout, **kw)

    def observe(logits: torch.Tensor, targets: torch.Tensor) -> Any:
        # A block just written with zeros and freed is what the next allocation of that size
        # gets back: NaN then only if fresh memory is NaN-filled (memory freed by an earlier
        # deterministic run of this pool process may hold NaNs).
        probe = torch.zeros(64)
        del probe
        fresh = bool(torch.empty(64).isnan().all())
        captured["modes"].append((torch.are_deterministic_algorithms_enabled(), fresh))
        return real["lm_loss"](logits, targets)

    def data(*args: Any, **kw: Any) -> Any:
        made = real["build_data"](*args, **kw)
        return _RowsReversed(made) if reverse_rows else made

    replacements = {"parallelize": keep, "lm_loss": observe, "build_data": data}
    for name, replacement in replacements.items():
        setattr(trainer, name, replacement)
    try:
        result = _run(model, dims, config, out)
    finally:
        # The rank pool outlives the test.
        for name, original in real.items():
            setattr(trainer, name, original)
    params = {}
    for name, value in captured["model"].state_dict().items():
        params[name] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    result["params"] = params
    result["modes"] = captured["modes"]
    dist.barrier()
    return result


def _identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two ranks' results hold the same losses and parameters, bit for bit."""
    assert a["params"].keys() == b["params"].keys()
    return a["losses"] == b["losses"] and all(
        torch.equal(a["params"][name], b["params"][name]) for name in a["params"]
    )


@pytest.mark.multiprocess
def test_deterministic_runs_are_bitwise_identical(tmp_path: Path) -> None:
    """At world 4 (2 replicas x TP 2, gloo): two ``--deterministic`` runs give bitwise-equal
    losses and parameters on every rank, while a run whose only change is the order in which
    each rank adds up its rows differs, so the comparison sees a rounding-level difference.
    Every step of every rank ran with deterministic algorithms on (fresh memory NaN-filled)
    with the flag and off without it. A run without the flag also equals the flagged ones bit
    for bit: on CPU/gloo the flag changes no number, which the README states."""
    steps = 8
    flagged, plain = _config(deterministic=True, steps=steps), _config(steps=steps)
    dims = (2, 1, 2)

    def launch(name: str, config: TrainConfig, reverse_rows: bool = False) -> list[dict[str, Any]]:
        return run_on_ranks(
            4, _run_observed, MODEL, dims, config, str(tmp_path / name), reverse_rows, timeout=300
        )

    first, second = launch("first", flagged), launch("second", flagged)
    reordered, unflagged = launch("reordered", flagged, True), launch("unflagged", plain)
    for a, b in zip(first, second, strict=True):
        assert _identical(a, b)
    assert not any(_identical(a, r) for a, r in zip(first, reordered, strict=True))
    worst = max(abs(reordered[0]["losses"][s] - first[0]["losses"][s]) for s in range(steps))
    print(f"rows reversed: max |loss difference| = {worst:.3g}")
    assert worst < 1e-4  # the same arithmetic in another order: rounding only
    for run in (first, second, reordered):
        # Every loss: each step's, and the divergence probe's on monitored steps.
        assert all(len(r["modes"]) >= steps and set(r["modes"]) == {(True, True)} for r in run), [
            r["modes"] for r in run
        ]
    assert all(len(r["modes"]) >= steps and set(r["modes"]) == {(False, False)} for r in unflagged)
    for a, u in zip(first, unflagged, strict=True):
        assert _identical(a, u)


def test_deterministic_flag_reaches_the_config() -> None:
    """``--deterministic`` on the command line sets what the test above runs with, and its
    absence leaves it off."""
    from hp_train.config.cli import parse

    assert parse(["--deterministic"], 4)[2].deterministic
    assert not parse([], 4)[2].deterministic


@pytest.mark.multiprocess
def test_moe_under_fsdp_x_tp_matches_one_rank(tmp_path: Path) -> None:
    """An MoE model (shared expert, top-2 of 4) under FSDP 2 x TP 2 stays within
    ``MOE_LOSS_TOLERANCE`` of one rank for 20 steps, and its loss falls."""
    config = _config(steps=20)
    (one,) = run_on_ranks(1, _run, MOE_MODEL, (1, 1, 1), config, str(tmp_path / "one"), timeout=300)
    four = run_on_ranks(4, _run, MOE_MODEL, (1, 2, 2), config, str(tmp_path / "four"), timeout=300)
    ref = one["losses"]
    worst = max(abs(four[0]["losses"][s] - ref[s]) for s in ref)
    print(f"MoE: loss {ref[0]:.4f} -> {ref[19]:.4f}; max |4 ranks - 1 rank| = {worst:.3g}")
    assert ref[19] < ref[0]
    assert worst <= MOE_LOSS_TOLERANCE


@pytest.mark.multiprocess
def test_validate_checks_the_plan_before_training(tmp_path: Path) -> None:
    config = _config(steps=2)
    results = run_on_ranks(
        2, _run, MODEL, (1, 1, 2), config, str(tmp_path / "v"), True, timeout=300
    )
    assert all(len(r["losses"]) == 2 for r in results)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("dims", "schedule", "optimizer"),
    [
        ((1, 1, 2, 2), "1f1b", "muon"),  # pp 2 x tp 2
        ((1, 2, 1, 2), "gpipe", "adamw"),  # pp 2 x FSDP 2
        ((1, 1, 1, 4), "1f1b", "adamw"),  # pp 4 (one block per stage)
    ],
)
def test_pipeline_matches_one_rank(
    dims: tuple[int, int, int, int], schedule: str, optimizer: str, tmp_path: Path
) -> None:
    """Each pipelined layout trains like one rank: every rank reports the same losses, the
    loss falls, and for 20 steps it stays within the optimizer's bound of the one-rank run's."""
    model = PP_MODEL
    config = _config(microbatches=2, pp_schedule=schedule, optimizer=optimizer)
    (one,) = run_on_ranks(
        1, _run, model, (1, 1, 1), _config(optimizer=optimizer), str(tmp_path / "one"), timeout=300
    )
    four = run_on_ranks(4, _run, model, dims, config, str(tmp_path / "four"), timeout=300)
    ref = one["losses"]
    assert all(r["losses"] == four[0]["losses"] for r in four)
    worst = max(abs(four[0]["losses"][s] - ref[s]) for s in ref)
    print(f"pp {dims} {schedule} {optimizer}: {ref[0]:.4f} -> {ref[19]:.4f}; max diff {worst:.3g}")
    assert ref[19] < ref[0] - 0.1
    assert worst <= (ADAMW_LOSS_TOLERANCE if optimizer == "adamw" else MUON_LOSS_TOLERANCE)


def test_every_schedule_name_has_a_plan() -> None:
    """The CLI's schedule choices are the pipeline's (split-backward ones included: FSDP
    reduces after the weight pass, ``test_pipeline_schedules``)."""
    from hp_train.config.schema import PIPELINE_SCHEDULE_NAMES
    from hp_train.parallel.pipeline import PIPELINE_SCHEDULES

    assert set(PIPELINE_SCHEDULES) == set(PIPELINE_SCHEDULE_NAMES)
    assert {"zbh1", "interleaved", "dualpipev"} <= set(PIPELINE_SCHEDULES)
    assert TrainConfig(pp_schedule="zbh1").virtual_stages == 1


def _run_counted(
    model: ModelConfig, dims: tuple[int, ...], config: TrainConfig, out: str
) -> dict[str, Any]:
    """:func:`_run`, also counting hp-fsdp's gradient collectives by purpose."""
    from hp_fsdp.counting import CountingMode

    with CountingMode() as counts:
        result = _run(model, dims, config, out)
    purposes = Counter(c.purpose for c in counts.collectives if c.purpose is not None)
    return {**result, "calls": dict(purposes)}


@pytest.mark.multiprocess
def test_pipeline_under_hsdp_all_reduces_once_per_step(tmp_path: Path) -> None:
    """pp 2 x HSDP (2 replicas of each stage), 4 microbatches: the replicate-axis all-reduce
    runs once per step (not once per microbatch), and training still matches one rank."""
    steps, microbatches = 3, 4
    config = _config(steps=steps, microbatches=microbatches, pp_schedule="1f1b", optimizer="adamw")
    single = _config(steps=steps, optimizer="adamw")
    (one,) = run_on_ranks(1, _run, PP_MODEL, (1, 1, 1), single, str(tmp_path / "1"))
    four = run_on_ranks(4, _run_counted, PP_MODEL, (2, 1, 1, 2), config, str(tmp_path / "4"))
    for result in four:
        calls = result["calls"]
        assert calls["grad_all_reduce"] == steps, calls  # one fused bucket per step
        worst = max(abs(result["losses"][s] - one["losses"][s]) for s in one["losses"])
        assert worst <= ADAMW_LOSS_TOLERANCE, worst

"""Pipelining with held-out evaluation, the divergence probe and gradient accumulation, against
one rank on the same batches.

Evaluation and the probe run the forward half of the training plan on the same stages
(``hp_mpmd.schedules.forward_only``); gradient accumulation runs ``grad_accum`` pipeline steps
per optimizer step, the replicas' all-reduce once after the last one. The oracle is a one-rank
run without pipelining (the same model, seed and batches): its training and held-out losses,
its probe losses and its step-0 gradient norm, to the composition tolerances of
``test_compositions`` (fp32).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hp_testing import run_on_ranks
from hp_train.config.schema import ParallelConfig, TrainConfig
from hp_train.runtime import init_runtime
from hp_train.trainer import RunOptions, train
from test_compositions import DEEP, FP32_LOSS_TOLERANCE, FP32_NORM_TOLERANCE, _config

EVAL = {"eval_every": 2, "eval_fraction": 0.25, "eval_batches": 2}


def _run(parallel: ParallelConfig, config: TrainConfig, out: str) -> dict[str, Any]:
    """Train; the global and held-out losses, rank 0's metrics records and the replicas'
    gradient all-reduces this rank ran."""
    from hp_fsdp.counting import CountingMode

    runtime = init_runtime("cpu", threads=1)
    folder = Path(out) / f"rank{runtime.rank}"
    with CountingMode() as counts:
        summary = train(DEEP, parallel, config, RunOptions(folder, quiet=True), runtime)
    records = []
    if runtime.rank == 0:
        records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    purposes = [c.purpose for c in counts.collectives]
    return {
        "losses": summary.losses,
        "eval": summary.eval_losses,
        "records": records,
        "all_reduces": purposes.count("grad_all_reduce"),
    }


def _launch(parallel: ParallelConfig, config: TrainConfig, out: Path) -> list[dict[str, Any]]:
    return run_on_ranks(parallel.world_size, _run, parallel, config, str(out), timeout=600)


def _close(one: dict[int, float], many: dict[int, float]) -> float:
    assert sorted(one) == sorted(many)
    return max(abs(one[s] - many[s]) for s in one)


def _norm(result: dict[str, Any]) -> float:
    return float(next(r["grad_norm"] for r in result["records"] if r["step"] == 1))


@pytest.mark.multiprocess
def test_evaluation_and_probe_under_pipelining_match_one_rank(tmp_path: Path) -> None:
    """pp 2, 1F1B over 2 microbatches, held-out evaluation every 2 steps and the probe at
    every step: the held-out losses and the last stage's probe losses equal one rank's (the
    probe's rows are the whole per-rank batch under pipelining, a micro-step's without, here
    both 8), training too; the first stage evaluates no probe."""
    common = {**EVAL, "steps": 4}
    (one,) = _launch(ParallelConfig(), _config(**common), tmp_path / "one")
    two = _launch(ParallelConfig(pp=2), _config(**common, microbatches=2), tmp_path / "pp")
    assert sorted(two[0]["eval"]) == [1, 3]  # after steps 2 and 4 (0-based keys)
    assert _close(one["eval"], two[0]["eval"]) <= FP32_LOSS_TOLERANCE
    assert two[0]["eval"] == two[1]["eval"]
    assert _close(one["losses"], two[0]["losses"]) <= FP32_LOSS_TOLERANCE
    probe = 0.0
    for mine, ref in zip(two[0]["records"], one["records"], strict=True):
        first, last = mine["probe_losses"]
        assert first is None
        probe = max(probe, abs(last - ref["probe_losses"][0]))
    print(f"held-out {_close(one['eval'], two[0]['eval']):.3g}, probe {probe:.3g}")
    assert probe <= FP32_LOSS_TOLERANCE


@pytest.mark.multiprocess
def test_accumulation_under_pipelining_matches_one_rank(tmp_path: Path) -> None:
    """pp 2 x HSDP (dp_replicate 2) with 3 accumulation steps of 2 microbatches each: the
    replicas' all-reduce runs once per optimizer step on every rank (after the last
    microbatch of the last accumulation step, not after each step's last), and training and
    evaluation match one rank."""
    steps = 3
    common = {**EVAL, "steps": steps, "global_batch": 12}
    (one,) = _launch(ParallelConfig(), _config(**common), tmp_path / "one")
    config = _config(**common, grad_accum=3, microbatches=2)
    four = _launch(ParallelConfig(pp=2, dp_replicate=2), config, tmp_path / "pp")
    for result in four:
        assert result["all_reduces"] == steps, result["all_reduces"]
    loss, held_out = _close(one["losses"], four[0]["losses"]), _close(one["eval"], four[0]["eval"])
    norm = abs(_norm(four[0]) - _norm(one)) / _norm(one)
    print(f"loss {loss:.3g}, held-out {held_out:.3g}, step-1 grad norm relative {norm:.3g}")
    assert loss <= FP32_LOSS_TOLERANCE
    assert held_out <= FP32_LOSS_TOLERANCE
    assert norm <= FP32_NORM_TOLERANCE

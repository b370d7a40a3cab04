"""``python -m hp_rl``: the configuration (a TOML ``[rl]`` table under the flags), its errors
(exit 2 before any process group), and a real torchrun job writing its metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
    EventAccumulator,
)

from hp_rl.cli import main
from hp_rl.config import RLConfigError, load_config
from hp_testing.checkpoints import job_env


def test_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[rl]\nsteps = 7\noperations = ["+", "-"]\ngroup_size = 4\n')
    config = load_config(path, {"group_size": 6, "tp": None})
    assert (config.steps, config.operations, config.group_size, config.tp) == (7, ("+", "-"), 6, 1)


@pytest.mark.parametrize(
    ("text", "flags", "names"),
    [
        ("[rl]\nstepz = 3\n", {}, "stepz"),
        ("[train]\nsteps = 3\n", {}, "[rl]"),
        ("", {"group_size": 1}, "group_size must be >= 2"),
        ("", {"sync_every": 3}, "max_lag to 2"),
        ("", {"consistency": True, "tp": 2}, "rollout_tp=1"),
        ("", {"sync_method": "scatter"}, "sync_method"),
        ("", {"offload_optimizer": True}, "optimizer 'adamw', not 'muon'"),
    ],
)
def test_bad_configurations_are_named(
    tmp_path: Path, text: str, flags: dict[str, object], names: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(RLConfigError, match=names.replace("[", r"\[").replace("]", r"\]")):
        load_config(path, flags)


def _trainer_error(overrides: dict[str, object]) -> str:
    from hp_rl.config import RLConfigError
    from test_grpo_trainer import _trainer

    try:
        _trainer(overrides)
    except RLConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"eval_every": 1, "eval_prompts": 1, "rollout_tp": 2}, "eval_prompts=1"),
        ({"prompts_per_step": 3}, "prompts_per_step=3"),
        ({"placement": "disaggregated", "rollout_ranks": 2, "checkpoint_every": 1}, "colocated"),
    ],
)
def test_job_shapes_the_trainer_refuses(overrides: dict[str, object], names: str) -> None:
    """Settings that only the job's size makes wrong are refused on every rank at set-up."""
    from hp_testing import run_on_ranks

    for message in run_on_ranks(4, _trainer_error, overrides, timeout=300):
        assert names in message, message


def test_bad_flag_exits_2_before_any_process_group(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--group-size", "1"]) == 2
    assert "group_size must be >= 2" in capsys.readouterr().err


def test_torchrun_job_writes_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "hp_rl", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
        "--max-new-tokens", "3", "--max-operand", "9", "--eval-every", "2",
        "--eval-prompts", "4", "--optimizer", "adamw", "--out", str(out), "--tensorboard",
    ]  # fmt: skip
    done = subprocess.run(command, env=job_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step    2 | reward" in done.stdout
    assert "eval at step 2: held-out greedy accuracy" in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "reward" in r]
    evals = [r["step"] for r in records if "eval_accuracy" in r]
    assert (steps, evals) == ([1, 2], [0, 2])
    assert all(0.0 <= r["reward"] <= 1.0 for r in records if "reward" in r)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("rl/reward")]
    want = [(r["step"], r["reward"]) for r in records if "reward" in r]
    assert [s for s, _ in rewards] == [s for s, _ in want]
    assert [v for _, v in rewards] == pytest.approx([v for _, v in want], rel=1e-6)
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2]


@pytest.mark.parametrize(
    ("env", "hosts"), [({}, 1), ({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "2"}, 2)]
)
def test_the_sync_plans_over_the_job_that_exists(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], hosts: int
) -> None:
    """A job started without torchrun's variables (or with stale ones) still plans over all
    its ranks: hosts of LOCAL_WORLD_SIZE ranks (default: one host)."""
    import torch.distributed as dist

    from hp_rl.trainer import _job_topology

    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    topology = _job_topology()
    assert topology.world_size == 4
    assert len(topology.tiers) == (1 if hosts == 1 else 2)

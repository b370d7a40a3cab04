"""A run followed from its logs (issue 45): ``python -m hp_train`` at world 2 with its output
redirected to a file (no terminal) prints a line every ``--log-every`` steps (and at the
first and the last); every rank's log file opens each run with a header and closes it with
the summary, or with the error that stopped it; ``metrics.jsonl`` counts steps from 1 and
keys the learning rate by optimizer group, as TensorBoard's tags do; the last step is
checkpointed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hp_train.observe.metrics import read_metrics

STEP_LINE = re.compile(
    r"step (?P<step>\d+)/7 \| loss (?P<loss>[\d.]+) \| lr muon [\d.e-]+ adamw [\d.e-]+ \| "
    r"grad norm [\d.e-]+ \| tokens/s [\d.e]+ \| step [\d.e]+ ms \| MFU [\d.e-]+% \| "
    r"peak RSS [\d.]+ MiB"
)
PEAK_TFLOPS = 0.5


def _hp_train(out: Path, console: Path, *flags: str) -> int:
    """``python -m hp_train`` at world 2 (the tiny model, synthetic data), stdout and stderr
    into ``console`` (appended): a batch job's log."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "hp_train", "--model", "tiny", "--data", "synthetic", "--out", str(out), *flags,
    ]  # fmt: skip
    with console.open("a") as sink:
        done = subprocess.run(command, stdout=sink, stderr=sink, env=env, timeout=300)
    return done.returncode


def _tensorboard_tags(log_dir: Path) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
        EventAccumulator,
    )

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {t: [e.step for e in events.Scalars(t)] for t in events.Tags()["scalars"]}


@pytest.mark.multiprocess
def test_a_batch_run_can_be_followed_from_its_logs(tmp_path: Path) -> None:
    out, console = tmp_path / "out", tmp_path / "console.txt"
    flags = ["--steps", "7", "--log-every", "3", "--checkpoint-every", "5", "--tensorboard"]
    assert _hp_train(out, console, *flags, "--peak-tflops", str(PEAK_TFLOPS)) == 0
    printed = console.read_text()
    steps = [int(m["step"]) for m in STEP_LINE.finditer(printed)]
    assert steps == [1, 3, 6, 7], printed[-3000:]
    assert "step/s" not in printed  # no progress bar without a terminal

    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert all(set(r["lr"]) == {"muon", "adamw"} for r in records)  # type: ignore[call-overload]
    for r in records:
        achieved = float(r["flops_per_token"]) * float(r["tokens_per_s"]) / 2  # type: ignore[arg-type]
        assert float(r["mfu"]) == pytest.approx(achieved / (PEAK_TFLOPS * 1e12))  # type: ignore[arg-type]
    monitored = [r for r in records if "grad_norm" in r]
    assert [r["step"] for r in monitored] == [1, 3, 6, 7]
    assert all(len(r["peak_rss_bytes"]) == 2 for r in monitored)  # type: ignore[arg-type]
    assert not any("peak_memory_bytes" in r for r in records)
    # The last step is checkpointed though 7 is no multiple of 5.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_000005",
        "step_000007",
    ]
    tags = _tensorboard_tags(out / "tensorboard")
    for tag in ("optim/lr/muon", "optim/lr/adamw", "perf/mfu", "train/loss"):
        assert tags[tag] == [1, 2, 3, 4, 5, 6, 7], tag
    assert tags["memory/peak_rss_mib"] == [1, 3, 6, 7]

    for rank in (0, 1):
        log = (out / "logs" / f"rank_{rank}.log").read_text().splitlines()
        assert log[0].endswith(f" rank {rank} INFO hp_train: ==== hp-train 0.1.0: run begins ====")
        header = "\n".join(log[:8])
        assert "command: python -m hp_train --model tiny" in header
        assert re.search(r"configuration: sha256 [0-9a-f]{12}", header)
        assert f"world: 2 ranks, this one rank {rank}; mesh dp_replicate 1 x dp_shard 2" in header
        assert "device: cpu" in header
        assert f"peak FLOP/s per rank: {PEAK_TFLOPS:g} TFLOP/s (given" in header
        assert [int(m["step"]) for m in map(STEP_LINE.search, log) if m] == [1, 3, 6, 7]
        assert "==== run ends: 7 steps (1 to 7 of 7), loss " in log[-1]

    # A second run in the folder that stops on a configuration error after its logging is
    # set up: a second header, then the error as the run's last line.
    missing = tmp_path / "nowhere"
    assert _hp_train(out, console, "--steps", "7", "--resume-from", str(missing)) != 0
    for rank in (0, 1):
        text = (out / "logs" / f"rank_{rank}.log").read_text()
        assert text.count("==== hp-train 0.1.0: run begins ====") == 2
        second = text.split("==== hp-train 0.1.0: run begins ====")[2]
        assert (
            f"==== run stopped: ConfigError: --resume-from {missing}: no such checkpoint "
            "directory ====" in second
        ), second


def test_a_missing_extra_lands_in_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--tensorboard`` without the package is refused while the options are read, before
    any process group: the message is in the rank's log of ``--out`` too."""
    import importlib.util

    from hp_train.config.cli import EXIT_CONFIG, main

    real = importlib.util.find_spec

    def without_tensorboard(name: str, *args: object) -> object:
        return None if name == "tensorboard" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_tensorboard)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "out"
    assert main(["--tensorboard", "--out", str(out), "--steps", "2"]) == EXIT_CONFIG
    log = (out / "logs" / "rank_0.log").read_text()
    assert "rank 0 ERROR hp_train.errors: --tensorboard: TensorBoard needs pip install" in log


def test_the_plot_counts_steps_as_metrics_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from types import SimpleNamespace

    from hp_train import trainer

    drawn: dict[str, object] = {}
    monkeypatch.setattr(trainer, "write_curves", lambda path, series, **_: drawn.update(series))
    lines = ['{"step": 1, "loss": 5.0}', '{"step": 2, "loss": 4.5, "eval_loss": 4.75}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    trainer.Trainer._plot(SimpleNamespace(out=tmp_path))  # type: ignore[arg-type]
    assert drawn == {"train loss": [(1.0, 5.0), (2.0, 4.5)], "eval loss": [(2.0, 4.75)]}


def test_optimizer_groups_are_named_by_their_optimizer() -> None:
    import torch

    from hp_muon import muon_with_adamw
    from hp_train.trainer import group_names

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    assert group_names(muon_with_adamw(model)) == ["muon", "adamw"]
    two = torch.optim.AdamW([{"params": [model[0].weight]}, {"params": [model[1].weight]}])
    assert group_names(two) == ["adamw_1", "adamw_2"]


@pytest.mark.multiprocess
def test_profile_memory_snapshot_and_wandb_through_the_command_line(tmp_path: Path) -> None:
    """``--profile 2 --memory-snapshot 3 --wandb``: a trace per rank of step 2 only, a memory
    measurement per rank of step 3 only, both named in the log, and an offline W&B run whose
    history holds every step's loss as metrics.jsonl has it."""
    from test_wandb_log import history

    out, console = tmp_path / "out", tmp_path / "console.txt"
    flags = ["--steps", "3", "--profile", "2", "--memory-snapshot", "3", "--wandb"]
    assert _hp_train(out, console, *flags) == 0, console.read_text()[-3000:]
    assert sorted(p.name for p in (out / "profile").iterdir()) == [
        "rank_0_step_2.json",
        "rank_1_step_2.json",
    ]
    assert sorted(p.name for p in (out / "memory").iterdir()) == [
        "rank_0_step_3.json",
        "rank_1_step_3.json",
    ]
    for rank in (0, 1):
        log = (out / "logs" / f"rank_{rank}.log").read_text()
        assert f"profile of step 2 on rank {rank} (trace " in log
        assert "aten::mm" in log
        assert re.search(r"step 3: memory: .*live tensors", log), log[-2000:]
        assert "step 2: memory" not in log
        assert "profile of step 3" not in log
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    logged = history(run_dir)
    records = read_metrics(out / "metrics.jsonl")
    assert sorted(logged) == [1, 2, 3]
    for r in records:
        assert logged[int(r["step"])]["train/loss"] == r["loss"]  # type: ignore[call-overload]

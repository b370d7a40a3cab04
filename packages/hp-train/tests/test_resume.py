"""Kill a rank mid-run, resume from the latest checkpoint: the same losses and state as a run
that was never interrupted; resume at another world size or layout.

The killed job and its rerun are launched with torchrun (``python -m torch.distributed.run``)
as a user would, in subprocesses. The other runs run the same command line's code
(``hp_train.config.cli.parse``, then ``train``) in the shared rank pool: a launch spends most of its
time importing torch into every rank, and the pool has done that once for the session."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hp_testing import run_on_ranks
from hp_testing.checkpoints import assert_identical, checkpoint_state
from hp_train.checkpoint.dcp import latest_checkpoint
from hp_train.config.cli import parse
from hp_train.observe.metrics import read_metrics
from hp_train.runtime import init_runtime
from hp_train.trainer import train

STEPS, EVERY = 14, 3
ARGS = [
    "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--tp", "2", "--data", "synthetic",
    "--global-batch", "4", "--seq-len", "16", "--quiet", "--threads", "1",
]  # fmt: skip
# Bounds on the largest |loss difference| of a run resumed in another layout from the run that
# saved the checkpoint, about 4x what was measured (torch 2.13, x86 CPU; both in the README).
# Muon: its bf16 Newton-Schulz rounds the fp32 differences of another reduction order
# (measured 4.1e-5).
OTHER_WORLD_SIZE_TOLERANCE = 1.5e-4
# AdamW: fp32 rounding only (measured 3.6e-7).
PIPELINED_RESUME_TOLERANCE = 1.5e-6


def _command(nproc: int, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", "hp_train", *ARGS, "--out", str(out), *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    # The packages under test are importable here; so are they for the ranks.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _losses(out: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines():
        record = json.loads(line)
        losses[int(record["step"])] = float(record["loss"])  # a resumed step overwrites
    return losses


def _run(nproc: int, out: Path, *extra: str) -> str:
    """Run to the end; returns what the job printed (rank 0 prints: the summary on stdout,
    its log on stderr)."""
    done = subprocess.run(
        _command(nproc, out, *extra), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _train_on_pool_rank(argv: list[str]) -> int:
    """What ``torchrun ... -m hp_train *argv`` runs on each rank, in the rank pool's process
    group (``hp_train.config.cli.main`` would destroy it at the end); returns the step it started
    at."""
    runtime = init_runtime("cpu", threads=1)
    model, parallel, config, options, _ = parse(argv, runtime.world_size)
    return train(model, parallel, config, options, runtime).first_step


def _run_in_pool(nproc: int, out: Path, *extra: str) -> int:
    """:func:`_run` in the rank pool; returns the step the run started at."""
    starts = run_on_ranks(
        nproc, _train_on_pool_rank, [*ARGS, "--out", str(out), *extra], timeout=300
    )
    assert len(set(starts)) == 1, starts
    return starts[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run of ``ARGS`` on 4 ranks (dp_shard 2 x tp 2) that nothing interrupts: the
    reference of the SIGKILL test and the checkpoint the world-size test resumes, run once for
    both."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert _run_in_pool(4, out) == 0
    return out


@pytest.mark.multiprocess
def test_resume_after_sigkill_of_one_rank(uninterrupted: Path, tmp_path: Path) -> None:
    """Rank 1 of 4 (dp_shard 2 x tp 2: parameters and optimizer state sharded over 2 ranks) is
    killed with SIGKILL mid-run and the job rerun with ``--resume``. The rerun starts at the
    latest complete checkpoint, not at step 0 (what it prints and the records it appends say
    so), skipping a later half-written one; its losses equal the uninterrupted run's bit for
    bit, and so does its last checkpoint, optimizer state included."""
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(4, killed), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    while _steps_logged(killed) < 2 * EVERY + 1 and proc.poll() is None:
        assert time.monotonic() < deadline, "the run did not reach the kill point"
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    pid = int((killed / "pids" / "rank_1.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    found = latest_checkpoint(killed / "checkpoints")
    assert found is not None
    killed_at, path = found
    last_saved = STEPS // EVERY * EVERY
    # A checkpoint left to write after the resume, so that the comparison of the last one
    # compares state the resumed run produced.
    assert 2 * EVERY <= killed_at < last_saved
    # A half-written checkpoint of a later step is never taken as the latest.
    (killed / "checkpoints" / f"step_{killed_at + EVERY:06d}.partial").mkdir()
    (killed / "checkpoints" / f"step_{killed_at + 2 * EVERY:06d}").mkdir()  # no .metadata
    assert latest_checkpoint(killed / "checkpoints") == found
    before = read_metrics(killed / "metrics.jsonl")

    printed = _run(4, killed, "--resume")
    records = read_metrics(killed / "metrics.jsonl")
    assert records[: len(before)] == before  # a resumed run appends
    resumed = records[len(before) :]
    assert [r["step"] for r in resumed] == list(range(killed_at + 1, STEPS + 1))  # 1-based
    # --quiet: the console shows warnings only; rank 0's log file has the rest.
    logged = (killed / "logs" / "rank_0.log").read_text()
    assert f"resumed from {path} (step {killed_at})" in logged
    assert f"{STEPS - killed_at} steps ({killed_at + 1}-{STEPS})" in printed
    want = _losses(uninterrupted)
    for record in resumed:
        step = record["step"]
        assert isinstance(step, int)
        assert record["loss"] == want[step], (step, record["loss"], want[step])
    name = f"step_{last_saved:06d}"
    assert_identical(
        checkpoint_state(killed / "checkpoints" / name, tmp_path / "resumed.pt"),
        checkpoint_state(uninterrupted / "checkpoints" / name, tmp_path / "reference.pt"),
    )


@pytest.mark.multiprocess
def test_resume_at_another_world_size(uninterrupted: Path, tmp_path: Path) -> None:
    """Saved by 4 ranks (dp_shard 2 x tp 2), resumed by 2 (tp 2): the resumed run starts at the
    copied checkpoint and its losses continue those of the 4-rank run within Muon's bf16
    rounding (another reduction order, so not bitwise)."""
    two = tmp_path / "two"
    saved = uninterrupted / "checkpoints" / f"step_{2 * EVERY:06d}"
    shutil.copytree(saved, two / "checkpoints" / saved.name)
    assert _run_in_pool(2, two, "--resume") == 2 * EVERY
    want, got = _losses(uninterrupted), _losses(two)
    assert sorted(got) == list(range(2 * EVERY + 1, STEPS + 1))  # metrics.jsonl: 1-based
    worst = max(abs(got[s] - want[s]) for s in got)
    print(f"4 -> 2 ranks: max |loss difference| = {worst:.3g} over steps {sorted(got)}")
    assert worst <= OTHER_WORLD_SIZE_TOLERANCE


@pytest.mark.multiprocess
def test_pipelined_checkpoint_resumes_with_other_data_and_tensor_sizes(tmp_path: Path) -> None:
    """Saved by pp 2 x tp 2, resumed by pp 2 x dp_shard 2: the resumed run starts at the copied
    checkpoint and its losses continue the first run's within AdamW's fp32 rounding; the same
    checkpoint refuses a run without pipelining, naming the saved pp."""
    first, second, flat = tmp_path / "pp_tp", tmp_path / "pp_dp", tmp_path / "flat"
    _run_in_pool(4, first, "--pp", "2", "--optimizer", "adamw")
    saved = first / "checkpoints" / f"step_{2 * EVERY:06d}"
    for out in (second, flat):
        shutil.copytree(saved, out / "checkpoints" / saved.name)
    dp_instead_of_tp = ("--pp", "2", "--tp", "1", "--optimizer", "adamw", "--resume")
    assert _run_in_pool(4, second, *dp_instead_of_tp) == 2 * EVERY
    want, got = _losses(first), _losses(second)
    assert sorted(got) == list(range(2 * EVERY + 1, STEPS + 1))  # metrics.jsonl: 1-based
    worst = max(abs(got[s] - want[s]) for s in got)
    print(f"pp2 x tp2 -> pp2 x dp2: max |loss difference| = {worst:.3g}")
    assert worst <= PIPELINED_RESUME_TOLERANCE
    # One process without torchrun: the refusal comes before any collective, and every
    # process spends seconds importing torch.
    flat_args = ["--out", str(flat), "--tp", "1", "--optimizer", "adamw", "--resume"]
    refused = subprocess.run(
        [sys.executable, "-m", "hp_train", *ARGS, *flat_args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert refused.returncode != 0
    assert "saved with pp=2" in refused.stderr
    assert "resume with --pp 2" in refused.stderr

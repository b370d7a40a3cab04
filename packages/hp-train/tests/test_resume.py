"""Kill a rank mid-run, resume from the latest checkpoint: the same losses as a run that was
never interrupted. Launched with torchrun (``python -m torch.distributed.run``) as a user
would, in subprocesses."""

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

from hp_train.checkpoint import latest_checkpoint

STEPS, EVERY = 14, 3
ARGS = [
    "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--tp", "2", "--data", "synthetic",
    "--global-batch", "4", "--seq-len", "16", "--quiet", "--threads", "1",
]  # fmt: skip


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


def _run(nproc: int, out: Path, *extra: str) -> None:
    done = subprocess.run(
        _command(nproc, out, *extra), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.multiprocess
def test_resume_after_sigkill_of_one_rank(tmp_path: Path) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    _run(2, reference)
    proc = subprocess.Popen(
        _command(2, killed), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
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
    killed_at = found[0]
    assert killed_at >= 2 * EVERY
    # A half-written checkpoint of a later step is never taken as the latest.
    (killed / "checkpoints" / f"step_{killed_at + EVERY:06d}.partial").mkdir()
    (killed / "checkpoints" / f"step_{killed_at + 2 * EVERY:06d}").mkdir()  # no .metadata
    assert latest_checkpoint(killed / "checkpoints") == found

    _run(2, killed, "--resume")
    want, got = _losses(reference), _losses(killed)
    assert sorted(got) == list(range(STEPS))
    for step in range(killed_at, STEPS):
        assert got[step] == want[step], (step, got[step], want[step])


@pytest.mark.multiprocess
def test_resume_at_another_world_size(tmp_path: Path) -> None:
    """Saved by 4 ranks (dp_shard 2 x tp 2), resumed by 2 (tp 2): the losses continue those of
    the 4-rank run within Muon's bf16 rounding (another reduction order, so not bitwise)."""
    four, two = tmp_path / "four", tmp_path / "two"
    _run(4, four)
    saved = four / "checkpoints" / f"step_{2 * EVERY:06d}"
    shutil.copytree(saved, two / "checkpoints" / saved.name)
    _run(2, two, "--resume")
    want, got = _losses(four), _losses(two)
    assert sorted(got) == list(range(2 * EVERY, STEPS))
    worst = max(abs(got[s] - want[s]) for s in got)
    print(f"4 -> 2 ranks: max |loss difference| = {worst:.3g} over steps {sorted(got)}")
    assert worst <= 2e-3


@pytest.mark.multiprocess
def test_pipelined_checkpoint_resumes_with_other_data_and_tensor_sizes(tmp_path: Path) -> None:
    """Saved by pp 2 x tp 2, resumed by pp 2 x dp_shard 2 (AdamW: fp32 rounding only); the
    same checkpoint refuses a run without pipelining, naming the saved pp."""
    first, second, flat = tmp_path / "pp_tp", tmp_path / "pp_dp", tmp_path / "flat"
    _run(4, first, "--pp", "2", "--optimizer", "adamw")
    saved = first / "checkpoints" / f"step_{2 * EVERY:06d}"
    for out in (second, flat):
        shutil.copytree(saved, out / "checkpoints" / saved.name)
    _run(4, second, "--pp", "2", "--tp", "1", "--optimizer", "adamw", "--resume")
    want, got = _losses(first), _losses(second)
    assert sorted(got) == list(range(2 * EVERY, STEPS))
    worst = max(abs(got[s] - want[s]) for s in got)
    print(f"pp2 x tp2 -> pp2 x dp2: max |loss difference| = {worst:.3g}")
    assert worst <= 1e-5
    refused = subprocess.run(
        _command(2, flat, "--optimizer", "adamw", "--resume"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert refused.returncode != 0
    assert "saved with pp=2" in refused.stderr
    assert "resume with --pp 2" in refused.stderr

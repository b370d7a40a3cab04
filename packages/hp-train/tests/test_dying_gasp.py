"""The dying gasp: SIGTERM or SIGINT makes every rank finish the same step, write a verified
checkpoint and exit with 128 + the signal; ``--resume`` then continues bit for bit. A second
signal ends the process at once. On the way, a worker killed with SIGKILL is restarted by
torchrun (``--max-restarts``) and the job continues from its in-memory snapshots.

The jobs are launched with torchrun as a user would: SIGTERM goes to one worker only (so the
ranks must agree on when to stop: the others never got it), SIGINT to torchrun (what Ctrl-C in
its terminal does; torchrun passes it on to the workers). The last resumed run and the
reference run the same command line's code in the rank pool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hp_testing import run_on_ranks
from hp_testing.checkpoints import assert_identical, checkpoint_state, job_env
from test_resume import _train_on_pool_rank

STEPS = 40
ARGS = [
    "--steps", str(STEPS), "--data", "synthetic", "--global-batch", "4", "--seq-len", "16",
    "--quiet", "--threads", "1", "--dropout", "0.1", "--checkpoint-every", str(STEPS),
]  # fmt: skip


def _launch(out: Path, *extra: str) -> subprocess.Popen[str]:
    """torchrun of ``hp_train`` on 2 ranks (``--max-restarts=N`` in ``extra`` goes to
    torchrun)."""
    launcher = [e for e in extra if e.startswith("--max-restarts")]
    extra = tuple(e for e in extra if e not in launcher)
    # A rank that stopped alone would leave the other in a collective: fail fast.
    env = job_env(HP_TRAIN_COLLECTIVE_TIMEOUT="30")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--monitor-interval=1", *launcher, "-m", "hp_train", *ARGS, "--out", str(out), *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_steps(out: Path, job: subprocess.Popen[str], steps: int) -> int:
    """Wait until the job has logged ``steps`` steps; the number logged."""
    deadline = time.monotonic() + 180
    while (done := _steps_done(out)) < steps:
        assert job.poll() is None, job.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the job did not reach the stop point"
        time.sleep(0.02)
    return done


def _stop_at(out: Path, job: subprocess.Popen[str], steps: int, stop: object) -> str:
    """Wait until the job has logged ``steps`` steps, call ``stop()``, return its output."""
    _wait_steps(out, job, steps)
    assert callable(stop)
    stop()
    printed, _ = job.communicate(timeout=120)
    return printed


def _losses(out: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[int(record["step"])] = float(record["loss"])
    return losses


def _stopped(printed: str, name: str) -> int:
    """The step the job says it stopped after, on ``name``."""
    marker = f"hp-train: stopped by {name} after step "
    lines = [line for line in printed.splitlines() if line.startswith(marker)]
    assert len(lines) == 1, printed[-3000:]
    return int(lines[0][len(marker) :].split(";")[0])


def assert_same_training(out: Path, reference: Path, steps: int, scratch: Path) -> None:
    """The run in ``out`` logged every step's loss equal to ``reference``'s, bit for bit (a
    step logged twice, before and after a restart, counts as its last record), and its
    checkpoint of ``steps`` holds the same state."""
    want, got = _losses(reference), _losses(out)
    assert sorted(got) == list(range(1, steps + 1))  # metrics.jsonl counts steps from 1
    assert got == want, [(s, got[s], want[s]) for s in got if got[s] != want[s]][:3]
    name = f"step_{steps:06d}"
    assert_identical(
        checkpoint_state(out / "checkpoints" / name, scratch / "got.pt"),
        checkpoint_state(reference / "checkpoints" / name, scratch / "want.pt"),
    )


@pytest.mark.multiprocess
def test_sigterm_to_one_rank_and_sigint_to_torchrun_checkpoint_and_resume(
    tmp_path: Path,
) -> None:
    """SIGTERM to rank 1 alone: both ranks stop after the same step (in every rank's log),
    rank 0 prints it with the checkpoint, every worker exits with 143, the checkpoint has its
    manifest. ``--resume`` under torchrun (``--max-restarts 1``, snapshots every step)
    continues from it; rank 0's worker is killed with SIGKILL a few steps later, and the
    restarted workers continue from the snapshots in memory; SIGINT to torchrun then stops the
    run the same way (130). A last ``--resume`` runs to the end: the losses of the whole run and
    its last checkpoint equal an uninterrupted run's bit for bit."""
    reference = tmp_path / "reference"
    run_on_ranks(2, _train_on_pool_rank, [*ARGS, "--out", str(reference)], timeout=300)
    out = tmp_path / "job"

    job = _launch(out)
    pid_file = out / "pids" / "rank_1.pid"
    printed = _stop_at(out, job, 6, lambda: os.kill(int(pid_file.read_text()), signal.SIGTERM))
    first = _stopped(printed, "SIGTERM")
    assert first >= 6
    assert "exitcode  : 143" in printed  # torchrun's report of the worker that got it
    for rank in (0, 1):
        log = (out / "logs" / f"rank_{rank}.log").read_text()
        assert f"stopped by SIGTERM after step {first}; wrote checkpoint" in log, rank
    assert (out / "checkpoints" / f"step_{first:06d}" / "manifest.json").is_file()
    assert _steps_done(out) == first

    shm = str(tmp_path / "snapshots")
    job = _launch(
        out, "--resume", "--max-restarts=1", "--snapshot-every", "1", "--snapshot-dir", shm
    )
    pid_file = out / "pids" / "rank_0.pid"
    killed_at = _wait_steps(out, job, first + 3)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    printed = _stop_at(out, job, killed_at + 8, lambda: job.send_signal(signal.SIGINT))
    second = _stopped(printed, "SIGINT")
    assert second >= killed_at + 8
    logged = (out / "logs" / "rank_0.log").read_text()
    assert f"recovery: step {first} from disk" in logged
    recovered = [
        line for line in logged.splitlines() if "from memory snapshots (own: 0, 1)" in line
    ]
    assert len(recovered) == 1, logged[-3000:]
    assert (out / "checkpoints" / f"step_{second:06d}" / "manifest.json").is_file()

    assert run_on_ranks(
        2, _train_on_pool_rank, [*ARGS, "--out", str(out), "--resume"], timeout=300
    ) == [second, second]
    assert_same_training(out, reference, STEPS, tmp_path)


_SIGNALS_SCRIPT = textwrap.dedent(
    """
    import importlib.util, os, signal, sys, time
    # The module alone (standard library only), without the package's imports of torch.
    spec = importlib.util.spec_from_file_location("signals", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    SAME_SIGNAL_S, StopSignals = module.SAME_SIGNAL_S, module.StopSignals

    previous = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        print("requested", stop.signum, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # the same request delivered twice
        time.sleep(0.05)
        print("still running", stop.signum, flush=True)
        time.sleep(SAME_SIGNAL_S + 0.1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second request: the process ends here
        time.sleep(5)
        print("not stopped", flush=True)
    """
)


def test_a_second_signal_ends_the_process_at_once() -> None:
    """The first signal is recorded, a repeat within ``SAME_SIGNAL_S`` is the same request,
    a later one ends the process by that signal."""
    import hp_train.recovery.signals as module

    done = subprocess.run(
        [sys.executable, "-c", _SIGNALS_SCRIPT, str(module.__file__)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.splitlines() == [
        f"requested {int(signal.SIGINT)}",
        f"still running {int(signal.SIGINT)}",
    ], done.stdout + done.stderr
    assert done.returncode == -signal.SIGTERM


def test_handlers_are_restored_on_exit() -> None:
    from hp_train.recovery.signals import StopSignals

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with StopSignals():
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in before} == before

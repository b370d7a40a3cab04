"""Elastic restart from in-memory snapshots, end to end: two torchrun agents on this machine
play two hosts of one rank each (FSDP over the two; c10d rendezvous, each agent its own
snapshot folder), with ``--max-restarts`` and ``--resume-if-present`` as a user would launch a
job that restarts.

1. Host A's worker is killed with SIGKILL at a random step: torchrun restarts the job and
   every rank takes its own snapshot from its host's folder.
2. Later, host B is lost whole (its agent and its worker killed with SIGKILL, its snapshot
   folder wiped) and a new agent takes its place: B's rank takes the replica its buddy on
   host A kept, sent over the process group.

The job's losses and its last checkpoint equal those of a run that nothing interrupted, bit
for bit (dropout on, so the random generators' states must come back too).

The agents run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch otherwise serves the
workers' store from the first round's rank-0 agent and does not move it when that agent is
lost (the README's fault-recovery section says why).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hp_testing import run_on_ranks
from hp_testing.checkpoints import job_env
from test_dying_gasp import assert_same_training
from test_resume import _train_on_pool_rank

STEPS = 30
ARGS = [
    "--steps", str(STEPS), "--data", "synthetic", "--global-batch", "4",
    "--seq-len", "16", "--quiet", "--threads", "1", "--dropout", "0.1",
    "--checkpoint-every", str(STEPS),
]  # fmt: skip
ELASTIC = ["--snapshot-every", "1", "--resume-if-present"]
# A lost agent leaves the rendezvous when it has missed its keep-alives: 2 of 1 s each, rather
# than torch's default 3 of 5 s, so that the new round starts within seconds.
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=2"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _agent(out: Path, port: int, folder: Path, log: Path) -> subprocess.Popen[bytes]:
    env = job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
        "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
        f"elastic-{port}", "--rdzv-conf", RDZV_CONF, "--max-restarts", "3",
        "--monitor-interval", "0.5", "-m", "hp_train", *ARGS, *ELASTIC, "--out", str(out),
        "--snapshot-dir", str(folder),
    ]  # fmt: skip
    with log.open("ab") as sink:
        return subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)


def _steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for(out: Path, steps: int, agents: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 240
    while _steps_done(out) < steps:
        assert all(a.poll() is None for a in agents), "an agent ended early"
        assert time.monotonic() < deadline, f"the job did not reach step {steps}"
        time.sleep(0.05)


def _workers_of(out: Path, folder: Path) -> list[int]:
    """The pids of the workers whose command line names ``folder`` (the host's ranks)."""
    pids = []
    for pid_file in (out / "pids").glob("rank_*.pid"):
        pid = int(pid_file.read_text())
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(folder).encode() in command:
            pids.append(pid)
    return pids


def _recoveries(out: Path) -> list[str]:
    return [
        line.split("hp_train: ", 1)[1]
        for line in (out / "logs" / "rank_0.log").read_text().splitlines()
        if "recovery: step" in line
    ]


@pytest.mark.multiprocess
def test_sigkill_and_host_loss_recover_from_memory_bit_for_bit(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert (
        run_on_ranks(2, _train_on_pool_rank, [*ARGS, "--out", str(reference)], timeout=300)
        == [0] * 2
    )
    out, port = tmp_path / "job", _free_port()
    host_a, host_b = tmp_path / "shm_a", tmp_path / "shm_b"
    logs = [tmp_path / "agent_a.log", tmp_path / "agent_b.log"]
    agent_a = _agent(out, port, host_a, logs[0])
    time.sleep(1.0)  # agent A hosts the rendezvous
    agent_b = _agent(out, port, host_b, logs[1])
    try:
        kill_at = random.Random().randint(4, 12)
        _wait_for(out, kill_at, [agent_a, agent_b])
        victim = _workers_of(out, host_a)[0]
        os.kill(victim, signal.SIGKILL)
        _wait_for(out, 20, [agent_a, agent_b])
        assert len(_recoveries(out)) == 1, _recoveries(out)
        agent_b.kill()
        for pid in _workers_of(out, host_b):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(host_b)
        agent_b.wait(timeout=30)
        agent_b = _agent(out, port, host_b, logs[1])
        assert agent_a.wait(timeout=300) == 0, logs[0].read_text()[-3000:]
        assert agent_b.wait(timeout=60) == 0, logs[1].read_text()[-3000:]
    finally:
        for agent in (agent_a, agent_b):
            if agent.poll() is None:
                agent.kill()
    first, second = _recoveries(out)
    assert "from memory snapshots (own: 0, 1)" in first, (kill_at, first)
    assert "buddy replicas:" in second, second
    assert "from memory snapshots" in second, second
    assert_same_training(out, reference, STEPS, tmp_path)

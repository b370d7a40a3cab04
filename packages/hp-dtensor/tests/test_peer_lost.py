"""A rank killed mid-collective: the others name it as gone at once, and blame no live rank.

A fresh job of three gloo processes (a rank pool's group would be left broken) with a long
timeout (60 s, standing for the 30-minute default), running thousands of small all-reduces, so
that the counts the ranks publish (once a period) lag their real counts by hundreds. Rank 1
SIGKILLs itself before one of them. Ranks 0 and 2 must raise
:class:`hp_dtensor.watchdog.PeerLostError` within seconds, naming rank 1 as exited and no other
rank, not a timeout blaming the live ranks from their stale counts (as before this test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_dtensor import collectives, init_device_mesh
from hp_dtensor._peer_reports import identity, process_state
from hp_dtensor.watchdog import CollectiveError
from hp_testing.fresh_job import run_fresh_job

TIMEOUT_S = 60.0
KILLED = 1
KILL_AT = 1500  # rank 1 dies before its all-reduce number KILL_AT
ROUNDS = 4000
# From the kill to the survivors' errors: the backend notices at once; the diagnosis reads
# the store and /proc. Generous for a loaded machine, far below the timeout.
DIAGNOSIS_S = 10.0
JOB_DEADLINE_S = 90.0


def _all_reduces_until_rank_1_dies(rank: int, world: int, out: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("x",), timeout_s=TIMEOUT_S)
    x = torch.ones(2)
    done = 0
    try:
        for n in range(1, ROUNDS + 1):
            if rank == KILLED and n == KILL_AT:
                (Path(out) / "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            collectives.all_reduce(x, mesh, "x")
            done = n
    except CollectiveError as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "gone": list(getattr(exc, "gone", [])),
            "done": done,
            "failed_at": time.time(),
        }
    return {"error": None, "done": done}


@pytest.mark.multiprocess
def test_a_killed_rank_is_named_as_gone_and_no_live_rank_is_blamed(tmp_path: Path) -> None:
    survivors = [0, 2]
    exits: dict[int, int | None] = {}
    reports = run_fresh_job(
        3,
        _all_reduces_until_rank_1_dies,
        str(tmp_path),
        report=survivors,
        deadline_s=JOB_DEADLINE_S,
        exit_codes=exits,
    )
    assert exits[KILLED] == -signal.SIGKILL
    killed_at = float((tmp_path / "killed_at").read_text())
    for rank in survivors:
        seen = reports[rank]
        assert seen["error"] == "PeerLostError", seen
        assert seen["gone"] == [KILLED], seen["message"]
        message = seen["message"]
        assert message.startswith("all_reduce over group 'world' (axis 'x') (ranks [0, 1, 2])")
        assert f"rank {KILLED} exited while the group was in it" in message, message
        assert "did not arrive" not in message, message
        assert "timeout" not in message, message
        other = 2 - rank
        assert f"rank {other}: exited" not in message, message
        # It failed where rank 1 died, not a timeout later.
        assert seen["done"] == KILL_AT - 1, seen
        assert seen["failed_at"] <= killed_at + DIAGNOSIS_S


def test_process_state_sees_this_host_only() -> None:
    me = identity()
    assert process_state(me) == "running"
    assert process_state({**me, "start": (me["start"] or 0) + 1}) == "exited"  # pid reused
    assert process_state({**me, "host": "elsewhere/0"}) == "unknown"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    stat = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
    report = {**me, "pid": child.pid, "start": int(stat[19])}
    assert process_state(report) == "running"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
        if stat[0] == "Z":  # exited, not yet reaped by its parent (this process)
            break
        time.sleep(0.01)
    assert stat[0] == "Z"
    assert process_state(report) == "exited"
    child.wait()
    assert process_state(report) == "exited"

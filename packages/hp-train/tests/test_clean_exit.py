"""A job's teardown frees its process groups before the interpreter finalizes.

A gloo backend runs collectives on worker threads. A worker that drops the last reference to a
tensor whose Python object is already gone has to take the GIL; during finalization Python ends
such a thread inside a C++ destructor, and the rank aborts after correct work ("terminate
called without an active exception", SIGABRT: torchrun exits 1). Freeing a backend joins its
workers first, so :func:`hp_train.runtime.release_process_groups` (and :func:`shutdown`, which
calls it after a barrier) must leave no group alive and no thread but the main one.

The oracle is the operating system's count of the process's threads (``/proc/self/task``),
measured in a fresh process, not anything the code under test reports; each case runs in a
subprocess so that the test's own rank pool is untouched.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)"
)

# One rank of a torchrun-like job (the env:// variables set by the test): the default group,
# a sub-group, collectives on both whose tensors die at once (the pattern that leaves a worker
# holding the last reference) and a garbage cycle holding the sub-group (as a model and its
# sharding state do). Modes: "torch" calls release_process_groups; "hp_dtensor" also builds a
# mesh and runs watched collectives first (hp_dtensor's tables hold the groups too);
# "shutdown" calls shutdown instead; "held" keeps a reference to the sub-group. It prints the
# thread counts (before the job, with the groups running, after the release) and how many
# groups the release reports still referenced (-1: shutdown reports none).
_CHILD = r"""
import json, os, sys

import torch
import torch.distributed as dist

mode = sys.argv[1]
torch.ones(2).sum()  # torch's own threads, if any, start before the first count


def threads():
    return len(os.listdir("/proc/self/task"))


before = threads()
from hp_train.runtime import init_runtime, release_process_groups, shutdown

init_runtime("cpu", threads=1)
sub = dist.new_group([0])


class Holder:
    pass


holder = Holder()
holder.me, holder.group = holder, sub
del holder
for group in (None, sub):
    for _ in range(20):
        dist.all_reduce(torch.ones(8), group=group)
kept = sub if mode == "held" else None
del group, sub
if mode == "hp_dtensor":
    from hp_dtensor import collectives, init_device_mesh

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    for _ in range(20):
        collectives.all_reduce(torch.ones(8), mesh, "dp")
    del mesh
running = threads()
if mode == "shutdown":
    shutdown()
    left = -1
else:
    left = release_process_groups()
print(json.dumps({"before": before, "running": running, "after": threads(), "left": left}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run_child(mode: str) -> dict[str, int]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return counts


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["torch", "hp_dtensor", "shutdown"])
def test_release_leaves_no_group_and_no_thread_but_the_main_one(mode: str) -> None:
    """After the release (or shutdown), the process has the threads it had before the job
    (gloo's workers, its transport loop and the store's thread all joined) and no group is
    referenced."""
    counts = _run_child(mode)
    # gloo started threads (else the check below would prove nothing).
    assert counts["running"] > counts["before"], counts
    assert counts["after"] == counts["before"], counts
    assert counts["left"] in (0, -1), counts


@pytest.mark.multiprocess
def test_release_counts_a_group_the_caller_still_holds() -> None:
    """A group the caller still references outlives the release, with its threads, and the
    release says so: one group left."""
    counts = _run_child("held")
    assert counts["left"] == 1, counts
    assert counts["after"] > counts["before"], counts

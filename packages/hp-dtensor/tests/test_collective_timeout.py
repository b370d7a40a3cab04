"""A rank that never joins a collective: the others raise CollectiveTimeoutError in time.

Each job is a fresh set of gloo processes (a rank pool's group would be left broken): one rank
skips a collective the others enter, and the others must raise
:class:`hp_dtensor.watchdog.CollectiveTimeoutError` within the timeout plus a margin, naming
the collective, the group and the rank that did not arrive. The ranks write what they saw to
one JSON file each; the test reads them and then kills the processes (the rank that skipped
waits forever, as a stuck rank would).

World 2: the mesh axis is the default group (``init_device_mesh(timeout_s=...)`` gives it the
timeout). World 4: a four-rank group in another rank order, then one axis of a 2 x 2 mesh:
groups hp_dtensor creates, which torch would give 30 minutes unless told otherwise.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh, collectives, init_device_mesh, watchdog
from hp_dtensor.watchdog import CollectiveTimeoutError
from hp_layout import Mesh

TIMEOUT_S = 2.0
# Raising may lag the timeout by a diagnosis (a few store reads) and a loaded machine's jitter.
MARGIN_S = 1.5
# How long the test waits for all the reports (the processes start, import torch, then wait
# out one timeout per scenario).
JOB_DEADLINE_S = 60.0
SKIPPER = 1
SKIPPED = 3  # the number of the collective the skipping rank leaves out (1-based)
ROUNDS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _outcome(call: Any) -> dict[str, Any]:
    """Run ``call``; what happened, as JSON-friendly data."""
    started = time.monotonic()
    try:
        call()
    except CollectiveTimeoutError as exc:
        return {
            "error": "CollectiveTimeoutError",
            "message": str(exc),
            "missing": list(exc.missing),
            "collective": exc.collective,
            "group": exc.group,
            "elapsed": time.monotonic() - started,
        }
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:2000]}
    return {"error": None, "elapsed": time.monotonic() - started}


def _rounds(mesh: DeviceMesh, axis: str, skip: bool, op: str) -> None:
    """``ROUNDS`` collectives over ``axis``; the skipping rank leaves out number ``SKIPPED``."""
    x = torch.ones(4)
    for n in range(1, ROUNDS + 1):
        if skip and n == SKIPPED:
            continue
        if op == "all_reduce":
            collectives.all_reduce(x, mesh, axis)
        else:
            collectives.all_gather(x, 0, mesh, axis)


def _write(out: Path, rank: int, results: dict[str, Any]) -> None:
    path = out / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(results))
    path.with_suffix(".tmp").rename(path)


def _sleep_forever() -> None:
    while True:
        time.sleep(60)


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    if world == 2:
        # The axis is the default group: init_device_mesh gives it the timeout.
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",), timeout_s=TIMEOUT_S)
        results["world"] = _outcome(lambda: _rounds(mesh, "x", rank == SKIPPER, "all_reduce"))
        _write(Path(out), rank, results)
        _sleep_forever()
    # The default group gets a long timeout (it only synchronizes the scenarios); the groups
    # under test are created by hp_dtensor after configure, with the short one.
    dist.init_process_group("gloo", timeout=timedelta(seconds=JOB_DEADLINE_S))
    # Off, new groups inherit the default group's timeout (torch would give them 30 minutes).
    inherited = watchdog.group_timeout()
    results["inherited_s"] = None if inherited is None else inherited.total_seconds()
    watchdog.configure(TIMEOUT_S)
    permuted = DeviceMesh("cpu", Mesh((4,), ("ring",), (0, 2, 1, 3)))
    results["permuted"] = _outcome(lambda: _rounds(permuted, "ring", rank == SKIPPER, "all_reduce"))
    dist.barrier()
    grid = DeviceMesh("cpu", Mesh((2, 2), ("a", "b")))
    grid.get_group("b")  # created collectively, before the skipping rank goes quiet
    if rank == SKIPPER:
        _write(Path(out), rank, results)
        _sleep_forever()  # never joins its first collective over 'b'
    results["grid"] = _outcome(lambda: _rounds(grid, "b", False, "all_gather"))
    _write(Path(out), rank, results)
    _sleep_forever()


def _run_job(world: int, out: Path) -> dict[int, dict[str, Any]]:
    """Start ``world`` ranks; wait for every rank's report; kill them all."""
    # Forked from a server that imported torch and hp_dtensor once (a fresh interpreter per
    # rank would import them again, seconds each), and single-threaded, unlike pytest.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "hp_dtensor", __name__])
    port = _free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, world, port, str(out)), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + JOB_DEADLINE_S
    try:
        while not all((out / f"rank{r}.json").exists() for r in range(world)):
            dead = [r for r, p in enumerate(processes) if p.exitcode is not None]
            assert not dead, f"ranks {dead} exited before reporting"
            assert time.monotonic() < deadline, "the job hung: no report within the deadline"
            time.sleep(0.05)
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.join(timeout=10)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(world)}


def _check_timeout(seen: dict[str, Any], collective: str, group: str) -> None:
    assert seen["error"] == "CollectiveTimeoutError", seen
    assert seen["missing"] == [SKIPPER], seen["message"]
    assert seen["collective"] == collective
    message = seen["message"]
    assert message.startswith(f"{collective} over group {group} did not complete"), message
    assert f"rank {SKIPPER} of the group did not arrive" in message, message
    assert f"{TIMEOUT_S:g} s timeout" in message
    assert seen["elapsed"] <= TIMEOUT_S + MARGIN_S, seen


@pytest.mark.multiprocess
def test_world_2_names_the_rank_that_skipped(tmp_path: Path) -> None:
    """World 2, the axis is the default group: rank 1 skips its third all_reduce (its fourth
    pairs with rank 0's third), so rank 0's fifth never completes; rank 0 raises within the
    timeout naming all_reduce, the group 'x' = world (ranks [0, 1]) and rank 1."""
    reports = _run_job(2, tmp_path)
    seen = reports[0]["world"]
    _check_timeout(seen, "all_reduce", "'world' (axis 'x') (ranks [0, 1])")
    assert "rank 1: its last collective over this group was #4 all_reduce" in seen["message"]
    assert "now outside any watched collective" in seen["message"]
    # The skipping rank ran one collective fewer, all of them paired with rank 0's.
    assert reports[1]["world"]["error"] is None


@pytest.mark.multiprocess
def test_world_4_names_the_rank_that_skipped(tmp_path: Path) -> None:
    """World 4. A group of all four ranks in another order: rank 1 skips one all_reduce, the
    three others raise naming it. Then axis 'b' of a 2 x 2 mesh (groups [0, 1] and [2, 3]):
    rank 1 never comes; rank 0 raises naming it, ranks 2 and 3 finish untouched."""
    reports = _run_job(4, tmp_path)
    assert reports[0]["inherited_s"] == JOB_DEADLINE_S
    for rank in (0, 2, 3):
        _check_timeout(reports[rank]["permuted"], "all_reduce", "'ring' (ranks [0, 2, 1, 3])")
    assert reports[SKIPPER]["permuted"]["error"] is None
    _check_timeout(reports[0]["grid"], "all_gather", "'b' (ranks [0, 1])")
    assert "rank 1: its last collective over this group was none" in reports[0]["grid"]["message"]
    for rank in (2, 3):
        assert reports[rank]["grid"]["error"] is None, reports[rank]["grid"]

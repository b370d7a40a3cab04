"""A rank that never joins a collective: the others raise CollectiveTimeoutError in time.

Each job is a fresh set of gloo processes (a rank pool's group would be left broken): one rank
skips a collective the others enter, and the others must raise
:class:`hp_dtensor.watchdog.CollectiveTimeoutError` within the timeout plus a margin, naming
the collective, the group and the rank that did not arrive. Each rank returns what it saw
(:func:`hp_testing.fresh_job.run_fresh_job`), then stays in the group until the test has every
result and kills the processes (the rank that skipped waits forever, as a stuck rank would).

World 2: the mesh axis is the default group (``init_device_mesh(timeout_s=...)`` gives it the
timeout). World 4: a four-rank group in another rank order, then one axis of a 2 x 2 mesh:
groups hp_dtensor creates, which torch would give 30 minutes unless told otherwise.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh, collectives, init_device_mesh, watchdog
from hp_layout import Mesh
from hp_testing.fresh_job import outcome, run_fresh_job

TIMEOUT_S = 2.0
# Raising may lag the timeout by a diagnosis (a few store reads) and a loaded machine's jitter.
MARGIN_S = 1.5
# How long the test waits for all the reports (the processes start, import torch, then wait
# out one timeout per scenario).
JOB_DEADLINE_S = 60.0
SKIPPER = 1
SKIPPED = 3  # the number of the collective the skipping rank leaves out (1-based)
ROUNDS = 5


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


def _rank_main(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    if world == 2:
        # The axis is the default group: init_device_mesh gives it the timeout.
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",), timeout_s=TIMEOUT_S)
        results["world"] = outcome(lambda: _rounds(mesh, "x", rank == SKIPPER, "all_reduce"))
        return results
    # The default group gets a long timeout (it only synchronizes the scenarios); the groups
    # under test are created by hp_dtensor after configure, with the short one.
    dist.init_process_group("gloo", timeout=timedelta(seconds=JOB_DEADLINE_S))
    # Off, new groups inherit the default group's timeout (torch would give them 30 minutes).
    inherited = watchdog.group_timeout()
    results["inherited_s"] = None if inherited is None else inherited.total_seconds()
    watchdog.configure(TIMEOUT_S)
    permuted = DeviceMesh("cpu", Mesh((4,), ("ring",), (0, 2, 1, 3)))
    results["permuted"] = outcome(lambda: _rounds(permuted, "ring", rank == SKIPPER, "all_reduce"))
    dist.barrier()
    grid = DeviceMesh("cpu", Mesh((2, 2), ("a", "b")))
    grid.get_group("b")  # created collectively, before the skipping rank goes quiet
    if rank == SKIPPER:
        return results  # and never joins its first collective over 'b'
    results["grid"] = outcome(lambda: _rounds(grid, "b", False, "all_gather"))
    return results


def _run_job(world: int) -> dict[int, dict[str, Any]]:
    """Start ``world`` fresh ranks; every rank's results (the skipping one waits forever)."""
    return run_fresh_job(world, _rank_main, deadline_s=JOB_DEADLINE_S)


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
def test_world_2_names_the_rank_that_skipped() -> None:
    """World 2, the axis is the default group: rank 1 skips its third all_reduce (its fourth
    pairs with rank 0's third), so rank 0's fifth never completes; rank 0 raises within the
    timeout naming all_reduce, the group 'x' = world (ranks [0, 1]) and rank 1."""
    reports = _run_job(2)
    seen = reports[0]["world"]
    _check_timeout(seen, "all_reduce", "'world' (axis 'x') (ranks [0, 1])")
    assert "rank 1: its last collective over this group was #4 all_reduce" in seen["message"]
    assert "now outside any watched collective" in seen["message"]
    # The skipping rank ran one collective fewer, all of them paired with rank 0's.
    assert reports[1]["world"]["error"] is None


@pytest.mark.multiprocess
def test_world_4_names_the_rank_that_skipped() -> None:
    """World 4. A group of all four ranks in another order: rank 1 skips one all_reduce, the
    three others raise naming it. Then axis 'b' of a 2 x 2 mesh (groups [0, 1] and [2, 3]):
    rank 1 never comes; rank 0 raises naming it, ranks 2 and 3 finish untouched."""
    reports = _run_job(4)
    assert reports[0]["inherited_s"] == JOB_DEADLINE_S
    for rank in (0, 2, 3):
        _check_timeout(reports[rank]["permuted"], "all_reduce", "'ring' (ranks [0, 2, 1, 3])")
    assert reports[SKIPPER]["permuted"]["error"] is None
    _check_timeout(reports[0]["grid"], "all_gather", "'b' (ranks [0, 1])")
    assert "rank 1: its last collective over this group was none" in reports[0]["grid"]["message"]
    for rank in (2, 3):
        assert reports[rank]["grid"]["error"] is None, reports[rank]["grid"]

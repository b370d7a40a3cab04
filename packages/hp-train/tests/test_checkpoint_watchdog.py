"""Every collective of hp-train's checkpoint code is watched, under a name that says which.

A rank that never joins one of them used to leave the others with gloo's bare "Timed out
waiting 3000ms"; inside :func:`hp_dtensor.watchdog.watch` the others raise
:class:`~hp_dtensor.watchdog.CollectiveTimeoutError` naming the checkpoint step.

Two tests at world 2: in the rank pool, a save, a verification, a listing and a load, with
torch's collective functions wrapped to note whether each call is inside a watch (every one
must be), and the names watched; in a fresh job (a pool's group would be left broken) with a
3 s timeout, rank 1 stalls before the verification's gather and rank 0 must raise the error
naming it.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import watchdog
from hp_dtensor.watchdog import CollectiveTimeoutError
from hp_testing import run_on_ranks
from hp_testing.fresh_job import run_fresh_job
from hp_train import objects
from hp_train.checkpoint import dcp

#: The collective functions of ``torch.distributed`` that hp-train's checkpoint code and
#: torch's DCP call (DCP's ``_DistWrapper`` calls them through the module, so a wrapper set on
#: it sees every call).
_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
)
#: What a save, a verification, a listing and a load watch, in order (written out here, not
#: read from the code).
WATCHED = [
    "checkpoint save start broadcast",
    "checkpoint save (torch DCP)",
    "checkpoint save text files broadcast",
    "checkpoint manifest file list broadcast",
    "checkpoint manifest hash gather",
    "checkpoint manifest write broadcast",
    "checkpoint save rename broadcast",
    "checkpoint verify manifest broadcast",
    "checkpoint verify gather",
    "checkpoint list broadcast",
    "checkpoint load metadata broadcast",
    "checkpoint load (torch DCP)",
    "checkpoint load agreement gather",
]
TIMEOUT_S = 3.0
# The fresh job: start (importing torch in a fork server), a save, then one timeout.
JOB_DEADLINE_S = 90.0


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _save_verify_list_load(root: Path) -> None:
    model, optimizer = _model()
    path = dcp.save_checkpoint(root, 1, model, optimizer, files={"note.txt": "text"})
    assert dcp.verify_checkpoint(path).ok
    assert dcp.list_checkpoints(root).checkpoints == (path,)
    assert dcp.load_checkpoint(path, model, optimizer) == 1


def _calls_inside_watches(root: str) -> tuple[list[str], list[tuple[str, bool]]]:
    """The names watched and each collective call (function, inside a watch?) on this rank."""
    watched: list[str] = []
    calls: list[tuple[str, bool]] = []
    depth = [0]
    real_watch = getattr(dcp, "watch")  # noqa: B009 - not exported: the name dcp.py calls

    @contextlib.contextmanager
    def watch(name: str, group: Any = None) -> Iterator[None]:
        watched.append(name)
        depth[0] += 1
        try:
            with real_watch(name, group):
                yield
        finally:
            depth[0] -= 1

    def noting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, depth[0] > 0))
            return real(*args, **kwargs)

        return call

    reals = {name: getattr(dist, name) for name in _COLLECTIVES}
    # dcp.py's own collectives, and the object exchanges it calls hp_train.objects for.
    for module in (dcp, objects):
        setattr(module, "watch", watch)  # noqa: B010
    for name, real in reals.items():
        setattr(dist, name, noting(name, real))
    try:
        _save_verify_list_load(Path(root))
    finally:
        for module in (dcp, objects):
            setattr(module, "watch", real_watch)  # noqa: B010
        for name, real in reals.items():
            setattr(dist, name, real)
    return watched, calls


@pytest.mark.multiprocess
def test_every_checkpoint_collective_is_watched_by_name(tmp_path: Path) -> None:
    for watched, calls in run_on_ranks(2, _calls_inside_watches, str(tmp_path), timeout=120):
        assert watched == WATCHED
        assert calls, "no collective seen: the wrappers missed them"
        assert [c for c in calls if not c[1]] == [], calls


# ----------------------------------------------------------------------- a stalled rank
def _verify_with_rank_1_stalled(rank: int, world: int, out: str) -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    watchdog.configure(TIMEOUT_S)

    def stall(collective: str, group: str, number: int) -> None:
        if rank == 1 and collective == "checkpoint verify gather":
            (Path(out) / "rank1_stalled.json").write_text(json.dumps({"stalled": collective}))
            while True:
                time.sleep(60)

    watchdog.set_entry_hook(stall)
    model, optimizer = _model()
    started = time.monotonic()
    try:
        path = dcp.save_checkpoint(Path(out) / "checkpoints", 1, model, optimizer)
        started = time.monotonic()
        dcp.verify_checkpoint(path)
    except CollectiveTimeoutError as exc:
        return {
            "error": "CollectiveTimeoutError",
            "collective": exc.collective,
            "missing": list(exc.missing),
            "message": str(exc),
            "elapsed": time.monotonic() - started,
        }
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:2000]}
    return {"error": None}


@pytest.mark.multiprocess
def test_a_rank_stalled_before_the_verify_gather_is_named(tmp_path: Path) -> None:
    """Rank 1 never enters the verification's gather: rank 0 raises CollectiveTimeoutError
    at the timeout naming the checkpoint collective, its group and rank 1."""
    reports = run_fresh_job(
        2, _verify_with_rank_1_stalled, str(tmp_path), report=[0], deadline_s=JOB_DEADLINE_S
    )
    seen = [reports[0], json.loads((tmp_path / "rank1_stalled.json").read_text())]
    assert seen[1] == {"stalled": "checkpoint verify gather"}
    assert seen[0]["error"] == "CollectiveTimeoutError", seen[0]
    assert seen[0]["collective"] == "checkpoint verify gather"
    assert seen[0]["missing"] == [1]
    message = seen[0]["message"]
    assert message.startswith(
        "checkpoint verify gather over group 'world' (ranks [0, 1]) did not complete within "
        f"the {TIMEOUT_S:g} s timeout"
    ), message
    assert "rank 1 of the group did not arrive" in message, message
    assert seen[0]["elapsed"] <= TIMEOUT_S + 2.0, seen[0]

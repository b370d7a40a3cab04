"""A job of fresh gloo processes for tests that break the process group (a stall, a kill).

The shared rank pool (:func:`hp_testing.run_on_ranks`) cannot host a test whose collective
times out or whose rank dies: the pool's group would be left broken for every later test.
:func:`run_fresh_job` starts ``world`` processes instead, forked from a server that imported
torch and the test's module once (a fresh interpreter per rank would import them again,
seconds each), single-threaded. Each rank runs ``target(rank, world, *args)`` after the
``env://`` variables are set (the target creates its process group: it chooses the timeout),
and writes what it returns (JSON data) to a file; a rank that never returns (the one that
stalls) is killed once the others have reported.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["never_returns", "outcome", "run_fresh_job"]

Target = Callable[..., dict[str, Any]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def never_returns(*args: Any, **kwargs: Any) -> None:
    """Block forever, whatever the arguments: put in place of a collective on the rank that
    should stall (``dist.all_to_all_single = never_returns``), as a rank that never joins."""
    while True:
        time.sleep(60)


def outcome(call: Callable[[], object]) -> dict[str, Any]:
    """Run ``call``; what happened as JSON data: ``error`` (the exception's type name, or
    None), ``message``, ``elapsed`` (seconds), and the exception's public attributes that
    are JSON data (``missing``, ``gone``, ``collective``, ...)."""
    started = time.monotonic()
    try:
        call()
    except Exception as exc:
        attributes = {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in vars(exc).items()
            if not k.startswith("_") and isinstance(v, str | int | float | tuple | list)
        }
        return {
            **attributes,
            "error": type(exc).__name__,
            "message": str(exc)[:4000],
            "elapsed": time.monotonic() - started,
        }
    return {"error": None, "elapsed": time.monotonic() - started}


def _rank_main(target: Target, rank: int, world: int, port: int, out: str, args: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    result = target(rank, world, *args)
    path = Path(out) / f"rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").rename(path)
    while True:  # stay in the group until the test has every report, then get killed
        time.sleep(60)


def run_fresh_job(
    world: int,
    target: Target,
    *args: Any,
    report: Sequence[int] | None = None,
    deadline_s: float = 90.0,
    exit_codes: dict[int, int | None] | None = None,
) -> dict[int, dict[str, Any]]:
    """Run ``target(rank, world, *args)`` on ``world`` fresh processes; return the results of
    the ranks in ``report`` (default: every rank) once each has written one, then kill all.
    ``exit_codes``, when given, is filled with each rank's exit code as it stood when the
    results were in (None: still running then), for a test that kills a rank on purpose.

    ``target`` must be a module-level function of an importable module (the fork server
    imports it by name). Raises AssertionError when a reporting rank exits without a result
    or the results are not all in within ``deadline_s``.
    """
    wanted = list(range(world) if report is None else report)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", target.__module__])
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="hp_fresh_job_") as out:
        processes = [
            context.Process(
                target=_rank_main, args=(target, rank, world, port, out, args), daemon=True
            )
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + deadline_s
        try:
            while not all((Path(out) / f"rank{r}.json").exists() for r in wanted):
                dead = [
                    r
                    for r in wanted
                    if processes[r].exitcode is not None
                    and not (Path(out) / f"rank{r}.json").exists()
                ]
                assert not dead, (
                    f"ranks {dead} exited without a result "
                    f"(exit codes {[processes[r].exitcode for r in dead]})"
                )
                assert time.monotonic() < deadline, (
                    f"no result from every rank of {wanted} within {deadline_s} s"
                )
                time.sleep(0.05)
            if exit_codes is not None:
                exit_codes.update({r: p.exitcode for r, p in enumerate(processes)})
        finally:
            for process in processes:
                process.kill()
            for process in processes:
                process.join(timeout=10)
        return {r: json.loads((Path(out) / f"rank{r}.json").read_text()) for r in wanted}

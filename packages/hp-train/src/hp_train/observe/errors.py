"""How the ranks of a job report an error the user can fix: once on the console, in every
rank's log, and before any rank exits.

Under torchrun, the first rank to exit with an error makes the agent stop the others. A rank
that exits at once can therefore kill the one that was about to print the message, and the job
ends with no message at all. :func:`report_error` prevents this through torchrun's key-value
store, which works even when no process group exists yet:

1. Every rank that hits an error writes its message under its rank and counts itself in.
2. It waits up to ``grace_s`` for the other ranks to count in. A configuration error is found by
   every rank; an error only some ranks hit leaves the others in their collectives, and the
   grace period ends the wait.
3. The first rank past its wait claims the printing (an atomic counter of the store) and prints
   the distinct messages reported so far: one line ``hp-train: <message>``, or one line per
   distinct message naming its ranks. It then marks them printed.
4. Every other reporting rank returns only once they are printed. If the printer has gone,
   it prints its own line after ``wait_s``, so the job is never silent.

Every rank also appends its message to its ``logs/rank_<r>.log`` once the output folder is
known. Keys carry torchrun's run id, its restart count and a per-process sequence number, so a
restarted job or a second error in one process never reads stale keys.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TextIO

# Public as torch.distributed.Store and .TCPStore; torch's stubs only export them here.
from torch._C._distributed_c10d import Store, TCPStore

from hp_train.observe.logs import file_formatter, log_file

__all__ = ["ERROR_PREFIX", "report_error", "torchrun_store", "write_lines"]

#: The store keys' prefix.
ERROR_PREFIX = "hp_train/error"

_LOG = logging.getLogger("hp_train.errors")
_SEQUENCE = itertools.count()


def torchrun_store(timeout_s: float = 10.0) -> tuple[Store, int, int] | None:
    """A client of torchrun's store with this process's rank and the world size, or None
    outside a multi-rank torchrun job."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world < 2 or "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        return None
    store = TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    return store, int(env["RANK"]), world


def _log_to_file(log: tuple[Path, int], message: str) -> None:
    """Append ``message`` to the rank's log file, as the run's logging writes it (the run's
    handlers may be closed already: the trainer closes them on its way out)."""
    out_dir, rank = log
    path = log_file(out_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    except OSError:  # an output folder that cannot be written: the console still says it
        return
    handler.setFormatter(file_formatter(rank))
    handler.emit(_LOG.makeRecord(_LOG.name, logging.ERROR, __file__, 0, message, (), None))
    handler.close()


def _lines(messages: dict[int, str]) -> list[str]:
    """The console lines for each rank's message: one per distinct message."""
    ranks_of: dict[str, list[int]] = {}
    for rank, message in sorted(messages.items()):
        ranks_of.setdefault(message, []).append(rank)
    if len(ranks_of) == 1:
        return [f"hp-train: {next(iter(ranks_of))}"]
    return [
        f"hp-train: {message} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
        for message, ranks in ranks_of.items()
    ]


def write_lines(lines: list[str], stream: TextIO | None = None) -> None:
    """Write ``lines`` (each ended by a newline) to ``stream`` (default ``sys.stderr``) in one
    write and flush it.

    Every rank of a job shares the launcher's console, and ranks that fail together print
    together: ``print`` writes a message and its ending newline separately, so another rank's
    message could land between them and begin mid-line. One write of under ``PIPE_BUF`` bytes
    (4096 on Linux) reaches a pipe whole."""
    out = stream if stream is not None else sys.stderr
    out.write("".join(f"{line}\n" for line in lines))
    out.flush()


def report_error(
    message: str,
    *,
    job: tuple[Store, int, int] | Callable[[], tuple[Store, int, int] | None] | None = (
        torchrun_store
    ),
    grace_s: float = 2.0,
    wait_s: float = 10.0,
    stream: TextIO | None = None,
    log: tuple[Path, int] | None = None,
) -> None:
    """Report ``message`` once for the whole job, and return only once it is on the console
    (module docstring).

    Args:
        message: what was wrong and what would be right, one line.
        job: ``(store, rank, world)``, a function giving them (default: torchrun's store), or
            None for a job of one process.
        grace_s: how long to wait for the other ranks' reports.
        wait_s: how long a rank that does not print waits for the printer.
        stream: the console (default ``sys.stderr``).
        log: ``(out_dir, rank)`` of a run whose ``logs/rank_<r>.log`` gets the message, or
            None before the output folder is known.
    """
    out = stream if stream is not None else sys.stderr
    if log is not None:
        _log_to_file(log, message)
    try:
        found = job() if callable(job) else job
    except (RuntimeError, ValueError):  # torchrun's store is gone: nothing to agree with
        found = None
    if found is None:
        write_lines([f"hp-train: {message}"], out)
        return
    store, rank, world = found
    env = os.environ
    run = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    prefix = f"{ERROR_PREFIX}/{run}/{next(_SEQUENCE)}"
    store.set(f"{prefix}/rank/{rank}", message)
    reported = store.add(f"{prefix}/count", 1)
    deadline = time.monotonic() + grace_s
    while reported < world and time.monotonic() < deadline:
        time.sleep(0.02)
        reported = store.add(f"{prefix}/count", 0)
    printed = f"{prefix}/printed"
    if store.add(f"{prefix}/printer", 1) == 1:
        keys = {r: f"{prefix}/rank/{r}" for r in range(world)}
        messages = {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}
        write_lines(_lines(messages), out)
        store.set(printed, "1")
        return
    try:
        store.wait([printed], timedelta(seconds=wait_s))
    except RuntimeError:  # the printer is gone: never leave the job silent
        write_lines([f"hp-train: {message} (rank {rank})"], out)

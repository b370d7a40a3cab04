"""Taking in-memory snapshots while training: a copy at a step boundary, the rest in the
background.

Every ``every`` steps, after the optimizer step, :meth:`SnapshotKeeper.after_step` copies the
rank's state (:mod:`hp_train.recovery.state`) into a host buffer that is reused every time:
that copy is the only part the step waits for, and it is taken between two steps, so a
snapshot never holds a half-applied update. A background thread then hashes and writes it into
the host's snapshot folder (:mod:`hp_train.recovery.snapshot_file`) and sends a replica to
the rank's buddy on another host (:func:`hp_train.recovery.plan.buddy_ranks`), receiving its
own buddy's in turn, over a process group of its own (so that it never interleaves with the
training's collectives). The next snapshot first waits for that thread: a snapshot interval
shorter than the background work makes the step wait, and the wait is measured.

A failure in the background (a peer gone while replicating, a full ``/dev/shm``) is raised in
the training thread at the next snapshot or at :meth:`SnapshotKeeper.close`.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor import watchdog
from hp_train.recovery.plan import buddy_ranks
from hp_train.recovery.snapshot_file import (
    SnapshotHeader,
    prune,
    snapshot_folder,
    write_verified,
)
from hp_train.recovery.state import (
    TrainingState,
    capture,
    optimizer_scalars,
    payload_size,
    state_entries,
)
from hp_train.recovery.transfer import Outgoing, exchange_snapshots

__all__ = ["KEEP", "SnapshotCosts", "SnapshotKeeper"]

#: Snapshots kept per rank and kind: the newest may be incomplete on some rank when a job
#: dies, so the one before it must still be there.
KEEP = 2


@dataclass
class SnapshotCosts:
    """Seconds spent per snapshot, this rank: ``copy`` (the step waits), ``wait`` (the step
    waited for the previous background work), ``background`` (hash, write, replicate)."""

    copy: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)
    background: list[float] = field(default_factory=list)


class SnapshotKeeper:
    """Periodic snapshots of one rank (collective to build: every rank builds one, in the same
    order relative to its other process groups).

    Args:
        root: this host's snapshot folder.
        hosts: every rank's host (``hosts[r]``); the buddies follow from it.
        run_id: the run the snapshots belong to.
        state: the rank's model, optimizer and device.
        every: steps between snapshots.
        extras: called at each snapshot for its JSON state besides tensors (the data position,
            the skipped steps, the run's record).
    """

    def __init__(
        self,
        root: Path,
        hosts: list[str],
        run_id: str,
        state: TrainingState,
        every: int,
        extras: Callable[[], Mapping[str, Any]],
    ) -> None:
        self.root = root
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.run_id = run_id
        self.state = state
        self.every = every
        self.extras = extras
        buddies = buddy_ranks(hosts)
        self.buddy = buddies[self.rank]
        self.replica_of = [r for r, b in enumerate(buddies) if b == self.rank]
        self.group: dist.ProcessGroup | None = None
        if self.buddy is not None:
            timeout = watchdog.timeout_s()
            self.group = dist.new_group(
                backend="gloo",
                timeout=None if timeout is None else timedelta(seconds=timeout),
            )
        self.costs = SnapshotCosts()
        self.last_step: int | None = None
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def after_step(self, steps_done: int) -> bool:
        """Take a snapshot when ``steps_done`` is a multiple of ``every`` and none of that step
        was taken yet (collective with a buddy: every rank calls it after every step); whether
        one was taken."""
        if steps_done % self.every or steps_done == self.last_step:
            return False
        self.last_step = steps_done
        began = time.perf_counter()
        self.wait()
        copied = time.perf_counter()
        entries = state_entries(self.state)
        size = payload_size(entries)
        if self._buffer.numel() < size:
            self._buffer = torch.empty(size, dtype=torch.uint8)
        capture(self.state, entries, self._buffer)
        extras = dict(self.extras())
        extras["optimizer_scalars"] = optimizer_scalars(self.state.optimizer)
        header = SnapshotHeader(self.run_id, self.rank, self.world, steps_done, entries, extras)
        done = time.perf_counter()
        self.costs.wait.append(copied - began)
        self.costs.copy.append(done - copied)
        self._thread = threading.Thread(
            target=self._background, args=(header, size), name="hp-train snapshot", daemon=True
        )
        self._thread.start()
        return True

    def wait(self) -> None:
        """Wait for the last snapshot's background work; raise its failure, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Finish the last snapshot (its failure raised here)."""
        self.wait()

    def discard(self) -> None:
        """Delete this rank's snapshots and the replicas it keeps for others (the run is over:
        ``/dev/shm`` is memory), and the host folder once nothing else is in it."""
        folders = [snapshot_folder(self.root, "own", self.rank)]
        folders += [snapshot_folder(self.root, "replica", r) for r in self.replica_of]
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
        for empty in (folders[0].parent, self.root / "replica", self.root):
            with contextlib.suppress(OSError):  # not empty: another rank's are still there
                empty.rmdir()

    def _background(self, header: SnapshotHeader, size: int) -> None:
        began = time.perf_counter()
        try:
            payload = self._buffer[:size]
            sealed = replace(
                header, size=size, sha256=hashlib.sha256(payload.numpy().data).hexdigest()
            )
            own = snapshot_folder(self.root, "own", self.rank)
            write_verified(own, sealed, payload.numpy().data)
            prune(own, KEEP)
            if self.buddy is not None:
                self._replicate(sealed, payload)
        except BaseException as exc:  # raised in the training thread at the next wait
            self._error = exc
        self.costs.background.append(time.perf_counter() - began)

    def _replicate(self, sealed: SnapshotHeader, payload: torch.Tensor) -> None:
        assert self.buddy is not None
        received = exchange_snapshots(
            [Outgoing(self.buddy, sealed, payload)], self.replica_of, self.group, "snapshot replica"
        )
        for header, data in received:
            folder = snapshot_folder(self.root, "replica", header.owner)
            write_verified(folder, header, data.numpy().data)
            prune(folder, KEEP)

"""Restoring a restarted job from the snapshots (collective; every rank calls
:func:`recover_from_snapshots` with the same arguments but its own).

1. Every rank lists its host's snapshot folder; the lists and the ranks' hosts are gathered.
2. Every rank computes the same :func:`~hp_train.recovery.plan.plan_recovery`.
3. The ranks read what the plan has them read (their own snapshot from their host's folder,
   or one they send) and check it against its header; the ranks that found one damaged say
   so in one gather, and everyone plans again without it (the next source: another holding
   of the same step, an older step, the disk checkpoint).
4. The transfers run (:func:`~hp_train.recovery.transfer.exchange_snapshots`); a receiver
   checks what arrived, and a damaged one is dropped the same way.
5. Every rank restores its snapshot in place (:func:`~hp_train.recovery.state.restore`) after
   a check that its run record is this run's (``compatible``); a rank whose snapshot does not
   fit makes every rank fall back to the disk checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hp_train.objects import gather_objects
from hp_train.recovery.plan import Holding, RecoveryPlan, plan_recovery
from hp_train.recovery.snapshot_file import (
    SnapshotCorruptError,
    SnapshotHeader,
    list_holdings,
    read_snapshot,
)
from hp_train.recovery.state import SnapshotMismatchError, TrainingState, restore
from hp_train.recovery.transfer import Outgoing, exchange_snapshots

__all__ = ["Recovered", "recover_from_snapshots"]

_LOG = logging.getLogger("hp_train.recovery")


@dataclass(frozen=True)
class Recovered:
    """What :func:`recover_from_snapshots` did.

    Attributes:
        plan: the plan it carried out; ``plan.source`` is ``"snapshot"`` when the state was
            restored, else what the caller loads instead (``"disk"``, ``"none"``).
        header: this rank's restored snapshot's header (None unless restored).
        seconds: from the first listing to the state restored (or the fallback decided).
        skipped: the snapshots found damaged or unfit, each with its problem.
    """

    plan: RecoveryPlan
    header: SnapshotHeader | None
    seconds: float
    skipped: tuple[str, ...]


def recover_from_snapshots(
    root: Path,
    host: str,
    run_id: str,
    state: TrainingState,
    disk_step: int | None,
    compatible: Callable[[SnapshotHeader], str | None],
) -> Recovered:
    """Restore this rank's state from the newest complete set of snapshots that verifies, if
    one is as new as the disk checkpoint of step ``disk_step`` (module docstring);
    ``compatible(header)`` returns why a snapshot cannot continue this run, or None."""
    began = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    listed = list_holdings(root, host, run_id, world)
    paths: dict[Holding, Path] = {}
    hosts: list[str] = []
    for part in gather_objects(
        (host, [(x.holding, x.header) for x in listed]), "recovery listing gather"
    ):
        assert isinstance(part, tuple)
        hosts.append(part[0])
        paths.update(dict(part[1]))
    excluded: list[Holding] = []
    skipped: list[str] = []
    while True:
        plan = plan_recovery(hosts, list(paths), disk_step, excluded)
        if plan.source != "snapshot":
            return Recovered(plan, None, time.perf_counter() - began, tuple(skipped))
        mine, outgoing, failures = _read_planned(plan, rank, paths)
        failed = _agreed_failures(failures, "recovery read agreement gather")
        if not failed:
            mine, failures = _run_transfers(plan, rank, mine, outgoing)
            failed = _agreed_failures(failures, "recovery transfer agreement gather")
        if not failed:
            assert mine is not None
            header, payload = mine
            unfit = _agreed_failures(
                _unfit(header, plan, rank, compatible), "recovery fit agreement gather"
            )
            if not unfit:
                unfit = _agreed_failures(
                    _restore(state, header, payload, plan.ranks[rank].holding),
                    "recovery restore agreement gather",
                )
                if unfit and disk_step is None:
                    raise SnapshotMismatchError(
                        "could not restore the snapshots and there is no disk checkpoint to "
                        f"load instead: {unfit[0][1]}"
                    )
            if not unfit:
                return Recovered(plan, header, time.perf_counter() - began, tuple(skipped))
            # A snapshot that does not fit this run: none of this run's will.
            skipped += [f"{h}: {why}" for h, why in unfit]
            fallback = RecoveryPlan(
                "disk" if disk_step is not None else "none",
                disk_step or 0,
                (),
                f"the snapshots do not fit this run ({unfit[0][1]})",
            )
            return Recovered(fallback, None, time.perf_counter() - began, tuple(skipped))
        for holding, why in failed:
            _LOG.warning("snapshot %s skipped: %s; trying the next source", holding, why)
            skipped.append(f"{holding}: {why}")
            excluded.append(holding)


_Snapshot = tuple[SnapshotHeader, torch.Tensor]


def _read_planned(
    plan: RecoveryPlan, rank: int, paths: dict[Holding, Path]
) -> tuple[_Snapshot | None, list[Outgoing], list[tuple[Holding, str]]]:
    """Read and check what this rank reads under ``plan``: its own source when it is on its
    host, and the sources it sends; returns its own, the ones to send, the failures."""
    mine: _Snapshot | None = None
    outgoing: list[Outgoing] = []
    failures: list[tuple[Holding, str]] = []
    for source in plan.ranks:
        if (source.rank if source.local else source.sender) != rank:
            continue
        try:
            header, payload = read_snapshot(paths[source.holding])
        except SnapshotCorruptError as exc:
            failures.append((source.holding, str(exc)))
            continue
        data = torch.frombuffer(payload, dtype=torch.uint8)
        if source.local:
            mine = (header, data)
        else:
            outgoing.append(Outgoing(source.rank, header, data))
    return mine, outgoing, failures


def _run_transfers(
    plan: RecoveryPlan, rank: int, mine: _Snapshot | None, outgoing: list[Outgoing]
) -> tuple[_Snapshot | None, list[tuple[Holding, str]]]:
    """Send and receive the plan's transfers (every rank, even one with none: the lengths
    round is point-to-point, so only the ranks concerned post anything)."""
    incoming = [s for s in plan.transfers() if s.rank == rank]
    if not incoming and not outgoing:
        return mine, []
    sources = [s.sender for s in incoming if s.sender is not None]
    try:
        received = exchange_snapshots(outgoing, sources, None, "recovery snapshot")
    except SnapshotCorruptError as exc:
        return mine, [(incoming[0].holding, str(exc))]
    for header, data in received:
        mine = (header, data)
    return mine, []


def _agreed_failures(failures: list[tuple[Holding, str]], name: str) -> list[tuple[Holding, str]]:
    """Every rank's failures (collective: all ranks get the same list, in rank order)."""
    agreed: list[tuple[Holding, str]] = []
    for part in gather_objects(failures, name):
        assert isinstance(part, list)
        agreed += part
    return agreed


def _unfit(
    header: SnapshotHeader,
    plan: RecoveryPlan,
    rank: int,
    compatible: Callable[[SnapshotHeader], str | None],
) -> list[tuple[Holding, str]]:
    """Why this rank's snapshot cannot continue this run (empty: it can)."""
    holding = plan.ranks[rank].holding
    if (header.owner, header.step) != (rank, plan.step):
        return [
            (
                holding,
                f"holds rank {header.owner}'s state at step {header.step}, not rank {rank}'s "
                f"at step {plan.step}",
            )
        ]
    why = compatible(header)
    return [] if why is None else [(holding, why)]


def _restore(
    state: TrainingState, header: SnapshotHeader, payload: torch.Tensor, holding: Holding
) -> list[tuple[Holding, str]]:
    """Restore ``header``'s payload into ``state`` (collective: the optimizer's state is
    created first with a step, which may communicate); the failure, if any."""
    try:
        restore(state, header.entries, payload, header.extras.get("optimizer_scalars", []))
    except SnapshotMismatchError as exc:
        return [(holding, str(exc))]
    return []

"""Run a :class:`~hp_rl.weight_sync.plan.SyncPlan` on this rank: all or nothing.

A sync runs phase by phase (one for ``direct``, two for ``full_gather``), then commits; each
stage that can fail is closed by an agreement of every rank (a MIN all-reduce of a flag over
the job), so that a failure anywhere leaves every rollout tensor as it was:

1. *pack* (per phase): this rank's outgoing pieces are copied out of the training shards (or
   the gathered whole tensors), one byte buffer per peer; agreement, so that no rank posts a
   message another rank will never answer;
2. *exchange* (per phase): every message is posted (sends and receives at once, point to
   point, each watched), then awaited; the rollout side receives into staging buffers, never
   into its tensors (with ``full_gather``, the training ranks' whole tensors are temporary
   buffers too); agreement after the last phase;
3. *commit*: the received pieces and the local copies are written into the rollout tensors.

A failure before the commit on any rank (an exception, a timeout of the watchdog) makes every
rank raise :class:`SyncFailedError`: the rollout engine keeps the previous weights and their
version. The commit only copies between tensors this rank holds.

Index tensors (where each piece's elements sit in a rank's local 1-d data) are computed once,
when the executor is built.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_dtensor.watchdog import watch, watch_p2p
from hp_layout import Region, local_index_runs
from hp_layout.region import Box
from hp_rl.weight_sync.plan import Move, PhaseProgram, SyncPlan

__all__ = ["SyncFailedError", "SyncResult", "WeightSync", "local_index"]

# Tags of the sync's messages, one per phase (apart from other point-to-point traffic).
_TAG_BASE = 91

_Index = slice | torch.Tensor


class SyncFailedError(RuntimeError):
    """A weight sync did not complete on every rank; no rollout tensor was changed."""


@dataclass(frozen=True)
class SyncResult:
    """One completed sync.

    Attributes:
        version: the policy version the rollout tensors now hold.
        seconds: wall time of the whole sync on this rank.
        bytes_sent: bytes this rank sent to other ranks.
        bytes_received: bytes this rank received from other ranks.
    """

    version: int
    seconds: float
    bytes_sent: int
    bytes_received: int


def local_index(region: Region, box: Box) -> _Index:
    """Where the elements of ``box`` (global indices, inside ``region``) sit in the rank's
    local 1-d data, in the box's row-major order (hp-layout's :func:`local_index_runs`): a
    slice when they are one run, else an int64 index tensor.

    Postcondition: ``local.view(-1)[index]`` is the global tensor's ``box``, row-major.
    """
    runs = local_index_runs(region, box)
    if len(runs) <= 1:
        start, length = runs[0] if runs else (0, 0)
        return slice(start, start + length)
    return torch.cat([torch.arange(start, start + n, dtype=torch.int64) for start, n in runs])


def _whole(shape: tuple[int, ...]) -> Region:
    return Region(tuple((0, n) for n in shape))


def _flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"tensor {name!r} must be contiguous for the weight sync")
    return t.detach().view(-1)


@dataclass(frozen=True)
class _Step:
    """One piece's bytes in a message: where they come from or go to on this rank."""

    move: Move
    index: _Index
    nbytes: int


@dataclass(frozen=True)
class _Phase:
    """One phase of this rank's program with its index tensors: per peer, the pieces of the
    message it sends or receives; the local pieces as read (source) and written (target)."""

    sends: tuple[tuple[int, tuple[_Step, ...]], ...]
    receives: tuple[tuple[int, tuple[_Step, ...]], ...]
    local_reads: tuple[_Step, ...]
    local_writes: tuple[_Step, ...]


class WeightSync:
    """This rank's executor of ``plan`` (see the module docstring).

    Args:
        plan: the job's sync plan (every rank holds the same).
        sources: this rank's training shards, by route name (the local data of every route
            whose training layout holds a shard here): e.g. FSDP's sharded parameters.
        targets: this rank's rollout tensors, by route name (every route whose rollout layout
            holds a shard here), written only at commit.
        rank: this rank (default: the process group's).

    Raises:
        ValueError: a tensor is missing, extra, or of the wrong size or item size for its
            layout.
    """

    def __init__(
        self,
        plan: SyncPlan,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        *,
        rank: int | None = None,
    ) -> None:
        self.plan = plan
        self.rank = dist.get_rank() if rank is None else rank
        self.program = plan.program(self.rank)
        self._check(sources, "training")
        self._check(targets, "rollout")
        self._sources = {n: _flat(t, n) for n, t in sources.items()}
        self._targets = {n: _flat(t, n) for n, t in targets.items()}
        gather = plan.method == "full_gather"
        self._phases = tuple(
            self._phase(program, reads_full=gather and k == 1, writes_full=gather and k == 0)
            for k, program in enumerate(self.program.phases)
        )

    def _phase(self, program: PhaseProgram, *, reads_full: bool, writes_full: bool) -> _Phase:
        def steps(moves: tuple[Move, ...], full: bool, side: str) -> tuple[_Step, ...]:
            return tuple(self._step(m, full, side=side) for m in moves)

        return _Phase(
            tuple((peer, steps(m, reads_full, "src")) for peer, m in program.sends),
            tuple((peer, steps(m, writes_full, "dst")) for peer, m in program.receives),
            steps(program.local, reads_full, "src"),
            steps(program.local, writes_full, "dst"),
        )

    def _check(self, tensors: Mapping[str, torch.Tensor], side: str) -> None:
        expected = {}
        for route in self.plan.routes:
            layout = route.src if side == "training" else route.dst
            if self.rank in layout.mesh:
                expected[route.name] = (layout.local_numel(self.rank), route.itemsize)
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        if missing or extra:
            raise ValueError(
                f"rank {self.rank}: the {side} tensors do not match the sync plan "
                f"(missing: {missing[:5]}, not in the plan here: {extra[:5]})"
            )
        for name, (numel, itemsize) in expected.items():
            t = tensors[name]
            if t.numel() != numel or t.element_size() != itemsize:
                raise ValueError(
                    f"rank {self.rank}: {side} tensor {name!r} holds {t.numel()} elements of "
                    f"{t.element_size()} bytes; its layout gives this rank {numel} of {itemsize}"
                )

    def _step(self, move: Move, full: bool, *, side: str) -> _Step:
        route = self.plan.routes[move.route]
        if full:
            region = _whole(route.src.global_shape)
        else:
            layout = route.src if side == "src" else route.dst
            region = layout.local_region(self.rank)
        count = math.prod(hi - lo for lo, hi in move.piece.box)
        return _Step(move, local_index(region, move.piece.box), count * route.itemsize)

    # Execution -----------------------------------------------------------------------------

    def _agree(self, ok: bool, stage: str) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        with watch(f"weight sync {stage} agreement"):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _full_buffers(self) -> dict[str, torch.Tensor]:
        """The whole tensors full_gather's phase 0 fills on a training rank (its own region
        arrives as that phase's local pieces)."""
        out = {}
        for route in self.plan.routes:
            if self.rank in route.src.mesh:
                src = self._sources[route.name]
                shape = route.src.global_shape
                out[route.name] = torch.empty(math.prod(shape), dtype=src.dtype, device=src.device)
        return out

    def _read(self, step: _Step, storage: Mapping[str, torch.Tensor]) -> torch.Tensor:
        name = self.plan.routes[step.move.route].name
        return storage[name][step.index].reshape(-1)

    def _pack(self, steps: tuple[_Step, ...], storage: Mapping[str, torch.Tensor]) -> torch.Tensor:
        parts = [self._read(s, storage).view(torch.uint8) for s in steps]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    def _exchange(
        self, k: int, phase: _Phase, outgoing: list[tuple[int, torch.Tensor]]
    ) -> list[tuple[tuple[_Step, ...], torch.Tensor]]:
        """Phase ``k``'s messages (``outgoing``: packed, one per peer), all posted before any
        is awaited (so any pattern of senders and receivers completes); returns the received
        buffers with their pieces."""
        incoming = [
            (peer, steps, torch.empty(sum(s.nbytes for s in steps), dtype=torch.uint8))
            for peer, steps in phase.receives
        ]
        works = [
            watch_p2p("weight sync", self.rank, peer, dist.isend(data, peer, tag=_TAG_BASE + k))
            for peer, data in outgoing
        ]
        works += [
            watch_p2p("weight sync", peer, self.rank, dist.irecv(buf, peer, tag=_TAG_BASE + k))
            for peer, _, buf in incoming
        ]
        for work in works:
            work.wait()
        return [(steps, buf) for _, steps, buf in incoming]

    def run(self, version: int) -> SyncResult:
        """Move every route's shards into the rollout tensors and label them ``version``
        (collective over the job).

        Raises:
            SyncFailedError: some rank failed before the commit; no rollout tensor changed.
        """
        start = time.perf_counter()
        sent = received = 0
        failure: BaseException | None = None
        staged: list[tuple[tuple[_Step, ...], torch.Tensor]] = []
        local_writes: list[tuple[_Step, torch.Tensor]] = []
        full: dict[str, torch.Tensor] = {}
        gather = self.plan.method == "full_gather"
        for k, phase in enumerate(self._phases):
            reads = full if gather and k == 1 else self._sources
            outgoing: list[tuple[int, torch.Tensor]] = []
            try:
                if failure is None:
                    if gather and k == 0:
                        full = self._full_buffers()
                    outgoing = [(peer, self._pack(steps, reads)) for peer, steps in phase.sends]
            except Exception as exc:  # agreed on below: every rank aborts together
                failure = exc
            if not self._agree(failure is None, f"phase {k} pack"):
                raise SyncFailedError(self._reason("preparing", failure)) from failure
            try:
                incoming = self._exchange(k, phase, outgoing)
                sent += sum(data.numel() for _, data in outgoing)
                received += sum(buf.numel() for _, buf in incoming)
                local = [
                    (dst, self._read(src, reads))
                    for src, dst in zip(phase.local_reads, phase.local_writes, strict=True)
                ]
                if gather and k == 0:
                    # The gather fills the temporary whole tensors now: phase 1 reads them.
                    for steps, buf in incoming:
                        self._unpack(steps, buf, full)
                    for dst, data in local:
                        self._write(dst, data, full)
                else:
                    staged += incoming
                    local_writes += [(dst, data.clone()) for dst, data in local]
            except Exception as exc:  # agreed on at the next phase's pack or below
                failure = exc
        if not self._agree(failure is None, "exchange"):
            raise SyncFailedError(self._reason("exchanging", failure)) from failure
        with torch.no_grad():
            for steps, buf in staged:
                self._unpack(steps, buf, self._targets)
            for dst, data in local_writes:
                self._write(dst, data, self._targets)
        return SyncResult(version, time.perf_counter() - start, sent, received)

    def _reason(self, stage: str, failure: BaseException | None) -> str:
        mine = (
            f"rank {self.rank}: {type(failure).__name__}: {failure}"
            if failure
            else (f"rank {self.rank} was fine; another rank failed")
        )
        return (
            f"weight sync failed while {stage} ({mine}); the rollout engine keeps the previous "
            "weights and policy version"
        )

    def _write(self, step: _Step, data: torch.Tensor, storage: Mapping[str, torch.Tensor]) -> None:
        name = self.plan.routes[step.move.route].name
        storage[name][step.index] = data

    def _unpack(
        self, steps: tuple[_Step, ...], buf: torch.Tensor, storage: Mapping[str, torch.Tensor]
    ) -> None:
        offset = 0
        for step in steps:
            name = self.plan.routes[step.move.route].name
            target = storage[name]
            raw = buf[offset : offset + step.nbytes]
            if offset % target.element_size():
                raw = raw.clone()  # a view as a wider dtype needs an aligned start
            target[step.index] = raw.view(target.dtype)
            offset += step.nbytes

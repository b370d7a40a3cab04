"""Executing a :class:`~hp_muon.plan.RankProgram`: gather, orthogonalize, scatter, per bucket.

Each bucket is one ``all_to_all_single`` that gathers every matrix's pieces to its owner and
one that sends every holder its part of the result. Both carry bf16, which is exact: Newton-
Schulz casts its input to bf16 before anything else, and its result is bf16. Buckets are
pipelined: the gather of bucket ``k + 1`` is in flight while the owner orthogonalizes bucket
``k``, and the scatter of bucket ``k`` while it works on ``k + 1`` (with gloo the transfers run
on the backend's threads; NCCL and HCCL run them on their own streams).

Local data: ``inputs[t]`` and ``outputs[t]`` are the flat bf16 local data of planned tensor
``t`` (the rank's shard of the update input, and the buffer that receives its shard of the
orthogonalized update). A piece is read from and written to a view of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_dtensor.watchdog import watch_async
from hp_muon.plan import BucketProgram, MatrixJob, MuonPlan, Piece, RankProgram

__all__ = ["ExchangeStats", "Orthogonalizer", "piece_view", "run_program"]

Orthogonalizer = Callable[[Sequence[int], Sequence[torch.Tensor]], list[torch.Tensor]]
"""Given job indices and their assembled bf16 matrices, returns the orthogonalized ones."""


@dataclass(frozen=True)
class ExchangeStats:
    """What one rank did in one step.

    Attributes:
        orthogonalized: matrices it orthogonalized.
        elements_sent: elements it sent (gather and scatter).
        bytes_sent: bytes it sent.
        collectives: all-to-all calls it issued.
    """

    orthogonalized: int
    elements_sent: int
    bytes_sent: int
    collectives: int


def piece_view(flat: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The view of ``piece`` in a rank's flat local data (shape: the piece's box)."""
    run = flat[piece.start : piece.start + piece.run_numel].view(piece.run_shape)
    return run[tuple(slice(a, b) for a, b in piece.select)]


def _matrix_view(matrix: torch.Tensor, piece: Piece) -> torch.Tensor:
    return matrix[piece.rows[0] : piece.rows[1], piece.cols[0] : piece.cols[1]]


def _pack(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``parts`` flattened into one send buffer of ``dtype`` (the wire dtype: fp32
    Newton-Schulz results are cast on the way in, in the same kernel)."""
    flat = [p.reshape(-1) for p in parts]
    out = torch.empty(sum(f.numel() for f in flat), dtype=dtype, device=device)
    return torch.cat(flat, out=out) if flat else out


class _Pending:
    """An all-to-all in flight, with the buffer it receives into."""

    def __init__(
        self,
        send: torch.Tensor,
        splits: tuple[tuple[int, ...], tuple[int, ...]],
        group: dist.ProcessGroup | None,
        exchange: bool,
    ) -> None:
        self.recv = torch.empty(sum(splits[1]), dtype=send.dtype, device=send.device)
        self.send = send  # kept alive until the transfer completes
        self.work: dist.Work | None = None
        if exchange:
            work = dist.all_to_all_single(
                self.recv,
                send,
                list(splits[1]),
                list(splits[0]),
                group=group,
                async_op=True,
            )
            self.work = watch_async("all_to_all (Muon exchange)", group, work)

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.recv


def _gathered(
    bucket: BucketProgram,
    jobs: Sequence[MatrixJob],
    inputs: Sequence[torch.Tensor],
    recv: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[int, torch.Tensor]:
    """The whole matrices this rank owns in ``bucket``: its own pieces of them (from
    ``inputs``) and the pieces received in the gather (``recv``), each copied into place."""
    matrices = {j: torch.empty(jobs[j].shape, dtype=dtype, device=device) for j in bucket.owned}
    for j, piece in bucket.own_sources:
        _matrix_view(matrices[j], piece).copy_(
            piece_view(inputs[jobs[j].tensor], piece).reshape(
                piece.rows[1] - piece.rows[0], piece.cols[1] - piece.cols[0]
            )
        )
    for r in bucket.gather_recvs:
        view = _matrix_view(matrices[r.job], r.piece)
        view.copy_(recv[r.offset : r.offset + r.piece.numel].view(view.shape))
    return matrices


def run_program(
    program: RankProgram,
    plan: MuonPlan,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    orthogonalize: Orthogonalizer,
    *,
    group: dist.ProcessGroup | None,
    while_first_gather: Callable[[], None] | None = None,
) -> ExchangeStats:
    """Run ``program`` (this rank's part of ``plan``); fills ``outputs``.

    ``while_first_gather`` runs while the first bucket's gather is in flight (the optimizer
    orthogonalizes its rank-local matrices there). Every rank of the group must call this
    with the same plan, in the same order relative to its other collectives.
    """
    jobs = plan.jobs
    dtype, device = torch.bfloat16, (inputs[0].device if inputs else torch.device("cpu"))
    collectives = 0

    def start_gather(bucket: BucketProgram) -> _Pending:
        nonlocal collectives
        parts = [piece_view(inputs[jobs[s.job].tensor], s.piece) for s in bucket.gather_sends]
        collectives += int(bucket.gather_exchange)
        return _Pending(
            _pack(parts, dtype, device), bucket.gather_splits, group, bucket.gather_exchange
        )

    def unpack_scatter(bucket: BucketProgram, pending: _Pending) -> None:
        recv = pending.wait()
        for r in bucket.scatter_recvs:
            target = piece_view(outputs[jobs[r.job].tensor], r.piece)
            target.copy_(recv[r.offset : r.offset + r.piece.numel].view(target.shape))

    buckets = program.buckets
    gathers: list[_Pending | None] = [start_gather(buckets[0])] if buckets else []
    if while_first_gather is not None:
        while_first_gather()
    previous_scatter: tuple[BucketProgram, _Pending] | None = None
    for k, bucket in enumerate(buckets):
        if k + 1 < len(buckets):
            gathers.append(start_gather(buckets[k + 1]))
        pending = gathers[k]
        assert pending is not None
        recv = pending.wait()
        gathers[k] = None
        matrices = _gathered(bucket, jobs, inputs, recv, dtype, device)
        results = dict(
            zip(
                bucket.owned,
                orthogonalize(bucket.owned, [matrices[j] for j in bucket.owned]),
                strict=True,
            )
        )
        del matrices
        parts = [_matrix_view(results[s.job], s.piece) for s in bucket.scatter_sends]
        collectives += int(bucket.scatter_exchange)
        scatter = _Pending(
            _pack(parts, dtype, device), bucket.scatter_splits, group, bucket.scatter_exchange
        )
        for j, piece in bucket.own_targets:
            target = piece_view(outputs[jobs[j].tensor], piece)
            target.copy_(_matrix_view(results[j], piece).reshape(target.shape))
        if previous_scatter is not None:
            unpack_scatter(*previous_scatter)
        previous_scatter = (bucket, scatter)
    if previous_scatter is not None:
        unpack_scatter(*previous_scatter)
    sent = program.elements_sent
    return ExchangeStats(
        orthogonalized=program.orthogonalized,
        elements_sent=sent,
        bytes_sent=sent * torch.finfo(dtype).bits // 8,
        collectives=collectives,
    )

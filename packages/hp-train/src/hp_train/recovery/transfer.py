"""Snapshots over the process group: a header and its payload from one rank to another.

Used twice: every snapshot's replica goes to the owner's buddy (:mod:`hp_train.recovery.keeper`,
on a group of its own, from a background thread), and a restarted job fetches the snapshots a
rank's own host no longer holds (:mod:`hp_train.recovery.recover`). Each exchange is two
rounds of point-to-point messages, all posted before any is waited on (so any pattern of
senders and receivers completes): the lengths, then the header's JSON and the payload. A
receiver checks the payload against the header's size and SHA-256.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hp_dtensor.watchdog import watch_p2p
from hp_train.recovery.snapshot_file import SnapshotHeader, check_payload

__all__ = ["Outgoing", "exchange_snapshots"]

# One message of each kind per pair of ranks and exchange; tags keep them apart.
_LENGTHS, _HEADER, _PAYLOAD = 71, 72, 73


@dataclass(frozen=True)
class Outgoing:
    """A snapshot this rank sends: to global rank ``dst``, ``header`` (size and SHA-256
    filled) and ``payload`` (a CPU ``uint8`` tensor of ``header.size`` bytes or more)."""

    dst: int
    header: SnapshotHeader
    payload: torch.Tensor


def exchange_snapshots(
    outgoing: Sequence[Outgoing],
    sources: Sequence[int],
    group: dist.ProcessGroup | None,
    what: str,
) -> list[tuple[SnapshotHeader, torch.Tensor]]:
    """Send every ``outgoing`` snapshot and receive one from each rank of ``sources`` (global
    ranks; at most one snapshot per pair of ranks); returns the received ones, in ``sources``
    order, each checked against its header (:class:`~hp_train.recovery.snapshot_file.
    SnapshotCorruptError` otherwise). Point-to-point over ``group``; ``what`` names the
    transfer for the watchdog (``snapshot replica``)."""
    rank = dist.get_rank()
    heads = [o.header.to_json().encode() for o in outgoing]
    sizes = [
        torch.tensor([len(h), o.header.size], dtype=torch.int64)
        for h, o in zip(heads, outgoing, strict=True)
    ]
    got_sizes = [torch.zeros(2, dtype=torch.int64) for _ in sources]
    works = [
        watch_p2p(f"{what} lengths", rank, o.dst, dist.isend(s, o.dst, group=group, tag=_LENGTHS))
        for s, o in zip(sizes, outgoing, strict=True)
    ]
    works += [
        watch_p2p(f"{what} lengths", src, rank, dist.irecv(t, src, group=group, tag=_LENGTHS))
        for t, src in zip(got_sizes, sources, strict=True)
    ]
    for work in works:
        work.wait()
    head_bufs = [torch.empty(int(t[0]), dtype=torch.uint8) for t in got_sizes]
    data_bufs = [torch.empty(int(t[1]), dtype=torch.uint8) for t in got_sizes]
    works = []
    for head, o in zip(heads, outgoing, strict=True):
        raw = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        works.append(
            watch_p2p(
                f"{what} header", rank, o.dst, dist.isend(raw, o.dst, group=group, tag=_HEADER)
            )
        )
        data = o.payload[: o.header.size]
        works.append(
            watch_p2p(
                f"{what} payload", rank, o.dst, dist.isend(data, o.dst, group=group, tag=_PAYLOAD)
            )
        )
    for head_buf, data_buf, src in zip(head_bufs, data_bufs, sources, strict=True):
        works.append(
            watch_p2p(
                f"{what} header", src, rank, dist.irecv(head_buf, src, group=group, tag=_HEADER)
            )
        )
        works.append(
            watch_p2p(
                f"{what} payload", src, rank, dist.irecv(data_buf, src, group=group, tag=_PAYLOAD)
            )
        )
    for work in works:
        work.wait()
    received = []
    for head_buf, data_buf, src in zip(head_bufs, data_bufs, sources, strict=True):
        header = SnapshotHeader.from_json(bytes(head_buf.numpy()).decode())
        check_payload(
            header, data_buf.numpy().data, f"the snapshot of rank {header.owner} from rank {src}"
        )
        received.append((header, data_buf))
    return received

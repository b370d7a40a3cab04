"""Muon's per-step exchange on one rank: from hp_muon's real plan, or analytically at scale.

``hp_muon.Muon`` gathers every matrix to one owner and scatters the orthogonalized result back
to every holder, in bf16, one ``all_to_all_single`` each way per bucket of ``bucket_cap_mb``
(over the world group), and runs Newton-Schulz (5 steps) on the owner.

*Exact* (small cases): the parameters' FSDP layouts are built exactly as hp_fsdp annotates
them (:meth:`hp_layout.FlatBufferLayout.layout` over the ``(dp_replicate, dp_shard, tp)``
mesh, tensor-parallel placement as the base), :func:`hp_muon.plan_muon_step` plans the step
and :func:`hp_muon.plan.rank_program` gives this rank's sends: ``sent_bytes`` equals what
``Muon.last_step_stats.bytes_sent`` reports.

*Analytic* (large cases, where planning every matrix against every rank takes too long): a
matrix of ``N`` elements in ``R`` replicas moves ``N - own`` elements in the gather (from the
owner's copy only) and ``R N - own`` in the scatter (to every replica), where ``own`` is the
owner's piece: with tensor parallelism ``T`` each rank's part ``n = N / T`` lies in the FSDP
flat buffer of chunk ``C``, in about ``1 + n / C`` chunks. The owner is chosen for balance
first and for the most elements held second, so ``own`` is taken halfway between an average
piece ``n / (1 + n / C)`` and the largest one (``n (1 - n / 4C)`` for ``n < C``, else ``C``);
calibrated against the real plan (tiny and llama_8b at 4 and 8 ranks, with HSDP and TP), the
average bytes per rank are within 10%. Owners are balanced, so each rank sends the world
average, and
its Newton-Schulz work is the world average too. Buckets are counted with the planner's rule
(consecutive matrices up to ``bucket_cap_mb``); a bucket's matrices lie in about
``bucket / chunk + 1`` FSDP chunks per replica, whose holders are the peers of its gather, and
those of every replica the peers of its scatter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hp_layout import Layout, Mesh, Replicate, Shard
from hp_muon.plan import MatrixTensor, newton_schulz_cost, plan_muon_step, rank_program
from hp_train.config.schema import ParallelConfig
from hp_train.dryrun.shapes import GroupSpec

__all__ = ["EXACT_LIMIT", "MuonTraffic", "muon_traffic"]

EXACT_LIMIT = 20_000
"""Use the real plan when matrices x ranks is at most this (under a second of planning).

Measured (one core): llama_8b's 224 matrices take 0.1 s at 8 ranks, 0.7 s at 64 and 5.3 s at
256; moe_505b's 47,336 matrices at 768 ranks (36M matrix-ranks) would take hours, so large
cases are analytic."""

NS_STEPS = 5
_BF16 = 2


@dataclass(frozen=True)
class MuonTraffic:
    """One rank's Muon exchange in one step.

    Attributes:
        source: ``"plan"`` (hp_muon's plan), ``"analytic"`` or ``"none"`` (no Muon matrices or
            a single rank).
        matrices: matrices in the step.
        buckets: exchange buckets (each one all-to-all each way when anything moves).
        calls: all-to-all calls this rank issues.
        sent_bytes: bf16 bytes this rank sends (gather and scatter).
        nbytes: over the calls, the larger of this rank's send and receive buffers.
        fast_bytes: part of ``sent_bytes`` that stays inside the ``dp_shard x tp`` group's tier.
        ns_flops: Newton-Schulz FLOPs this rank runs (as owner).
        peers: message latencies on the critical path, summed over the calls: from the real
            plan, the ranks this rank exchanges with per call; analytically, the owner's
            (it receives from every holder and sends to every replica's holders). An
            all-to-all's empty splits are taken as free.
    """

    source: str
    matrices: int
    buckets: int
    calls: int
    sent_bytes: int
    nbytes: int
    fast_bytes: int
    ns_flops: float
    peers: int = 0


def _bucket_count(sizes: list[tuple[int, int]], bucket_numel: int) -> int:
    """Buckets of the planner's greedy rule over ``(matrix numel, count)`` runs."""
    buckets, size = 0, 0
    for numel, count in sizes:
        for _ in range(count):
            if buckets == 0 or (size and size + numel > bucket_numel):
                buckets += 1
                size = 0
            size += numel
    return buckets


def _exact(
    groups: tuple[GroupSpec, ...],
    parallel: ParallelConfig,
    rank: int,
    bucket_numel: int,
) -> MuonTraffic:
    r, s, t = parallel.dp_replicate, parallel.dp_shard, parallel.tp
    mesh = Mesh((r, s, t), ("dp_replicate", "dp_shard", "tp"))
    specs: list[MatrixTensor] = []
    for group in groups:
        for index, p in enumerate(group.params):
            if p.optimizer != "muon":
                continue
            placements: list[Replicate | Shard] = [Replicate(), Replicate(), Replicate()]
            if p.tp_dim is not None and t > 1:
                placements[2] = Shard(p.tp_dim)
            base = Layout(p.shape, mesh, placements)
            specs.append(MatrixTensor(group.flat.layout(index, mesh, "dp_shard", base=base)))
    plan = plan_muon_step(specs, bucket_numel=bucket_numel)
    program = rank_program(plan, rank, mesh.ranks)
    sent = nbytes = fast = peers = 0
    shard_block = s * t
    for bucket in program.buckets:
        for exchange, (send, recv) in (
            (bucket.gather_exchange, bucket.gather_splits),
            (bucket.scatter_exchange, bucket.scatter_splits),
        ):
            if not exchange:
                continue
            sent += sum(send)
            peers += max(1, sum(1 for n in send if n), sum(1 for n in recv if n))
            nbytes += max(sum(send), sum(recv))
            fast += sum(
                n for peer, n in enumerate(send) if peer // shard_block == rank // shard_block
            )
    load = plan.load().get(rank, 0)
    return MuonTraffic(
        source="plan",
        matrices=len(plan.jobs),
        buckets=len(plan.buckets),
        calls=program.collectives,
        sent_bytes=sent * _BF16,
        nbytes=nbytes * _BF16,
        fast_bytes=fast * _BF16,
        ns_flops=2.0 * NS_STEPS * load,
        peers=peers,
    )


def muon_traffic(
    groups: tuple[GroupSpec, ...],
    parallel: ParallelConfig,
    *,
    rank: int = 0,
    bucket_mb: float = 32.0,
    exact: bool | None = None,
) -> MuonTraffic:
    """This rank's Muon traffic for the Muon parameters of ``groups`` (see the module doc).

    ``parallel`` describes the ranks of ``groups`` (one pipeline stage; its ``pp`` is
    ignored) and ``rank`` is a rank of that stage (``0 .. dp x tp - 1``). ``exact=None`` uses
    the real plan when matrices x ranks <= :data:`EXACT_LIMIT` and tensor parallelism splits
    every sharded dim evenly (the layouts then agree on every tensor-parallel rank).

    Postconditions: with ``source == "plan"``, ``sent_bytes`` is hp_muon's per-rank count;
    ``fast_bytes <= sent_bytes``; ``calls <= 2 * buckets``.
    """
    bucket_numel = max(1, int(bucket_mb * 2**20) // _BF16)
    muon = [p for g in groups for p in g.params if p.optimizer == "muon"]
    runs = [(p.shape[-2] * p.shape[-1], math.prod(p.shape[:-2])) for p in muon]
    matrices = sum(count for _, count in runs)
    world = parallel.dp_replicate * parallel.dp_shard * parallel.tp
    if not muon or world == 1:
        cost = sum(newton_schulz_cost(*p.shape[-2:]) * math.prod(p.shape[:-2]) for p in muon)
        buckets = _bucket_count(runs, 2**62)
        return MuonTraffic("none", matrices, buckets, 0, 0, 0, 0, 2.0 * NS_STEPS * cost)
    even = all(
        p.tp_dim is None or p.shape[p.tp_dim] % parallel.tp == 0 for g in groups for p in g.params
    )
    if exact is None:
        exact = even and matrices * world <= EXACT_LIMIT
    if exact:
        return _exact(groups, parallel, rank, bucket_numel)
    r, st = parallel.dp_replicate, parallel.dp_shard * parallel.tp
    gather = scatter = 0.0
    ns_cost = 0.0
    chunk_of = {p.name: g.flat.chunk_numel for g in groups for p in g.params}
    for p, (numel, count) in zip(muon, runs, strict=True):
        part, c = numel / parallel.tp, max(1, chunk_of[p.name])
        largest = part * (1 - part / (4 * c)) if part < c else float(c)
        own = (largest + part * c / (part + c)) / 2
        if st == 1:
            own = float(numel)
        gather += count * (numel - own)
        scatter += count * (r * numel - own)
        ns_cost += newton_schulz_cost(*p.shape[-2:]) * count
    buckets = _bucket_count(runs, bucket_numel)
    # A bucket's matrices lie in about (bucket / chunk + 1) consecutive chunks of each replica.
    chunk = max(1.0, sum(g.flat.chunk_numel for g in groups) / max(1, len(groups)))
    per_bucket = min(float(bucket_numel), sum(n * c for n, c in runs) / max(1, buckets))
    holders = min(world - 1, math.ceil(per_bucket / chunk) + 1)
    sent = (gather + scatter) / world * _BF16
    fast = (gather + scatter / r) / world * _BF16
    return MuonTraffic(
        source="analytic",
        matrices=matrices,
        buckets=buckets,
        calls=2 * buckets,
        sent_bytes=int(sent),
        nbytes=int(sent),
        fast_bytes=int(fast),
        ns_flops=2.0 * NS_STEPS * ns_cost / world,
        peers=buckets * (holders + min(world - 1, r * holders)),
    )

"""Muon's per-step exchange on one rank: from hp_muon's real plan, or analytically at scale.

``hp_muon.Muon`` gathers every matrix to one owner and scatters the orthogonalized result back
to every holder, in bf16, one ``all_to_all_single`` each way per bucket of ``bucket_cap_mb``
(over the world group), and runs Newton-Schulz (5 steps) on the owner.

*Exact* (small cases): the trainer's JobPlan's Muon step is read, not planned again
(:func:`job_muon_step`: ``StagePlan.muon_plan`` of the rank, hp_muon's plan of the stage's
Muon parameters, in the optimizer's order, with their FSDP layouts; for a bucket size other
than the 32 MiB the JobPlan plans with, :func:`hp_muon.plan_muon` of the same parameters and
layouts), and :func:`hp_muon.plan.rank_program` gives this rank's sends
(:func:`planned_traffic`): ``sent_bytes`` equals what ``Muon.last_step_stats.bytes_sent``
reports.

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
from collections.abc import Callable
from dataclasses import dataclass

from hp_muon import MuonStepPlan, plan_muon
from hp_muon.plan import newton_schulz_cost, rank_program
from hp_muon.step_plan import bucket_numel as step_bucket_numel
from hp_planner.inputs import JobDims
from hp_planner.job import JobPlan
from hp_planner.price.model import PricingError
from hp_planner.price.structure import GroupSpec

__all__ = ["EXACT_LIMIT", "MuonTraffic", "job_muon_step", "muon_traffic", "planned_traffic"]

EXACT_LIMIT = 20_000
"""Use the real plan when matrices x ranks is at most this (under a second of planning); above
it the JobPlan is made without its Muon step (``plan_job(muon=False)``) and the exchange is
priced analytically.

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


def job_muon_step(plan: JobPlan, rank: int, bucket_mb: float) -> MuonStepPlan:
    """The Muon step of ``rank`` in ``plan`` (``StagePlan.muon_plan``), with ``bucket_mb`` MiB
    buckets.

    The JobPlan plans the step with ``hp_muon.Muon``'s default bucket (32 MiB). For another
    size, hp_muon's own planner (:func:`hp_muon.plan_muon`) plans the same parameters, in the
    same order, with the JobPlan's layouts and group, as :func:`hp_planner.plan_job` calls it.

    Raises:
        PricingError: ``plan`` has no Muon step for ``rank`` (AdamW alone, or not planned).
    """
    stage = plan.stage_of(rank)
    step = stage.muon_plan(rank)
    if step is None:
        raise PricingError(f"the JobPlan has no Muon step for rank {rank}")
    size = step_bucket_numel(bucket_mb)
    if all(group.local or group.bucket_numel == size for group in step.groups):
        return step
    named = sorted(
        (i, n) for group in step.groups for i, n in zip(group.indices, group.names, strict=True)
    )
    layouts = stage.layouts(rank)
    return plan_muon(
        [(name, layouts[name]) for _, name in named],
        bucket_cap_mb=bucket_mb,
        group_ranks=range(plan.dims.world_size),
        rank=rank,
    )


def planned_traffic(plan: MuonStepPlan, rank: int, shard_block: int) -> MuonTraffic:
    """``rank``'s Muon exchange in the trainer's JobPlan's Muon step (``StagePlan.muon_plan``
    of ``rank``: hp_muon's plan of the stage's Muon parameters with their FSDP layouts), read,
    not planned again: ``sent_bytes`` is what ``Muon.last_step_stats.bytes_sent`` reports.

    ``shard_block`` is the number of consecutive ranks of one replica's ``dp_shard x tp``
    group (the fast tier): bytes to a peer of the same block count as ``fast_bytes``.
    """
    matrices = buckets = calls = load = 0
    sent = nbytes = fast = peers = 0
    for group in plan.groups:
        matrices += len(group.plan.jobs)
        load += group.plan.load().get(rank, 0)
        if group.local:
            continue
        buckets += len(group.plan.buckets)
        program = rank_program(group.plan, rank, group.ranks)
        calls += program.collectives
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
                    n
                    for peer, n in zip(group.ranks, send, strict=True)
                    if peer // shard_block == rank // shard_block
                )
    return MuonTraffic(
        source="plan",
        matrices=matrices,
        buckets=buckets,
        calls=calls,
        sent_bytes=sent * _BF16,
        nbytes=nbytes * _BF16,
        fast_bytes=fast * _BF16,
        ns_flops=2.0 * NS_STEPS * load,
        peers=peers,
    )


def muon_traffic(
    groups: tuple[GroupSpec, ...],
    parallel: JobDims,
    *,
    rank: int = 0,
    bucket_mb: float = 32.0,
    exact: bool | None = None,
    planned: Callable[[], MuonTraffic] | None = None,
) -> MuonTraffic:
    """This rank's Muon traffic for the Muon parameters of ``groups`` (see the module doc).

    ``parallel`` describes the ranks of ``groups`` (one pipeline stage; its ``pp`` is
    ignored) and ``rank`` is a rank of that stage (``0 .. dp x tp - 1``). ``exact=None`` uses
    the real plan when matrices x ranks <= :data:`EXACT_LIMIT` and tensor parallelism splits
    every sharded dim evenly (the layouts then agree on every tensor-parallel rank).
    ``planned`` reads the exact figures (:func:`planned_traffic` of the JobPlan's Muon step,
    :func:`job_muon_step`); it is called only when they are used.

    Raises:
        PricingError: the exact figures are asked for and ``planned`` is None.

    Postconditions: with ``source == "plan"``, ``sent_bytes`` is hp_muon's per-rank count;
    ``fast_bytes <= sent_bytes``; ``calls <= 2 * buckets``.
    """
    bucket_numel = step_bucket_numel(bucket_mb)
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
        if planned is None:
            raise PricingError("muon_traffic: the exact figures need the JobPlan's Muon step")
        return planned()
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

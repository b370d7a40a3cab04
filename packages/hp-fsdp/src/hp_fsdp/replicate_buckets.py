"""Which groups' gradient chunks HSDP all-reduces together over the slow (replicate) tier.

After a group's reduce-scatter over the shard axis, its chunk still has to be summed over the
replicate axis. Groups are reduced in backward order and their chunks are fused into buckets
of consecutive groups, one all-reduce each, issued as soon as a bucket's last group is in, so
that the slow link works while the backward of earlier layers runs (pure, no torch: the root's
arena asks it once, when it learns the chunk sizes).

**The cost model** (the alpha-beta model of ``hp_layout.Topology.collective_time``). Over a
replicate axis of ``r`` ranks whose tier has latency ``a`` (seconds per message) and bandwidth
``b`` (bytes per second), the all-reduce of ``B`` bytes takes ``2 (r - 1) a + 2 (r - 1) / r *
B / b``. Cut a gradient of ``G`` bytes into ``n`` buckets of ``G / n`` and two costs pull
against each other:

* the link pays the latency once per bucket: ``n * 2 (r - 1) a`` in all;
* the last bucket cannot hide behind any backward, so its transfer is exposed:
  ``2 (r - 1) / r * (G / n) / b``.

Their sum is least at ``n = sqrt(G / (r a b))``, i.e. buckets of

    cap = sqrt(G * r * a * b)  bytes,

the geometric mean of the gradient and ``r`` latency-bandwidth products. A gradient smaller
than ``r a b`` (a latency's worth of transfer per rank) is one bucket: fusing everything costs
less than a second message. A large one is cut into ``sqrt``-many buckets: with 20 us and 12.5
GB/s between hosts (``Topology.two_tier_cluster``'s nominal slow tier) and ``r = 2``, 4 GB of
chunks make buckets of 45 MB (89 of them); over one host's nominal 5 us and 100 GB/s
(``Topology.single_host``), the benchmark's 7.5 MB below make buckets of 2.7 MB (three).

**Cutting.** Groups are taken in backward order, and a bucket is closed once it holds at least
``cap`` bytes, so a group is never split and a bucket may pass ``cap`` by less than its last
group.

Measured (``benchmarks/fsdp_step.py``'s HSDP 2x2 on a 2-core EPYC, gloo, 15 interleaved rounds,
two sittings; ms a step): the whole gradient as one bucket (the previous fixed 25 MiB cap) 295.0
and 322.8, the cap above (three buckets) 287.4 and 318.3, every group alone 285.3 and 337.9;
torch FSDP2, which all-reduces every group alone, 380.9 and 416.4. The cap was ahead of one
bucket in both sittings, by 1-3 %, within the machine's noise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ReplicateBuckets", "bucket_cap_bytes", "plan_replicate_buckets"]


def bucket_cap_bytes(
    gradient_bytes: int, replicate_size: int, latency: float, bandwidth: float
) -> int:
    """``ceil(sqrt(gradient_bytes * replicate_size * latency * bandwidth))``: the bucket size
    that minimizes the latency the slow link pays plus the exposed transfer of the last bucket
    (module docstring).

    Postconditions: ``cap >= 1``; non-decreasing in each argument; ``cap >= gradient_bytes``
    exactly when ``gradient_bytes <= replicate_size * latency * bandwidth`` (up to the rounding
    up), so such a gradient is one bucket.

    Raises:
        ValueError: negative ``gradient_bytes``, ``replicate_size < 1``, ``latency < 0`` or
            ``bandwidth <= 0``.
    """
    if gradient_bytes < 0:
        raise ValueError(f"gradient_bytes must be non-negative, got {gradient_bytes}")
    if replicate_size < 1:
        raise ValueError(f"replicate_size must be at least 1, got {replicate_size}")
    if not latency >= 0 or not bandwidth > 0:
        raise ValueError(
            f"the slow tier needs latency >= 0 and bandwidth > 0, got latency={latency}, "
            f"bandwidth={bandwidth}"
        )
    return max(1, math.ceil(math.sqrt(gradient_bytes * replicate_size * latency * bandwidth)))


@dataclass(frozen=True)
class ReplicateBuckets:
    """The replicate-axis buckets of one root's groups.

    Attributes:
        cap_bytes: a bucket is closed once it holds this many bytes.
        buckets: group indices (backward order), consecutive runs covering every group once.
    """

    cap_bytes: int
    buckets: tuple[tuple[int, ...], ...]


def plan_replicate_buckets(chunk_bytes: Sequence[int], cap_bytes: int) -> ReplicateBuckets:
    """Cut groups whose chunks hold ``chunk_bytes`` (backward order) into buckets of at least
    ``cap_bytes``: each bucket is closed by the first group that brings it to ``cap_bytes``.

    Postconditions: the buckets, concatenated, are ``0 .. len(chunk_bytes) - 1`` in order, none
    empty; every bucket but the last holds at least ``cap_bytes``; every bucket without its
    last group holds less than ``cap_bytes``.

    Raises:
        ValueError: a negative size, or ``cap_bytes < 1``.
    """
    if cap_bytes < 1:
        raise ValueError(f"cap_bytes must be at least 1, got {cap_bytes}")
    if any(size < 0 for size in chunk_bytes):
        raise ValueError(f"chunk sizes must be non-negative, got {list(chunk_bytes)}")
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    held = 0
    for index, size in enumerate(chunk_bytes):
        current.append(index)
        held += size
        if held >= cap_bytes:
            buckets.append(tuple(current))
            current, held = [], 0
    if current:
        buckets.append(tuple(current))
    return ReplicateBuckets(cap_bytes, tuple(buckets))

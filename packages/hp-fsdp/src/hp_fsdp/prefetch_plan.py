"""Whether fully_shard all-gathers a group one group early, per direction: the step's costs.

Prefetching group ``j`` while group ``i`` computes hides up to ``min(gather(j), compute(i))``
of ``j``'s all-gather, and holds ``j``'s unsharded parameters from ``i``'s start instead of
``j``'s. What decides it, per direction (this module: pure, no torch; the hooks in
``hp_fsdp._state`` ask it before each implicit prefetch):

* **Bytes to hide.** A group whose shard axis has one rank all-gathers nothing (its unshard is
  a local copy): prefetching it would only hold its memory earlier. Not prefetched.
* **Peak memory.** Forward prefetch holds ``j`` during ``i``'s forward, before the activations
  of ``i`` and the groups after it are saved; the step peaks later (end of forward, start of
  backward), so forward prefetch adds nothing at the peak (measured equal in
  ``tests/test_memory.py``). Backward prefetch holds ``j`` at the start of ``i``'s backward,
  where the activations of every group before ``i`` are still saved: it adds ``j``'s unsharded
  bytes to the step's peak, so it is taken only while those bytes fit the policy's
  ``max_bytes`` (``None``: no limit).
* **Compute to hide behind.** A group's backward is about twice its forward and longer than its
  all-gather at any batch where data parallelism pays; on accelerators collectives run on their
  own streams, and on CPU gloo's all-gather runs on its own thread, so a gather issued one
  group early overlaps the compute in both directions (measured: ``benchmarks/fsdp_step.py``,
  backward prefetch 0.95x the step time of forward-only prefetch at world 2 on a 2-core CPU,
  interleaved rounds, and hp-fsdp no longer allocates a block's gradient buffer at the start of
  backward, which made it cost a block more than torch FSDP2's peak).

So the default (:func:`hp_fsdp.policy.default_prefetch`) prefetches in both directions on
every device, as FSDP2 does, and ``PrefetchPolicy.max_bytes`` bounds what backward prefetch may
add to the peak.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Direction", "PrefetchDecision", "decide_prefetch"]


class Direction(enum.Enum):
    """Which pass a prefetch serves."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class PrefetchDecision:
    """Whether to all-gather a group one group early, and why.

    Attributes:
        prefetch: issue its all-gather when the group before it (in this direction) starts.
        reason: the rule that decided it, for logs and errors.
    """

    prefetch: bool
    reason: str


def decide_prefetch(
    direction: Direction,
    enabled: bool,
    shard_size: int,
    unsharded_bytes: int,
    max_bytes: int | None,
) -> PrefetchDecision:
    """Whether a group of ``unsharded_bytes`` (its parameters unsharded, in the compute dtype)
    sharded over ``shard_size`` ranks is all-gathered one group early in ``direction``, under a
    policy that ``enabled`` prefetch there with ``max_bytes`` (see the module docstring).

    Postconditions: ``prefetch`` implies ``enabled``, ``shard_size > 1`` and, in backward,
    ``unsharded_bytes <= max_bytes`` when ``max_bytes`` is set.

    Raises:
        ValueError: ``shard_size < 1``, negative ``unsharded_bytes`` or ``max_bytes``.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1, got {shard_size}")
    if unsharded_bytes < 0 or (max_bytes is not None and max_bytes < 0):
        raise ValueError(
            f"byte counts must be non-negative, got unsharded_bytes={unsharded_bytes}, "
            f"max_bytes={max_bytes}"
        )
    if not enabled:
        return PrefetchDecision(False, f"{direction.value} prefetch is off in the policy")
    if shard_size == 1:
        return PrefetchDecision(False, "one rank on the shard axis: nothing is communicated")
    if direction is Direction.BACKWARD and max_bytes is not None and unsharded_bytes > max_bytes:
        return PrefetchDecision(
            False,
            f"its {unsharded_bytes} unsharded bytes would add to the step's peak beyond "
            f"max_bytes={max_bytes}",
        )
    return PrefetchDecision(True, f"hides its all-gather over {shard_size} ranks")

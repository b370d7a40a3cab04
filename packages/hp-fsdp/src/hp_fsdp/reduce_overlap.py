"""Whether a group's gradient reduce-scatter stays in flight through the next group's backward.

A reduce-scatter left in flight runs beside the backward of the group reduced after it and is
completed (its unsharded gradient input freed) when that group's own reduction starts, before
the group allocates its flat gradient buffer; one completed at once makes the backward wait
for it. What decides it (this module: pure, no torch; ``hp_fsdp._state`` asks it for each
group it reduces, the arena carries it out):

* **Bytes to hide.** A group whose shard axis has one rank communicates nothing (its
  reduction is a local copy): nothing to overlap.
* **Peak memory.** A group in flight holds its unsharded gradient (one block) and, over more
  than two ranks, the exchange's receive buffer, while the next group's backward runs. The
  step peaks at the start of backward, where every activation is saved; each group's backward
  frees its own. Holding the *first* group reduced in a backward would put its buffers on top
  of the backward of the next group, where all but one block's activations are still saved:
  measured on ``tests/test_memory.py``'s model, that raised the step's peak by 0.3 of a block
  (49,024 B), to exactly torch FSDP2's. So the first group completes at once, and every later
  one is held while the group after it computes: by then at least two blocks' activations are
  freed, more than the in-flight bytes whenever a block's activations are at least half its
  gradient (a Llama block of width ``d`` saves about ``20 d`` values per token against ``12 d^2``
  parameters: from ``0.3 d`` tokens per rank on, below any batch that trains).
* **Compute to hide behind.** On accelerators the reduce-scatter runs on its own stream; on CPU
  gloo runs it on its own thread. Completing it at once made the next group's backward wait
  for it. Measured with ``benchmarks/fsdp_step.py``'s model on a 2-core EPYC, one thread per
  rank, the same code completing each at once and holding all but the first, interleaved in
  one process, two sittings (12 and 15 rounds): world 2, 148.1 -> 136.9 ms and 119.5 ->
  115.3 ms; world 4, 291.7 -> 289.3 ms and 257.0 -> 258.7 ms; HSDP 2x2 239.8 -> 239.5 ms. At
  world 2 each rank has a core and its wait was idle time; four ranks on two cores leave no
  idle core to fill (a rank waiting gives its core to the other).

The decision never changes a value: the same reduce-scatter runs on the same data, only its
wait moves.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OverlapDecision", "decide_reduce_overlap"]


@dataclass(frozen=True)
class OverlapDecision:
    """Whether a group's reduce-scatter is held in flight, and why.

    Attributes:
        hold: leave it in flight until the next group's reduction starts (or the backward ends).
        reason: the rule that decided it, for logs and errors.
    """

    hold: bool
    reason: str


def decide_reduce_overlap(reduced_before: int, communicates: bool) -> OverlapDecision:
    """Whether the reduce-scatter of a group reduced after ``reduced_before`` other groups in
    this backward is held in flight (module docstring); ``communicates``: its shard axis has
    more than one rank.

    Postconditions: ``hold`` if and only if ``communicates`` and ``reduced_before >= 1``.

    Raises:
        ValueError: ``reduced_before < 0``.
    """
    if reduced_before < 0:
        raise ValueError(f"reduced_before must be at least 0, got {reduced_before}")
    if not communicates:
        return OverlapDecision(False, "one rank on the shard axis: nothing is communicated")
    if reduced_before == 0:
        return OverlapDecision(
            False, "the first group reduced in backward: holding it would add to the step's peak"
        )
    return OverlapDecision(True, "hides its reduce-scatter behind the next group's backward")

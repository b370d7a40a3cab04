"""Context parallelism's collectives per block and microbatch, as the runtime issues them
(:mod:`hp_dtensor.parallel.context_attention`, :mod:`hp_train.parallel.context`).

Each rank holds ``tokens`` of its sequences (``1 / cp`` of each, zigzag: two of ``2 cp``
chunks), q/k/v with every head (grouped key/value heads are expanded before the attention
core), ``q / tp`` wide per token.

* **ring**: ``cp - 1`` passes of the stacked key/value block (fp32: ``2 x tokens x q / tp x 4``
  bytes) to the next rank per forward, and as many reverse passes of their gradients in
  backward. Each pass is one send and one receive of that block (``batch_isend_irecv``);
  a record's ``nbytes`` is both buffers (what ``hp_fsdp.counting`` records: two calls of
  the block's size), what the rank sends is one block.
* **ulysses**: per forward one all-to-all of the stacked q/k/v (``3 x tokens x q / tp``
  elements of the compute dtype) from heads to sequence and one of the output back
  (``tokens x q / tp``); backward the same two, reversed.

A recomputing block (any ``ac`` but ``none``) runs its forward's collectives again. The loss
needs none: every rank holds the same number of tokens, so FSDP's averaging gives the global
token mean.
"""

from __future__ import annotations

from dataclasses import replace

from hp_layout import Collective
from hp_planner.price.comm import CollectiveRecord, RankGrid
from hp_planner.price.model import TransformerShape

__all__ = ["context_records"]

_FP32 = 4


def context_records(
    model: TransformerShape,
    grid: RankGrid,
    blocks: int,
    tokens: int,
    compute_bytes: int,
    *,
    microbatches: int,
    recompute: bool,
) -> tuple[CollectiveRecord, ...]:
    """The context-parallel collectives of ``blocks`` blocks over a step of ``microbatches``
    microbatches of ``tokens`` tokens of this rank each (module doc)."""
    p = grid.parallel
    if p.cp == 1 or blocks == 0:
        return ()
    width = tokens * model.n_heads * model.head_dim // p.tp
    n = blocks * microbatches
    forwards = ("forward", "recompute") if recompute else ("forward",)
    out: list[CollectiveRecord | None] = []
    if p.cp_variant == "ring":
        block = 2 * width * _FP32
        for phase in (*forwards, "backward"):
            r = grid.record("cp", Collective.SEND_RECV, phase, "cp", block, (p.cp - 1) * n)
            # Both buffers are counted; one block is sent.
            out.append(None if r is None else replace(r, nbytes=2 * r.nbytes))
    else:
        for phase in (*forwards, "backward"):
            for size in (3 * width, width):
                nbytes = size * compute_bytes
                out.append(grid.record("cp", Collective.ALL_TO_ALL, phase, "cp", nbytes, n))
    return tuple(r for r in out if r is not None)

"""Expert parallelism's collectives per MoE layer and microbatch, as the runtime issues them
(:func:`hp_dtensor.parallel.expert.run_expert_parallel`, :mod:`hp_train.parallel.expert`).

Forward, on the ``ep`` group: one all-gather of the routing counts (``ep x n_experts``
int64), one all-to-all dispatching the token copies (``top_k`` rows of ``dim`` per token)
and one combining the results back. Each all-to-all's buffer (``hp_fsdp.counting``'s
convention: the larger of its send and receive tensors) is ``max(1, f) x tokens x top_k x dim``
elements of the compute dtype, where ``f`` is the stated imbalance (rows received over rows
sent, :attr:`~hp_planner.price.workload.StepShape.expert_imbalance`). Backward: the two
all-to-alls again, reversed (the same buffers). A recomputing block (any ``ac`` but
``none``) runs its forward's collectives again.

After backward, FSDP all-reduces the gradient tail of each MoE group (router and shared
experts, replicated over ep) over ``ep`` before its reduce-scatter: that all-reduce is an
``ep`` collective too (it is counted with the group's FSDP records).

With ``tp > 1`` each MoE runs in an exact region over ``tp`` (its output's gradient
all-reduced over ``tp`` before its backward, ``tokens x dim``); with ``--ep-tp`` the expert
outputs are also all-reduced over ``tp`` in forward (the received rows) and the routed
tokens' gradient in backward (``tokens x dim``). Those are ``tp`` collectives.
"""

from __future__ import annotations

from hp_layout import Collective
from hp_planner.inputs import JobDims
from hp_planner.price.comm import CollectiveRecord, RankGrid
from hp_planner.price.model import TransformerShape

__all__ = ["expert_records"]

_INT64 = 8


def expert_records(
    model: TransformerShape,
    grid: RankGrid,
    moe_layers: int,
    tokens: int,
    compute_bytes: int,
    *,
    microbatches: int,
    imbalance: float,
    recompute: bool,
) -> tuple[CollectiveRecord, ...]:
    """The expert-parallel collectives of ``moe_layers`` MoE layers over a step of
    ``microbatches`` microbatches of ``tokens`` tokens each (module doc)."""
    p: JobDims = grid.parallel
    moe = model.moe
    if p.ep == 1 or moe is None or moe_layers == 0:
        return ()
    n = moe_layers * microbatches
    rows = tokens * moe.top_k
    buffer = int(max(1.0, imbalance) * rows) * model.dim * compute_bytes
    counts = p.ep * moe.n_experts * _INT64
    forwards = ("forward", "recompute") if recompute else ("forward",)
    out: list[CollectiveRecord | None] = []
    for phase in forwards:
        out.append(grid.record("ep", Collective.ALL_GATHER, phase, "ep", counts, n))
        out.append(grid.record("ep", Collective.ALL_TO_ALL, phase, "ep", buffer, 2 * n))
    out.append(grid.record("ep", Collective.ALL_TO_ALL, "backward", "ep", buffer, 2 * n))
    if p.tp > 1:
        act = tokens * model.dim * compute_bytes
        out.append(grid.record("tp", Collective.ALL_REDUCE, "backward", "tp", act, n))
        if p.ep_tp:
            received = int(imbalance * rows) * model.dim * compute_bytes
            out += [
                grid.record("tp", Collective.ALL_REDUCE, f, "tp", received, n) for f in forwards
            ]
            out.append(grid.record("tp", Collective.ALL_REDUCE, "backward", "tp", act, n))
    return tuple(r for r in out if r is not None)

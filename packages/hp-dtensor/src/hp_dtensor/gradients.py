"""Gradient layouts: where the gradient of a distributed tensor lives.

Every rank's local tensor is its own autograd variable, and collectives backpropagate their
true adjoints (see :mod:`hp_dtensor.collectives`). The local gradients then hold the true
gradient of the global value in the *dual* layout of the forward one:

* ``Shard`` / ``RaggedShard`` -> the same shards;
* ``Replicate`` -> ``Partial(sum)``: each replica's gradient is the contribution of its own
  uses; their sum is the gradient (reduce it when it is needed, e.g. before an update);
* ``Partial(sum)`` -> ``Replicate``: every piece's gradient is the whole gradient;
* ``Partial(avg | max | min)`` -> ``Partial(sum)``: each piece's share of the gradient.
"""

from __future__ import annotations

from hp_layout import Layout, Partial, Placement, ReduceOp, Replicate

__all__ = ["grad_layout"]


def _dual(placement: Placement) -> Placement:
    if isinstance(placement, Replicate):
        return Partial(ReduceOp.SUM)
    if isinstance(placement, Partial):
        return Replicate() if placement.op is ReduceOp.SUM else Partial(ReduceOp.SUM)
    return placement


def grad_layout(layout: Layout) -> Layout:
    """The layout of the local gradients of a tensor distributed as ``layout``."""
    return layout.with_placements([_dual(p) for p in layout.placements], layout.shard_order)

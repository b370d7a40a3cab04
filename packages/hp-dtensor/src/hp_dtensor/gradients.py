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

from typing import Any

from hp_layout import Layout, Partial, Placement, ReduceOp, Replicate

__all__ = ["dual_placement", "grad_layout", "recorded_grad_layout", "set_grad_layout"]

_GRAD_LAYOUT = "_hp_dtensor_grad_layout"


def dual_placement(placement: Placement) -> Placement:
    """The placement of a gradient of a value placed as ``placement`` (see the module)."""
    if isinstance(placement, Replicate):
        return Partial(ReduceOp.SUM)
    if isinstance(placement, Partial):
        return Replicate() if placement.op is ReduceOp.SUM else Partial(ReduceOp.SUM)
    return placement


def grad_layout(layout: Layout) -> Layout:
    """The layout of the local gradients of a tensor distributed as ``layout``."""
    return layout.with_placements(
        [dual_placement(p) for p in layout.placements], layout.shard_order
    )


def set_grad_layout(param: Any, layout: Layout) -> None:
    """Record that ``param``'s gradient has ``layout`` (a DTensor parameter whose gradient was
    reduced in backward, so that it is no longer in the dual layout): ``param.grad`` reports
    it."""
    setattr(param, _GRAD_LAYOUT, layout)


def recorded_grad_layout(param: Any) -> Layout | None:
    """The layout :func:`set_grad_layout` recorded for ``param``'s gradient, or None."""
    layout = getattr(param, _GRAD_LAYOUT, None)
    return layout if isinstance(layout, Layout) else None

"""Reduction of replicated parameters' gradients, bucketed into one collective per backward.

A parallelized parameter that is replicated along some mesh axes gets partial gradients there
(each replica's contribution). Each fresh contribution is stashed in the model's bucket as it
arrives; a callback queued for the end of the backward pass reduces all contributions of one
kind in one flat collective and adds them to the gradients (creating ``.grad`` where the
backward left none). Gradient accumulation over several backward passes works: only fresh
contributions are reduced. Every rank runs the same backward graph, so every rank reduces the
same bucket. Before that, a sum all-reduce over the same group in backward (a row-parallel
output's) takes pending contributions along in its own collective, so in a tensor-parallel
model the reduction usually costs no collective of its own.

Contributions reach the bucket one of two ways:

* production mode has the model read each parameter through a marker inside the model
  (:mod:`hp_dtensor.parallel._region`): only those uses' gradients are partial and stashed,
  while a use by the caller (a penalty on the parameter) reaches ``.grad`` whole, as autograd
  computes it on every rank;
* validation mode, and plans whose ranks each compute a loss of their own (expert
  parallelism), hook the parameter's local tensor (:func:`install_grad_reductions`): every
  contribution is the rank's own, and ``.grad`` accumulates zeros in its place.

The reduction is recorded on the parameter (:func:`grad_reduction_of` reads it; other packages
through :mod:`hp_dtensor.contract`), so a parameter replaced later with the same attributes (as
deferred initialization does) is reduced the same way. A sharder that takes a parameter over
and reduces its gradient itself says so with :func:`hand_over_grad_reduction`; nothing here
touches that parameter's gradient afterwards. Each model has its own bucket (kept on the root
module), so two models' backward passes never share pending contributions.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

import hp_dtensor._comm as _comm
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor import DTensor
from hp_layout import ReduceOp

__all__ = [
    "GradReduction",
    "grad_reduction_handed_over",
    "grad_reduction_of",
    "hand_over_grad_reduction",
    "install_grad_reductions",
    "set_grad_reduction",
]

_SPEC = "_hp_dtensor_grad_reduction"
_OWNER = "_hp_dtensor_grad_hook_owner"
_BUCKET_ATTR = "_hp_dtensor_grad_bucket"
# A production-mode region's token: the region marks this parameter's uses (no leaf hook).
_REGION = "_hp_dtensor_grad_region"
# Set by a sharder that reduces the parameter's gradient itself.
_HANDED_OVER = "_hp_dtensor_grad_reduction_handed_over"


@dataclass(frozen=True)
class GradReduction:
    """Reduce a gradient over ``axes`` of ``mesh``, each with its op.

    Attributes:
        mesh: the mesh of the parameter.
        axes: ``(axis, op)`` pairs, reduced in this order.
    """

    mesh: DeviceMesh
    axes: tuple[tuple[str, ReduceOp], ...]


class _Kind:
    """One distinct reduction of a bucket, interned when hooks are installed: pending
    contributions are keyed by it (an identity hash, not the reduction's field-by-field one),
    and whether it may ride on a sum all-reduce is decided once."""

    __slots__ = ("ride_axis", "spec")

    def __init__(self, spec: GradReduction) -> None:
        self.spec = spec
        # A single sum over one axis may join a sum all-reduce over that axis's group.
        single_sum = len(spec.axes) == 1 and spec.axes[0][1] is ReduceOp.SUM
        self.ride_axis: str | None = spec.axes[0][0] if single_sum else None


@dataclass
class _Bucket:
    """Fresh gradient contributions of one backward pass, per reduction kind."""

    pending: dict[_Kind, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    queued: bool = False
    kinds: dict[GradReduction, _Kind] = field(default_factory=dict)

    def kind(self, spec: GradReduction) -> _Kind:
        """The interned kind of ``spec`` (made on first use)."""
        found = self.kinds.get(spec)
        if found is None:
            found = self.kinds[spec] = _Kind(spec)
        return found

    def add(self, kind: _Kind, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        entries = self.pending.get(kind)
        if entries is None:
            entries = self.pending[kind] = []
        entries.append((leaf, grad))
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def flush(self) -> None:
        pending, self.pending, self.queued = self.pending, {}, False
        for kind, entries in pending.items():
            spec = kind.spec
            flat = torch.cat([grad.reshape(-1) for _, grad in entries])
            for axis, op in spec.axes:
                flat = _comm.all_reduce(flat, op, _comm.AxisGroup.of(spec.mesh, axis))
            offset = 0
            for leaf, grad in entries:
                _deliver(leaf, flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def riders(self, group: _comm.AxisGroup, dtype: torch.dtype) -> list[_comm.Rider]:
        """Pending single-axis sums over ``group`` (they leave the bucket and ride along)."""
        out: list[_comm.Rider] = []
        for kind in list(self.pending):
            if kind.ride_axis is None:
                continue
            own = _comm.AxisGroup.of(kind.spec.mesh, kind.ride_axis)
            if own.process_group is not group.process_group:
                continue
            entries = self.pending[kind]
            if any(grad.dtype != dtype for _, grad in entries):
                continue
            del self.pending[kind]
            out.extend((grad, _delivery(leaf)) for leaf, grad in entries)
        return out


def _deliver(leaf: torch.Tensor, reduced: torch.Tensor) -> None:
    # Whether ``.grad`` exists is read now, not when the contribution arrived: a use outside
    # the model may have created it since.
    if leaf.grad is None:
        leaf.grad = reduced.clone()
    else:
        leaf.grad.add_(reduced)


def _delivery(leaf: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def deliver(reduced: torch.Tensor) -> None:
        _deliver(leaf, reduced)

    return deliver


def bucket_of(root: nn.Module) -> _Bucket:
    """``root``'s bucket, made on first use; its riders join collectives while ``root`` lives."""
    bucket = getattr(root, _BUCKET_ATTR, None)
    if bucket is None:
        bucket = _Bucket()
        object.__setattr__(root, _BUCKET_ATTR, bucket)
        _comm.RIDER_SOURCES.append(bucket.riders)
        weakref.finalize(root, _comm.RIDER_SOURCES.remove, bucket.riders)
    assert isinstance(bucket, _Bucket)
    return bucket


def _hook(
    bucket: _Bucket, kind: _Kind, leaf: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    def stash(grad: torch.Tensor) -> torch.Tensor:
        bucket.add(kind, leaf, grad)
        # Dense zeros: ``.grad`` takes them as they are (an expanded zero would be copied).
        return torch.zeros_like(grad)

    return stash


def set_grad_reduction(
    param: torch.Tensor, mesh: DeviceMesh, axes: Sequence[tuple[str, ReduceOp]]
) -> None:
    """Record that ``param``'s gradient is reduced over ``axes`` (installed separately)."""
    setattr(param, _SPEC, GradReduction(mesh, tuple(axes)))


def grad_reduction_of(param: torch.Tensor) -> GradReduction | None:
    """The reduction recorded for ``param``'s gradient, None if there is none."""
    spec = getattr(param, _SPEC, None)
    return spec if isinstance(spec, GradReduction) else None


def hand_over_grad_reduction(param: torch.Tensor) -> None:
    """Record that a sharder now reduces ``param``'s gradient itself, the reduction
    :func:`grad_reduction_of` gives included: the tensor-parallel executor leaves the gradient
    of ``param`` alone from then on (no marker, no hook of its own)."""
    setattr(param, _HANDED_OVER, True)


def grad_reduction_handed_over(param: torch.Tensor) -> bool:
    """Whether a sharder took ``param``'s gradient reduction over
    (:func:`hand_over_grad_reduction`)."""
    return bool(getattr(param, _HANDED_OVER, False))


def set_grad_region(param: torch.Tensor, token: int) -> None:
    """Record that production-mode region ``token`` marks ``param``'s uses in the model (its
    gradient gets no leaf hook)."""
    setattr(param, _REGION, token)


def grad_region_of(param: torch.Tensor) -> int | None:
    """The token of the region marking ``param``'s uses, None if none does."""
    token = getattr(param, _REGION, None)
    return token if isinstance(token, int) else None


def install_grad_reductions(module: nn.Module) -> None:
    """Hook the recorded reductions on every parameter of ``module`` that lacks its hook and
    whose uses no production-mode region marks (``module``'s bucket collects their
    contributions)."""
    bucket = bucket_of(module)
    for param in module.parameters():
        spec = getattr(param, _SPEC, None)
        if spec is None or getattr(param, _OWNER, None) == id(param):
            continue
        if grad_region_of(param) is not None or grad_reduction_handed_over(param):
            continue
        if not param.requires_grad:
            continue
        leaf = param.to_local() if isinstance(param, DTensor) else param
        leaf.register_hook(_hook(bucket, bucket.kind(spec), leaf))
        setattr(param, _OWNER, id(param))

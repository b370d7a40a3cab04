"""Vocab-parallel cross-entropy: the loss of logits whose class dim is sharded over a mesh axis.

:func:`vocab_parallel_cross_entropy` works on plain local tensors: each rank of the axis holds
a ``torch.chunk`` piece of the classes (uneven and empty pieces allowed) and the whole target
(global class indices). It never gathers the logits: the row maxima are all-reduced (MAX), then
the sums of exponentials, the target logits (each rank contributes the ones in its class
range, the others add zero) and, with label smoothing, the sums of the logits are all-reduced
together (SUM). The loss is the same, bit for bit, on every rank of the axis and equals
``F.cross_entropy`` of the whole logits, ``ignore_index``, ``label_smoothing`` and the three
reductions included. The backward is hand-written and local:
``(softmax - (1 - ls) * onehot - ls / C) * upstream``.

Gradient conventions (``grad_convention``):

* ``"exact"``: every rank's upstream gradient is the whole gradient of the loss (production
  mode: the user calls ``loss.backward()`` on the loss every rank computed identically);
* ``"adjoint"``: the ranks' upstream gradients are pieces summing to the gradient (DTensor's
  convention; ``DTensor.backward`` seeds 1 on coordinate 0 of a Replicate axis and 0
  elsewhere): they are all-reduced over the axis first (one small all-reduce).

Either way each rank's logits gradient is the exact gradient of its shard.

:func:`loss_parallel` is the context manager (torch's name): inside it ``F.cross_entropy``
(and ``nn.CrossEntropyLoss``) computes the vocab-parallel loss, on DTensors (validation mode,
adjoint convention) and, given ``mesh`` and ``axis``, on plain local tensors (production mode,
exact convention).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

import hp_dtensor._comm as _comm
from hp_dtensor._comm import AxisGroup
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor import DTensor
from hp_dtensor.rules.nn import vocab_parallel_cross_entropy_rule
from hp_dtensor.rules.registry import OpCall, ShardingDecision, register_sharding_rule
from hp_layout import Mesh, ReduceOp, chunk_bounds, chunk_sizes

__all__ = ["GradConvention", "loss_parallel", "vocab_parallel_cross_entropy"]

GradConvention = Literal["exact", "adjoint"]
_REDUCTIONS = ("none", "sum", "mean")
_CONVENTIONS = ("exact", "adjoint")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


# The autograd function -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Config:
    """Everything the forward and backward need besides the tensors.

    Attributes:
        group: this rank's group along the vocab axis.
        start: the first global class of this rank's piece.
        num_classes: the global number of classes.
        ignore_index: target value whose rows contribute nothing.
        reduction: ``"none"``, ``"sum"`` or ``"mean"``.
        label_smoothing: the smoothing weight ``ls`` in ``[0, 1]``.
        adjoint: all-reduce the upstream gradient over the axis before using it.
    """

    group: AxisGroup
    start: int
    num_classes: int
    ignore_index: int
    reduction: str
    label_smoothing: float
    adjoint: bool


def _reduce_rows(rows: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / count.to(total.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of ``[rows..., C_local]`` logits (class dim last) against ``[rows...]``
    global class indices; see the module docstring."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, config: _Config
    ) -> torch.Tensor:
        local_classes = logits.shape[-1]
        valid = target != config.ignore_index
        inside = valid & (target >= config.start) & (target < config.start + local_classes)
        local_target = torch.where(inside, target - config.start, torch.zeros_like(target))
        if local_classes:
            local_max = logits.amax(-1)
        else:
            local_max = logits.new_full(logits.shape[:-1], -math.inf)
        row_max = _comm.all_reduce(local_max, ReduceOp.MAX, config.group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        if local_classes:
            picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
            picked = picked.masked_fill(~inside, 0.0)
        else:
            picked = logits.new_zeros(logits.shape[:-1])
        parts = [exp.sum(-1), picked]
        smoothing = config.label_smoothing
        if smoothing:
            parts.append(shifted.sum(-1))
        sums = _comm.all_reduce(torch.stack(parts), ReduceOp.SUM, config.group)
        log_sum = sums[0].log()
        rows = log_sum - sums[1]  # -log_softmax at the target
        if smoothing:
            classes = config.num_classes
            smooth = classes * log_sum - sums[2]  # -sum over classes of log_softmax
            rows = (1.0 - smoothing) * rows + (smoothing / classes) * smooth
        rows = rows.masked_fill(~valid, 0.0)
        count = valid.sum()
        ctx.save_for_backward(exp, sums[0], local_target, inside, valid, count)
        ctx.config = config
        return _reduce_rows(rows, count, config.reduction)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        exp, sum_exp, local_target, inside, valid, count = ctx.saved_tensors
        config: _Config = ctx.config
        upstream = grad.contiguous()
        if config.adjoint:
            upstream = _comm.all_reduce(upstream, ReduceOp.SUM, config.group)
        if config.reduction == "mean":
            upstream = upstream / count.to(upstream.dtype)
        scale = torch.where(valid, upstream.expand(valid.shape), torch.zeros_like(upstream))
        out = exp / sum_exp.unsqueeze(-1)  # this rank's slice of the softmax
        smoothing = config.label_smoothing
        if smoothing:
            out.sub_(smoothing / config.num_classes)
        if out.shape[-1]:
            hit = inside.to(out.dtype).mul_(smoothing - 1.0).unsqueeze(-1)
            out.scatter_add_(-1, local_target.unsqueeze(-1), hit)
        out.mul_(scale.unsqueeze(-1))
        return out, None, None


def _apply(logits: torch.Tensor, target: torch.Tensor, config: _Config) -> torch.Tensor:
    apply = cast(Callable[..., torch.Tensor], _VocabParallelCrossEntropy.apply)
    return apply(logits, target, config)


# The function on plain tensors ------------------------------------------------------------------


def _check_arguments(
    logits: torch.Tensor,
    target: torch.Tensor,
    reduction: str,
    label_smoothing: float,
    grad_convention: str,
) -> None:
    if logits.dim() == 0 or not logits.is_floating_point():
        raise ValueError(
            "vocab_parallel_cross_entropy: logits must be a floating-point tensor of shape "
            f"[N, C, d...], [N, C] or [C]; got {logits.dtype} of shape {tuple(logits.shape)}"
        )
    class_dim = 1 if logits.dim() >= 2 else 0
    want = tuple(n for d, n in enumerate(logits.shape) if d != class_dim)
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(
            "vocab_parallel_cross_entropy: target must hold class indices (an integer tensor of "
            f"shape {want}); got {target.dtype} (class-probability targets are not supported)"
        )
    if tuple(target.shape) != want:
        raise ValueError(
            f"vocab_parallel_cross_entropy: target of shape {tuple(target.shape)} does not fit "
            f"local logits of shape {tuple(logits.shape)}; expected {want} (class dim "
            f"{class_dim} removed)"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"vocab_parallel_cross_entropy: reduction must be 'none', 'sum' or 'mean', got "
            f"{reduction!r}"
        )
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(
            f"vocab_parallel_cross_entropy: label_smoothing must be in [0, 1], got "
            f"{label_smoothing}"
        )
    if grad_convention not in _CONVENTIONS:
        raise ValueError(
            "vocab_parallel_cross_entropy: grad_convention must be 'exact' (production: every "
            "rank backpropagates the whole gradient) or 'adjoint' (DTensor: the ranks' "
            f"gradients are pieces that sum to it), got {grad_convention!r}"
        )


def _class_range(
    local_classes: int, num_classes: int | None, group: AxisGroup, device: torch.device
) -> tuple[int, int]:
    """``(start, num_classes)``: where this rank's piece starts and the global class count.

    Without ``num_classes`` the local extents are all-gathered (one small collective); the
    pieces must be the ``torch.chunk`` split either way.
    """
    if num_classes is None:
        extent = torch.tensor([local_classes], dtype=torch.int64, device=device)
        extents = _comm.all_gather_dim(extent, 0, [1] * group.size, group).tolist()
        num_classes = int(sum(extents))
        if tuple(extents) != chunk_sizes(num_classes, group.size):
            raise ValueError(
                f"vocab_parallel_cross_entropy: the class pieces along the axis have sizes "
                f"{extents}, which is not the torch.chunk split of {num_classes} classes over "
                f"{group.size} ranks ({list(chunk_sizes(num_classes, group.size))})"
            )
    if num_classes <= 0:
        raise ValueError(
            f"vocab_parallel_cross_entropy: needs at least one class, got {num_classes}"
        )
    start, stop = chunk_bounds(num_classes, group.size, group.index)
    if stop - start != local_classes:
        raise ValueError(
            f"vocab_parallel_cross_entropy: coordinate {group.index} of {group.size} should hold "
            f"classes [{start}, {stop}) of {num_classes} (torch.chunk), but its logits have "
            f"{local_classes}"
        )
    return start, num_classes


def _check_targets(target: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    """Fail on targets outside ``[0, num_classes)`` (asynchronously on accelerators).

    The targets are replicated over the axis, so every rank fails alike, before any
    collective of the loss.
    """
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    torch._assert_async(
        ~bad.any(),
        f"vocab_parallel_cross_entropy: a target is outside [0, {num_classes}) and is not "
        f"ignore_index ({ignore_index})",
    )


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    mesh: DeviceMesh,
    axis: str,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    grad_convention: GradConvention = "exact",
    num_classes: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of logits whose class dim is split over mesh axis ``axis``.

    Args:
        logits: this rank's ``torch.chunk`` piece of the class dim (dim 1 of ``[N, C, d...]``
            or ``[N, C]``, dim 0 of ``[C]``), as ``F.cross_entropy`` takes them; pieces may be
            uneven or empty.
        target: global class indices, the whole target on every rank of the axis (shape of
            the logits without the class dim).
        mesh, axis: the mesh and the axis the classes are split over.
        ignore_index, reduction, label_smoothing: as ``F.cross_entropy`` (ignored rows add
            0 and are not counted by ``'mean'``).
        grad_convention: ``"exact"`` (the upstream gradient is whole on every rank) or
            ``"adjoint"`` (pieces that sum to it; all-reduced first).
        num_classes: the global class count; without it one small all-gather finds it.

    Returns:
        The loss of the whole logits, identical on every rank of the axis; ``'none'`` gives
        the shape of ``target``. Half-precision logits are computed in float32 and the loss
        is returned in the logits' dtype.

    Every rank of the axis must call it (it runs the same collectives everywhere, empty pieces
    included).
    """
    _check_arguments(logits, target, reduction, label_smoothing, grad_convention)
    group = AxisGroup.of(mesh, axis)
    class_dim = 1 if logits.dim() >= 2 else 0
    start, classes = _class_range(logits.shape[class_dim], num_classes, group, logits.device)
    _check_targets(target, classes, ignore_index)
    x = logits.movedim(1, -1) if class_dim == 1 else logits.unsqueeze(0)
    t = target if class_dim == 1 else target.unsqueeze(0)
    if x.dtype in _LOW_PRECISION:
        x = x.float()
    config = _Config(
        group,
        start,
        classes,
        int(ignore_index),
        reduction,
        float(label_smoothing),
        grad_convention == "adjoint",
    )
    loss = _apply(x, t, config)
    if class_dim == 0 and reduction == "none":
        loss = loss.squeeze(0)
    return loss.to(logits.dtype)


# loss_parallel ---------------------------------------------------------------------------------


class _Bypass(threading.local):
    """Depth of calls in this thread that must reach the real ``F.cross_entropy``."""

    depth = 0


_BYPASS = _Bypass()


@contextlib.contextmanager
def _bypassed() -> Iterator[None]:
    _BYPASS.depth += 1
    try:
        yield
    finally:
        _BYPASS.depth -= 1


def _loss_parallel_cross_entropy(*args: Any, **kwargs: Any) -> Any:
    """``F.cross_entropy`` as called under :func:`loss_parallel` with DTensor arguments.

    A function object of its own, so DTensor dispatch looks up its own sharding rule and
    caches its decisions apart from plain ``F.cross_entropy``'s (the decision cache is keyed
    by the called function). On plain tensors it is ``F.cross_entropy`` itself.
    """
    tensors = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
    if has_torch_function(tensors):
        return handle_torch_function(_loss_parallel_cross_entropy, tensors, *args, **kwargs)
    with _bypassed():
        return F.cross_entropy(*args, **kwargs)


def _rule_local(
    input: torch.Tensor,
    target: torch.Tensor,
    *,
    mesh: Mesh,
    axis: str,
    num_classes: int,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """The local loss of the sharding rule (adjoint convention, DTensor's)."""
    return vocab_parallel_cross_entropy(
        input,
        target,
        mesh=DeviceMesh.lookup(input.device.type, mesh),
        axis=axis,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        grad_convention="adjoint",
        num_classes=num_classes,
    )


@register_sharding_rule(_loss_parallel_cross_entropy)
def _loss_parallel_rule(call: OpCall) -> ShardingDecision:
    """cross_entropy under loss_parallel: see ``rules.nn.vocab_parallel_cross_entropy_rule``."""
    return vocab_parallel_cross_entropy_rule(call, _rule_local)


def _has_dtensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(isinstance(a, DTensor) for a in (*args, *kwargs.values()))


class _LossParallelMode(TorchFunctionMode):
    """Redirects ``F.cross_entropy`` to the vocab-parallel loss; every other call passes.

    Calls made with torch-function subclasses disabled (the local computations of DTensor
    ops) and calls from :func:`_loss_parallel_cross_entropy`'s plain path are not redirected.
    """

    def __init__(self, mesh: DeviceMesh | None, axis: str | None) -> None:
        super().__init__()
        self.mesh = mesh
        self.axis = axis

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy and _BYPASS.depth == 0 and torch._C._is_torch_function_enabled():
            if _has_dtensor(args, kwargs):
                return _loss_parallel_cross_entropy(*args, **kwargs)
            return self._plain(*args, **kwargs)
        return func(*args, **kwargs)

    def _plain(
        self,
        input: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None = None,
        size_average: bool | None = None,
        ignore_index: int = -100,
        reduce: bool | None = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """Production mode: plain local logits, exact upstream gradients."""
        if self.mesh is None or self.axis is None:
            raise ValueError(
                "loss_parallel(): F.cross_entropy got plain tensors, so it needs the mesh and "
                "the axis the classes are split over: use `with loss_parallel(mesh, axis):` "
                "(production mode); DTensor logits need no arguments"
            )
        if weight is not None:
            raise ValueError(
                "loss_parallel: class weights are not supported by the vocab-parallel "
                "cross-entropy; call F.cross_entropy without weight (or outside loss_parallel "
                "on gathered logits)"
            )
        if size_average is not None or reduce is not None:
            from torch.nn import _reduction

            reduction = _reduction.legacy_get_string(size_average, reduce, emit_warning=False)
        return vocab_parallel_cross_entropy(
            input,
            target,
            mesh=self.mesh,
            axis=self.axis,
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            grad_convention="exact",
        )


@contextlib.contextmanager
def loss_parallel(mesh: DeviceMesh | None = None, axis: str | None = None) -> Iterator[None]:
    """Compute ``F.cross_entropy`` vocab-parallel inside the block (torch's name).

    * DTensor logits (validation mode): when the class dim is sharded on exactly one mesh axis
      (and the target is a DTensor of class indices, without class weights), the class dim
      stays sharded and the loss comes out ``Replicate`` on that axis (batch-sharding axes as
      for plain ``F.cross_entropy``); other calls behave as outside the block. No arguments
      are needed; the layout names the axis.
    * Plain local logits (production mode): pass ``mesh`` and ``axis``; each rank's logits are
      its ``torch.chunk`` piece of the classes along ``axis`` and the target holds global
      class indices. The loss equals the single-device loss on every rank, and
      ``loss.backward()`` (seed 1 on every rank) gives each rank its shard's exact gradient.

    The block only changes ``F.cross_entropy`` calls made in this thread; the backward may run
    outside it.
    """
    if (mesh is None) != (axis is None):
        raise ValueError("loss_parallel: give both mesh and axis (production mode) or neither")
    if mesh is not None and axis not in mesh.mesh_dim_names:
        raise ValueError(
            f"loss_parallel: axis {axis!r} is not an axis of {mesh!r} "
            f"(axes {list(mesh.mesh_dim_names)})"
        )
    with _LossParallelMode(mesh, axis):
        yield

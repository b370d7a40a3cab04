"""Interop with ``torch.distributed.tensor``: the layout of any tensor, zero-copy conversions
between our DTensor and torch's, and state dicts for ``torch.distributed.checkpoint``.

Layouts
    :func:`layout_of` answers for our :class:`~hp_dtensor.DTensor`, for a torch ``DTensor``,
    for a plain tensor annotated with :func:`annotate_layout` (production mode keeps
    parameters as plain local shards annotated with their layout) and for any other plain
    tensor (a single-rank, replicated layout). It is how other packages (fsdp, muon) learn
    who holds what.

Placements (what maps exactly)
    ``Shard(d)``, ``Replicate()`` and ``Partial(sum | avg | max | min)`` map one to one.
    A tensor dim sharded by several mesh axes is nested in both libraries: ours records the
    nesting in ``Layout.shard_order``; torch encodes an order other than mesh order with
    ``_StridedShard(d, split_factor=f)`` placements, ``f`` being the product of the sizes of
    the axes that shard ``d`` earlier in the order but sit later in the mesh. FSDP2 on a TP
    mesh ``(dp, tp)`` gives ``[_StridedShard(0, split_factor=tp), Shard(0)]``, which is our
    ``[Shard(0), Shard(0)]`` with ``shard_order=("tp", "dp")``. Torch splits a
    ``_StridedShard`` axis by its own rule (chunk into ``f`` pieces, chunk each piece, join
    the pieces), which equals nested ``torch.chunk`` for even shapes and for many uneven ones,
    but not all (e.g. 7 rows on a ``(dp=3, tp=2)`` mesh): every conversion checks, for the
    actual global shape, that both libraries give every rank the same elements, and raises
    :class:`InteropError` otherwise. ``RaggedShard``, torch's ``_MaskPartial`` and other
    private ``Partial`` subclasses, ``Partial("product")`` and the bitwise reductions have no
    counterpart and raise :class:`InteropError`.

Conversions
    :func:`to_torch_dtensor` and :func:`from_torch_dtensor` share storage (no copy) and are
    differentiable. Our local gradients live in the *dual* layout
    (:func:`hp_dtensor.grad_layout`), torch's are described by the placements handed to
    ``DTensor.from_local`` / ``to_local`` as ``grad_placements``; the conversions pass the
    placements that describe the gradients truthfully, so the global gradient is exact on
    both sides. Going to torch, the local gradient of a ``Partial(avg | max | min)`` piece is
    the true derivative with respect to that piece (``g / n``, or ``g`` split evenly among
    the ranks holding the extreme value). A replicated torch leaf that receives its gradient
    from our side may get it as a ``Partial(sum)`` torch DTensor (reduce it with
    ``redistribute`` when needed).

Checkpoints
    :func:`to_torch_state_dict` turns our DTensors in a (nested) state dict into torch
    DTensors sharing storage, which ``torch.distributed.checkpoint.save`` writes and
    ``torch.distributed.checkpoint.load`` fills in place (so loading into the converted dict
    fills our DTensors, whatever layout they have); :func:`from_torch_state_dict` converts
    back. torch refuses to checkpoint ``Partial`` DTensors: reduce them before saving.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist

import hp_dtensor._comm as _comm
from hp_dtensor._comm import AxisGroup
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor import DTensor
from hp_dtensor.gradients import grad_layout
from hp_layout import (
    Layout,
    Mesh,
    Partial,
    Placement,
    RaggedShard,
    ReduceOp,
    Replicate,
    Shard,
    chunk_bounds,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Placement as TorchPlacement

__all__ = [
    "LAYOUT_ATTRIBUTE",
    "InteropError",
    "annotate_layout",
    "from_torch_dtensor",
    "from_torch_state_dict",
    "is_torch_dtensor",
    "layout_from_torch",
    "layout_of",
    "mesh_from_torch",
    "placement_from_torch",
    "style_placement",
    "to_torch_dtensor",
    "to_torch_state_dict",
    "torch_device_mesh",
    "torch_dtensor_like",
    "torch_placement",
    "torch_placements",
]

LAYOUT_ATTRIBUTE = "_hp_dtensor_layout"
"""The attribute :func:`annotate_layout` sets on a plain tensor (its ``hp_layout.Layout``)."""

PLAIN_TENSOR_AXIS = "replica"
"""Axis name of the single-rank mesh :func:`layout_of` gives a plain tensor."""

_T = TypeVar("_T", bound=torch.Tensor)

_Interval = tuple[int, int]


class InteropError(ValueError):
    """A layout or placement has no exact counterpart in the other library."""


# torch.distributed.tensor takes about a second to import, so this module imports it on first
# use; a value cannot be a torch DTensor before that module is loaded.


def _is_torch_dtensor(value: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def is_torch_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (without importing torch's
    DTensor where it is not loaded yet)."""
    return _is_torch_dtensor(value)


def torch_dtensor_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a torch DTensor with ``like``'s mesh, placements, global shape and stride
    (``like`` a torch DTensor; ``local`` this rank's local tensor of that layout). No
    communication."""
    from torch.distributed.tensor import DTensor as TorchDTensor

    spec: Any = like
    out: torch.Tensor = TorchDTensor.from_local(
        local,
        spec.device_mesh,
        spec.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
    return out


# Layouts of any tensor --------------------------------------------------------------------------


def _current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def layout_of(t: torch.Tensor) -> Layout:
    """The ``hp_layout.Layout`` of ``t``: which ranks hold which part of its global value.

    * our :class:`~hp_dtensor.DTensor`: its layout;
    * a torch ``DTensor``: its mesh (rank grid and axis names; unnamed axes become
      ``dim0, dim1, ...``), placements and global shape (see :func:`layout_from_torch`;
      raises :class:`InteropError` where no exact counterpart exists);
    * a plain tensor or ``nn.Parameter`` annotated by :func:`annotate_layout`: that layout
      (the tensor is this rank's local shard of it);
    * any other plain tensor: ``Layout(t.shape, Mesh((1,), ("replica",), ranks=(r,)),
      [Replicate()])`` where ``r`` is the current rank (0 without ``torch.distributed``) --
      a single-rank, replicated layout: the tensor is whole, and only this rank is known
      to hold it.
    """
    if isinstance(t, DTensor):
        return t.dist_layout
    if _is_torch_dtensor(t):
        return layout_from_torch(
            tuple(t.shape),
            mesh_from_torch(t.device_mesh),  # type: ignore[attr-defined]
            t.placements,  # type: ignore[attr-defined]
        )
    annotated = getattr(t, LAYOUT_ATTRIBUTE, None)
    if annotated is not None:
        if not isinstance(annotated, Layout):
            raise TypeError(
                f"tensor attribute {LAYOUT_ATTRIBUTE!r} holds {type(annotated).__name__}, not "
                "an hp_layout.Layout; set it with hp_dtensor.interop.annotate_layout"
            )
        return annotated
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"layout_of needs a tensor, got {type(t).__name__}")
    mesh = Mesh((1,), (PLAIN_TENSOR_AXIS,), (_current_rank(),))
    return Layout(tuple(t.shape), mesh, [Replicate()])


def annotate_layout(t: _T, layout: Layout, *, rank: int | None = None) -> _T:
    """Mark the plain tensor ``t`` as ``rank``'s local shard of ``layout``; returns ``t``.

    :func:`layout_of` then returns ``layout`` for ``t``. ``rank`` defaults to the current
    rank (0 without ``torch.distributed``); ``t.shape`` must be ``layout.local_shape(rank)``.
    The attribute lives on this tensor object only: ``t.detach()``, ``t.clone()`` and the
    results of ops on ``t`` are not annotated.

    Raises:
        TypeError: ``t`` is a DTensor (ours or torch's; their layout is their own) or
            ``layout`` is not an ``hp_layout.Layout``.
        ValueError: ``rank`` is not in the layout's mesh, or ``t`` has the wrong shape.
    """
    if isinstance(t, DTensor) or _is_torch_dtensor(t):
        raise TypeError(
            f"annotate_layout takes a plain local tensor; a {type(t).__name__} carries its "
            "own layout"
        )
    if not isinstance(layout, Layout):
        raise TypeError(f"annotate_layout needs an hp_layout.Layout, got {type(layout).__name__}")
    me = _current_rank() if rank is None else rank
    if me not in layout.mesh:
        raise ValueError(
            f"rank {me} is not in {layout.mesh!r}; only the mesh's ranks hold shards of {layout!r}"
        )
    expected = layout.local_shape(me)
    if tuple(t.shape) != expected:
        raise ValueError(
            f"rank {me}: tensor of shape {tuple(t.shape)} cannot be the local shard of "
            f"{layout!r}, which gives this rank shape {expected}"
        )
    setattr(t, LAYOUT_ATTRIBUTE, layout)
    return t


# Torch placement semantics (pure) ---------------------------------------------------------------


def _take(runs: Sequence[_Interval], start: int, stop: int) -> list[_Interval]:
    """Positions ``[start, stop)`` of the index sequence that ``runs`` concatenate."""
    out: list[_Interval] = []
    seen = 0
    for a, b in runs:
        lo, hi = max(start - seen, 0), min(stop - seen, b - a)
        if lo < hi:
            out.append((a + lo, a + hi))
        seen += b - a
        if seen >= stop:
            break
    return out


def _length(runs: Sequence[_Interval]) -> int:
    return sum(b - a for a, b in runs)


def _torch_split(runs: list[_Interval], parts: int, index: int, factor: int) -> list[_Interval]:
    """What torch keeps at coordinate ``index`` of an axis of ``parts`` ranks.

    ``Shard`` (``factor`` 1) keeps piece ``index`` of ``torch.chunk``; ``_StridedShard``
    chunks into ``factor`` pieces, chunks each of them into ``parts`` and joins their
    pieces ``index``.
    """
    total = _length(runs)
    out: list[_Interval] = []
    for j in range(factor):
        lo, hi = chunk_bounds(total, factor, j)
        a, b = chunk_bounds(hi - lo, parts, index)
        out += _take(runs, lo + a, lo + b)
    return out


def _merged(runs: Sequence[_Interval]) -> list[_Interval]:
    out: list[_Interval] = []
    for a, b in runs:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _split_factor(placement: TorchPlacement) -> int:
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.split_factor if isinstance(placement, _StridedShard) else 1  # type: ignore[return-value]


def _check_same_elements(layout: Layout, placements: Sequence[TorchPlacement]) -> None:
    """Raise unless torch's ``placements`` give every coordinate ``layout``'s elements."""
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = layout.mesh
    for dim, length in enumerate(layout.global_shape):
        axes = [
            i
            for i, p in enumerate(placements)
            if isinstance(p, TorchShard | _StridedShard) and p.dim == dim
        ]
        for coords in itertools.product(*(range(mesh.shape[i]) for i in axes)):
            coordinate = [0] * mesh.ndim
            runs: list[_Interval] = [(0, length)]
            for axis, c in zip(axes, coords, strict=True):
                coordinate[axis] = c
                runs = _torch_split(runs, mesh.shape[axis], c, _split_factor(placements[axis]))
            ours = _merged([layout.dim_interval(dim, coordinate)])
            theirs = _merged(runs)
            if ours != theirs:
                where = {mesh.axis_names[a]: c for a, c in zip(axes, coords, strict=True)}
                raise InteropError(
                    f"torch placements {list(placements)} and {layout!r} give mesh coordinate "
                    f"{where} different elements of dim {dim}: torch {theirs}, hp_layout "
                    f"{ours}. Torch's _StridedShard splits unevenly shaped dims differently "
                    "from nested torch.chunk; use a shape divisible by the product of the "
                    "axis sizes sharding that dim, or the default (mesh) shard order"
                )


def _torch_reduce_op(op: ReduceOp) -> str:
    return op.value


def _our_reduce_op(placement: TorchPartial) -> ReduceOp:
    name = placement.reduce_op
    try:
        return ReduceOp(name)
    except ValueError:
        known = ", ".join(repr(o.value) for o in ReduceOp)
        raise InteropError(
            f"torch {placement!r} reduces with {name!r}; hp_layout's Partial knows {known}"
        ) from None


def _nesting_factors(order: Sequence[int], mesh_shape: Sequence[int]) -> dict[int, int]:
    """torch's split factor of each axis in ``order`` (the order axes shard one dim).

    An axis's factor is the product of the sizes of the axes that shard earlier in
    ``order`` but sit later in the mesh.
    """
    return {
        axis: math.prod(mesh_shape[a] for a in order[:k] if a > axis)
        for k, axis in enumerate(order)
    }


@lru_cache(maxsize=4096)
def torch_placements(layout: Layout) -> tuple[TorchPlacement, ...]:
    """torch placements equivalent to ``layout`` (``_StridedShard`` for non-default nesting).

    Raises:
        InteropError: ``layout`` has a ``RaggedShard``, or torch's ``_StridedShard`` would
            split its actual shape differently from our nested ``torch.chunk``.
    """
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[TorchPlacement] = []
    for name, placement in zip(layout.mesh.axis_names, layout.placements, strict=True):
        if isinstance(placement, RaggedShard):
            raise InteropError(
                f"{placement!r} on mesh axis {name!r} has no torch counterpart (torch cannot "
                "split a flattened range); redistribute to Shard or Replicate first"
            )
        if isinstance(placement, Replicate):
            out.append(TorchReplicate())
        elif isinstance(placement, Partial):
            out.append(TorchPartial(_torch_reduce_op(placement.op)))
        else:
            out.append(TorchShard(placement.dim))
    for dim in range(layout.ndim):
        order = [layout.mesh.axis_index(n) for n in layout.dim_sharding(dim)]
        for axis, factor in _nesting_factors(order, layout.mesh.shape).items():
            if factor > 1:
                out[axis] = _StridedShard(dim, split_factor=factor)
    _check_same_elements(layout, out)
    return tuple(out)


def _shard_order_from_torch(
    mesh: Mesh, placements: Sequence[TorchPlacement], ndim: int
) -> list[str]:
    """Our shard order for torch ``placements``: per dim, the nesting whose factors match."""
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    order: list[str] = []
    for dim in range(ndim):
        axes = [
            i
            for i, p in enumerate(placements)
            if isinstance(p, TorchShard | _StridedShard) and p.dim == dim
        ]
        wanted = {a: _split_factor(placements[a]) for a in axes}
        for candidate in itertools.permutations(axes):
            if _nesting_factors(candidate, mesh.shape) == wanted:
                order += [mesh.axis_names[a] for a in candidate]
                break
        else:
            raise InteropError(
                f"torch placements {list(placements)} shard dim {dim} with split factors "
                f"{ {mesh.axis_names[a]: f for a, f in wanted.items()} } that no nesting order "
                f"of those mesh axes (sizes {[mesh.shape[a] for a in axes]}) produces"
            )
    return order


def _our_placement(placement: TorchPlacement, axis: str, ndim: int) -> Placement:
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    kind = type(placement)
    if kind is TorchReplicate:
        return Replicate()
    if kind is TorchShard or kind is _StridedShard:
        assert isinstance(placement, TorchShard | _StridedShard)
        return Shard(placement.dim % max(ndim, 1))
    if kind is TorchPartial:
        assert isinstance(placement, TorchPartial)
        return Partial(_our_reduce_op(placement))
    raise InteropError(
        f"torch placement {placement!r} (type {kind.__name__}) on mesh axis {axis!r} has no "
        "hp_layout counterpart; redistribute the torch DTensor to Shard, Replicate or "
        "Partial first"
    )


def placement_from_torch(placement: object) -> Placement:
    """Our placement for one torch placement (``Replicate``, ``Shard(d)`` with ``d`` kept as
    given, negative too, or ``Partial``), as a style on one mesh axis takes it.

    Raises:
        InteropError: ``placement`` is a torch placement with no counterpart (``_StridedShard``,
            ``_MaskPartial``, ...), or no placement of either library.
    """
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    kind = type(placement)
    if kind is TorchReplicate:
        return Replicate()
    if kind is TorchShard:
        return Shard(cast("TorchShard", placement).dim)
    if kind is TorchPartial:
        return Partial(_our_reduce_op(cast("TorchPartial", placement)))
    raise InteropError(
        f"{placement!r} (type {kind.__module__}.{kind.__qualname__}) is not a placement this "
        "style can take; give hp_layout's or torch.distributed.tensor's Replicate(), Shard(dim) "
        "or Partial()"
    )


def style_placement(value: object) -> Placement:
    """``value`` as our placement: ours unchanged, a torch one converted
    (:func:`placement_from_torch`); anything else is refused."""
    if isinstance(value, Replicate | Shard | Partial | RaggedShard):
        return value
    return placement_from_torch(value)


def torch_placement(placement: Placement) -> TorchPlacement:
    """torch's placement for one of ours on one mesh axis (``Shard(d)`` keeps ``d`` as given).

    Raises:
        InteropError: a ``RaggedShard`` (torch cannot split a flattened range).
    """
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    if isinstance(placement, Replicate):
        return TorchReplicate()
    if isinstance(placement, Partial):
        return TorchPartial(_torch_reduce_op(placement.op))
    if isinstance(placement, Shard):
        return TorchShard(placement.dim)
    raise InteropError(
        f"{placement!r} has no torch counterpart (torch cannot split a flattened range); "
        "redistribute to Shard or Replicate first"
    )


def _normalized(placements: Sequence[TorchPlacement], ndim: int) -> list[TorchPlacement]:
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[TorchPlacement] = []
    for p in placements:
        if type(p) is TorchShard and p.dim < 0:
            p = TorchShard(p.dim % ndim)
        elif type(p) is _StridedShard and p.dim < 0:
            p = _StridedShard(p.dim % ndim, split_factor=p.split_factor)
        out.append(p)
    return out


def layout_from_torch(
    global_shape: Sequence[int], mesh: Mesh, placements: Sequence[TorchPlacement]
) -> Layout:
    """The layout equivalent to torch ``placements`` of a tensor of ``global_shape``.

    Pure (no process group needed; results are cached); ``mesh`` is the torch mesh as an
    ``hp_layout.Mesh`` (see :func:`mesh_from_torch`).

    Raises:
        InteropError: a placement has no counterpart, ``_StridedShard`` split factors
            encode no nesting order, or torch's split of this shape differs from ours.
    """
    return _layout_from_torch(tuple(int(n) for n in global_shape), mesh, tuple(placements))


@lru_cache(maxsize=4096)
def _layout_from_torch(
    shape: tuple[int, ...], mesh: Mesh, placements: tuple[TorchPlacement, ...]
) -> Layout:
    torch_given = _normalized(placements, len(shape))
    if len(torch_given) != mesh.ndim:
        raise InteropError(
            f"{len(torch_given)} torch placements for {mesh!r}, which has {mesh.ndim} axes"
        )
    ours = [
        _our_placement(p, name, len(shape))
        for p, name in zip(torch_given, mesh.axis_names, strict=True)
    ]
    order = _shard_order_from_torch(mesh, torch_given, len(shape))
    layout = Layout(shape, mesh, ours, order)
    _check_same_elements(layout, torch_given)
    return layout


# Meshes -----------------------------------------------------------------------------------------


def mesh_from_torch(mesh: TorchDeviceMesh) -> Mesh:
    """The ``hp_layout.Mesh`` of a torch ``DeviceMesh`` (same rank grid; unnamed axes become
    ``dim0, dim1, ...``)."""
    grid = mesh.mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(grid.ndim))
    return Mesh(tuple(grid.shape), tuple(names), [int(r) for r in grid.flatten().tolist()])


def torch_device_mesh(mesh: DeviceMesh) -> TorchDeviceMesh:
    """The torch ``DeviceMesh`` of ``mesh`` (built once per mesh and world, see
    :meth:`DeviceMesh.to_torch`; the first build is collective over the job)."""
    torch_mesh: TorchDeviceMesh = mesh.to_torch()
    return torch_mesh


# Gradients at the boundary ----------------------------------------------------------------------


class _PartialPieceAdjoint(torch.autograd.Function):
    """Identity on a ``Partial(avg | max | min)`` piece (a view); the backward turns the
    replicated gradient ``g`` of the reduced value into the derivative for this piece."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, op: ReduceOp, axes: tuple[str, ...], mesh: DeviceMesh
    ) -> torch.Tensor:
        ctx.op, ctx.axes, ctx.mesh = op, axes, mesh
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        groups = [AxisGroup.of(ctx.mesh, axis) for axis in ctx.axes]
        if ctx.op is ReduceOp.AVG:
            return grad / math.prod(g.size for g in groups), None, None, None
        (x,) = ctx.saved_tensors
        result = x
        for group in groups:
            result = _comm.all_reduce(result, ctx.op, group)
        hit = (x == result).to(grad.dtype)
        count = hit
        for group in groups:
            count = _comm.all_reduce(count, ReduceOp.SUM, group)
        return grad * hit / count.clamp_min(1), None, None, None


def _dual_torch_placements(layout: Layout) -> tuple[TorchPlacement, ...]:
    """torch placements of the gradient of ``layout`` in our dual layout."""
    return torch_placements(grad_layout(layout))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return tuple(strides)


# Conversions ------------------------------------------------------------------------------------


def to_torch_dtensor(x: DTensor) -> TorchDTensor:
    """``x`` as a torch ``DTensor`` over the same ranks, sharing ``x``'s local storage.

    Differentiable: the gradient torch computes for the result reaches ``x``'s local tensor
    in our dual layout (a replicated torch gradient of a ``Replicate`` axis becomes a
    ``Partial(sum)`` partition; the pieces of a ``Partial(avg | max | min)`` get their true
    derivatives).

    Raises:
        InteropError: the layout has no exact torch counterpart (``RaggedShard``, or a
            nesting torch's ``_StridedShard`` splits differently for this shape).
    """
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Replicate as TorchReplicate

    if not isinstance(x, DTensor):
        raise TypeError(f"to_torch_dtensor takes an hp_dtensor.DTensor, got {type(x).__name__}")
    layout = x.dist_layout
    placements = torch_placements(layout)
    grad_placements = list(_dual_torch_placements(layout))
    local = x.to_local()
    for axis, p in enumerate(layout.placements):
        if isinstance(p, Partial):
            grad_placements[axis] = TorchReplicate()
    partial_ops = {p.op for p in layout.placements if isinstance(p, Partial)}
    if partial_ops - {ReduceOp.SUM} and local.requires_grad and torch.is_grad_enabled():
        (op,) = partial_ops
        apply = cast(Callable[..., torch.Tensor], _PartialPieceAdjoint.apply)  # untyped in torch
        local = apply(local, op, layout.partial_axes, x.device_mesh)
    shape = layout.global_shape
    return TorchDTensor.from_local(
        local,
        device_mesh=torch_device_mesh(x.device_mesh),
        placements=placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=_contiguous_strides(shape),
        grad_placements=grad_placements,
    )


def from_torch_dtensor(t: TorchDTensor) -> DTensor:
    """The torch ``DTensor`` ``t`` as our DTensor, sharing ``t``'s local storage.

    Differentiable: our local gradients (in the dual layout) are handed to torch with the
    placements that describe them (``Partial(sum)`` for a replicated or an
    ``avg | max | min`` partial axis, ``Replicate`` for a ``Partial(sum)`` axis, the same
    shards otherwise).

    Raises:
        InteropError: ``t``'s placements have no exact counterpart (see :func:`layout_of`).
    """
    if not _is_torch_dtensor(t):
        raise TypeError(f"from_torch_dtensor takes a torch DTensor, got {type(t).__name__}")
    layout = layout_of(t)
    mesh = DeviceMesh.from_torch(t.device_mesh)
    local = t.to_local(grad_placements=_dual_torch_placements(layout))
    return DTensor.from_local(
        local,
        mesh,
        layout.placements,
        shape=layout.global_shape,
        shard_order=layout.shard_order,
        # The torch DTensor's own metadata is the layout: nothing for the ranks to compare.
        run_check=False,
    )


def _convert(value: Any, ours_to_torch: bool) -> Any:
    if ours_to_torch and isinstance(value, DTensor):
        return to_torch_dtensor(value)
    if not ours_to_torch and _is_torch_dtensor(value):
        return from_torch_dtensor(value)
    if isinstance(value, Mapping):
        return {k: _convert(v, ours_to_torch) for k, v in value.items()}
    if isinstance(value, list):
        return [_convert(v, ours_to_torch) for v in value]
    if isinstance(value, tuple):
        return tuple(_convert(v, ours_to_torch) for v in value)
    return value


def to_torch_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` (nested dicts, lists and tuples included) with each of our
    DTensors replaced by a torch DTensor sharing its storage; other values are kept as they
    are (the same objects).

    Save the result with ``torch.distributed.checkpoint.save``; load a checkpoint into our
    DTensors by converting them with this function and passing the result to
    ``torch.distributed.checkpoint.load`` (it fills the shared storage in place). The
    checkpoint does not depend on the layouts: it loads into any other layout, or into whole
    plain tensors. torch's checkpointing refuses ``Partial`` DTensors ("not supported for
    DTensor with partial placements"): reduce them before saving.
    """
    converted: dict[str, Any] = _convert(state_dict, ours_to_torch=True)
    return converted


def from_torch_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` with each torch DTensor replaced by our DTensor sharing its
    storage; other values are kept as they are."""
    converted: dict[str, Any] = _convert(state_dict, ours_to_torch=False)
    return converted

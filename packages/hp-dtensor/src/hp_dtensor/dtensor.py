"""DTensor: a local tensor plus an ``hp_layout.Layout``, living above autograd.

A DTensor is a ``torch.Tensor`` wrapper subclass with the *global* shape. Every torch function
called on it goes through ``__torch_function__``: the op's sharding rule decides the input
layouts (inputs that differ are redistributed by a planned, differentiable redistribution),
the op runs on the plain local tensors -- so autograd and kernels only ever see plain
tensors -- and the results are wrapped with the layouts the rule gave. An op without a rule
is an error naming the op and the input layouts; nothing falls back to a gather.

Gradients: each rank's local tensor is an autograd variable of its own, and the local
gradient holds the global gradient in the dual layout (:func:`hp_dtensor.grad_layout`):
``.grad`` of a Replicate parameter is ``Partial(sum)`` until reduced.

:meth:`DTensor.full_tensor` follows ``torch.distributed.tensor``: its result is the same
tensor on every rank, so the gradient flowing back into it is taken as ``Replicate`` (one
loss, computed on every rank), not as one contribution per rank. :meth:`DTensor.to_local`
keeps the dual convention (a rank's use of its local tensor is its own contribution).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from hp_dtensor._comm import counted_by_comm_debug_mode
from hp_dtensor._routing import route
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.gradients import grad_layout
from hp_dtensor.redistribute import redistribute_local
from hp_dtensor.watchdog import watch
from hp_layout import (
    Layout,
    Mesh,
    Partial,
    Placement,
    RaggedShard,
    ReduceOp,
    Replicate,
    Shard,
    Topology,
)

__all__ = ["DTensor", "as_one_value", "distribute_tensor"]


class DTensor(torch.Tensor):
    """A tensor distributed over a :class:`DeviceMesh` as an ``hp_layout.Layout``.

    Build one with :func:`distribute_tensor` or :meth:`DTensor.from_local`.
    ``shape``/``size()``/``dtype``/``device`` have global semantics; :meth:`to_local` is the
    rank's shard.
    """

    _local: torch.Tensor
    _dist_layout: Layout
    _device_mesh: DeviceMesh

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, device_mesh: DeviceMesh) -> DTensor:
        if isinstance(local, DTensor):
            raise TypeError("a DTensor's local tensor must be a plain torch.Tensor")
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            layout.global_shape,
            dtype=local.dtype,
            device=local.device,
            requires_grad=local.requires_grad,
        )
        out._local = local
        out._dist_layout = layout
        out._device_mesh = device_mesh
        return out

    def __init__(self, local: torch.Tensor, layout: Layout, device_mesh: DeviceMesh) -> None:
        super().__init__()

    # Public API ------------------------------------------------------------------------------

    @property
    def dist_layout(self) -> Layout:
        """The layout: global shape, mesh and placements."""
        return self._dist_layout

    @property
    def device_mesh(self) -> DeviceMesh:
        """The device mesh the tensor lives on."""
        return self._device_mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh axis."""
        return self._dist_layout.placements

    def to_local(self) -> torch.Tensor:
        """This rank's shard (differentiable: its gradient flows back into the DTensor).

        The gradient of the local tensor is taken in the dual layout
        (:func:`hp_dtensor.grad_layout`): on a ``Replicate`` axis each rank's gradient is its
        own contribution (``Partial(sum)``), so a loss computed from a replicated local tensor
        on every rank counts once per rank. This differs from
        ``torch.distributed.tensor.DTensor.to_local()``, whose default takes that gradient as
        ``Replicate`` (counted once); it is kept because tensor-parallel boundaries and sharders
        rely on it. For torch's reading of a replicated value, use :meth:`full_tensor`.
        """
        return _unwrap(self)

    def redistribute(
        self,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        shard_order: Sequence[str] | None = None,
        topology: Topology | None = None,
    ) -> DTensor:
        """This tensor in another layout on the same mesh (planned; differentiable)."""
        if device_mesh is not None and device_mesh != self._device_mesh:
            raise ValueError(
                f"redistribute keeps the mesh ({self._device_mesh!r}); got {device_mesh!r}"
            )
        if placements is None:
            raise ValueError("redistribute needs placements")
        dst = self._dist_layout.with_placements(placements, shard_order)
        return _redistributed(self, dst, topology)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable, as in torch DTensor).

        The result is the same tensor on every rank, so by default (``grad_placements=None``)
        the gradient flowing back into it is taken as ``Replicate``: a loss computed from it on
        every rank is *one* loss, and the source receives that loss's gradient, as
        ``torch.distributed.tensor.DTensor.full_tensor()`` gives it -- a ``Shard`` source gets
        its chunk of it, a ``Replicate`` or ``Partial`` source the gradient itself (in the
        dual layout of :func:`hp_dtensor.grad_layout`: for a ``Replicate`` source, the
        ``Partial(sum)`` local gradients sum to it, held on coordinate 0 of each replicated
        axis; nothing is summed over the ranks).

        ``grad_placements`` (one per mesh axis, ``Replicate()`` or ``Partial("sum")``), as in
        torch, says how the gradient of the result is laid out instead: ``Partial("sum")`` on
        an axis takes each rank's gradient as its own contribution, summed over that axis.
        ``grad_placements=[Partial()] * mesh.ndim`` is the dual convention (each rank's loss
        is a separate term of a total loss; what ``redistribute`` to ``Replicate`` followed
        by :meth:`to_local` gives).
        """
        mesh = self._device_mesh
        replicated = self._dist_layout.with_placements([Replicate()] * mesh.ndim)
        given = _full_grad_layout(replicated, grad_placements)
        local = _redistributed(self, replicated, None)._local
        wanted = grad_layout(replicated)
        if given == wanted or not (torch.is_grad_enabled() and local.requires_grad):
            return local
        apply = cast(Callable[..., torch.Tensor], _GradientAs.apply)
        return apply(local, given, wanted, mesh)

    @classmethod
    def from_local(
        cls,
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh,
        placements: Sequence[Placement],
        *,
        shape: Sequence[int] | None = None,
        shard_order: Sequence[str] | None = None,
        run_check: bool = True,
    ) -> DTensor:
        """Wrap each rank's ``local_tensor`` as the shards of one DTensor.

        ``shape`` is the global shape; without it, the global extent of each sharded dim is
        the sum of the local extents along the axes sharding it (uneven shards work).
        ``local_tensor`` itself becomes the local tensor, so gradients of the result land in
        ``local_tensor.grad`` (in the dual layout, see :func:`hp_dtensor.grad_layout`).

        ``run_check`` (default True) makes sure the ranks of ``device_mesh`` describe one
        tensor, at the cost of one all-gather over the mesh of a fixed-size int64 row per rank
        (rank, ndim, dtype, ``requires_grad``, local shape, ``shape``): the same ndim, dtype and
        ``requires_grad`` everywhere, the same ``shape`` if given, the same extent on every
        dim that no mesh axis shards (so replicas agree on their shape), local extents that
        add up to one global extent on each sharded dim, and every rank's local shape the one
        the layout gives it. Every rank reads the same gathered rows, so when they disagree
        every rank raises the same ``ValueError``, naming the ranks and what differs, instead
        of building DTensors that later hang or abort a collective. The row is the same size
        whatever the ranks pass, so the gather itself always completes; it holds up to
        16 dims (a tensor with more is refused with ``run_check=True``: pass ``shape`` and
        ``run_check=False``). Only shapes and types are compared, never values: replicas
        holding different data are not detected.

        The check is a collective: every rank of the mesh must call ``from_local`` (SPMD code
        does). Code that wraps a tensor on some ranks only must pass ``run_check=False`` (and
        ``shape`` when a mesh axis shards), or the ranks that call wait for the others.

        ``run_check=False`` skips the check. With ``shape`` given it then issues no
        collective (use it where the layout holds by construction); without ``shape``, the
        global shape is still found as before, by one all-gather of a single extent per
        sharding axis (a fixed size, so it completes too), and only this rank's local shape is
        checked against it: ranks that disagree get DTensors that do not fit together.

        The gather runs over the group of all the mesh's ranks (created collectively on
        first use, like an axis group); a mesh bound to a torch mesh of several axes over
        part of the job has none, and there it is one all-gather per mesh axis.

        Unlike ``torch.distributed.tensor.DTensor.from_local``: torch's ``run_check``
        defaults to False; it compares dtype and ``requires_grad`` (and shape and stride when
        ``shape`` is not given, so uneven shards fail it) with an ``all_gather_object`` over
        the whole job and raises one message for any difference; and it also broadcasts the
        data of every ``Replicate`` axis from coordinate 0 into the local tensor. Ours moves no
        data: the local tensor is never overwritten.

        Raises:
            ValueError: (``run_check=True``) the ranks disagree, on every rank; this rank's
                local tensor does not fit the layout.
        """
        if any(isinstance(p, RaggedShard) for p in placements) and shape is None:
            raise ValueError(
                f"DTensor.from_local with placements {list(placements)} needs shape=: a "
                "RaggedShard local tensor is 1-d, so the global shape cannot be inferred from it"
            )
        if run_check:
            layout = _checked_layout(local_tensor, device_mesh, placements, shape, shard_order)
            return cls(local_tensor, layout, device_mesh)
        if shape is None:
            shape = _infer_global_shape(local_tensor, device_mesh, placements, shard_order)
        layout = Layout(shape, device_mesh.mesh, placements, shard_order)
        rank = device_mesh.get_rank()
        if tuple(local_tensor.shape) != layout.local_shape(rank):
            raise ValueError(
                f"rank {rank}: local tensor of shape {tuple(local_tensor.shape)} does not fit "
                f"{layout!r}, which gives it {layout.local_shape(rank)}"
            )
        return cls(local_tensor, layout, device_mesh)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"DTensor(local={self._local!r}, layout={self._dist_layout!r})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a DTensor is not picklable; send dtensor.to_local() or dtensor.full_tensor()"
        )

    # Dispatch --------------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise RuntimeError(
            f"{func} reached the dispatcher on a DTensor wrapper; every op must go through "
            "__torch_function__ (call it on DTensors or on their local tensors, not on "
            "storage-level APIs)"
        )

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return route(func, tuple(args), kwargs or {})


# Helpers ---------------------------------------------------------------------------------------


def _unwrap(x: DTensor) -> torch.Tensor:
    return x._local


def _full_grad_layout(replicated: Layout, grad_placements: Sequence[Placement] | None) -> Layout:
    """The layout the gradient of ``full_tensor()``'s result is taken in (checked)."""
    if grad_placements is None:
        return replicated
    placements = tuple(grad_placements)
    if len(placements) != len(replicated.placements):
        raise ValueError(
            f"full_tensor(grad_placements=...) needs one placement per mesh axis "
            f"({len(replicated.placements)}), got {list(placements)}"
        )
    for p in placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Partial) and p.op is ReduceOp.SUM)):
            raise ValueError(
                f"full_tensor(grad_placements=...) takes Replicate() or Partial('sum') per "
                f"mesh axis (the result is whole on every rank), got {p!r}"
            )
    return replicated.with_placements(placements)


class _GradientAs(torch.autograd.Function):
    """Identity forward; backward reads the incoming local gradient as laid out ``given`` and
    hands it on laid out ``wanted`` (the dual layout the redistribution's adjoint expects)."""

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, given: Layout, wanted: Layout, mesh: DeviceMesh
    ) -> torch.Tensor:
        ctx.given, ctx.wanted, ctx.mesh = given, wanted, mesh
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return redistribute_local(grad, ctx.given, ctx.wanted, ctx.mesh), None, None, None


def as_one_value(value: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """A plain tensor that is the same on every rank of ``mesh``, ready to be used as the
    local tensor of a ``Replicate`` DTensor (or as a scalar of a local call).

    Its uses produce local gradients in the dual layout (``Partial(sum)`` contributions);
    the value is one tensor, so its gradient must be their sum, whole on every rank
    (``torch.distributed.tensor``'s reading). When it takes part in autograd it passes
    through an identity whose backward all-reduces over every mesh axis; otherwise it is
    returned as it is.
    """
    if not (value.requires_grad and torch.is_grad_enabled()) or mesh.size() == 1:
        return value
    whole = Layout(tuple(value.shape), mesh.mesh, [Replicate()] * mesh.ndim)
    contributions = grad_layout(whole)
    apply = cast(Callable[..., torch.Tensor], _GradientAs.apply)
    return apply(value, contributions, whole, mesh)


def _redistributed(x: DTensor, dst: Layout, topology: Topology | None) -> DTensor:
    local = redistribute_local(x._local, x._dist_layout, dst, x._device_mesh, topology)
    return DTensor(local, dst, x._device_mesh)


# from_local's check ---------------------------------------------------------------------------

# The rows from_local gathers have a fixed length, which depends on nothing a rank could get
# wrong (not on its tensor's ndim), so the all-gather completes whatever the ranks pass.
_CHECK_MAX_NDIM = 16
_ROW_HEAD = 5  # rank, ndim, dtype code, requires_grad, len(shape) (-1: no shape given)
# Every dtype torch names, in an order all ranks of a job (one torch build) agree on.
_DTYPES: tuple[torch.dtype, ...] = tuple(
    sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
)
_DTYPE_CODES = {d: i for i, d in enumerate(_DTYPES)}


def _padded(extents: Sequence[int]) -> list[int]:
    head = [int(n) for n in extents[:_CHECK_MAX_NDIM]]
    return head + [-1] * (_CHECK_MAX_NDIM - len(head))


def _gather_rows(row: list[int], mesh: DeviceMesh) -> list[list[int]]:
    """Every mesh rank's ``row`` (the same length on every rank), in no particular order.

    One all-gather over the group of the mesh's ranks; a bound mesh without such a group
    (:meth:`DeviceMesh.get_mesh_group`) gathers along each axis in turn, each step carrying
    the rows of a sub-grid of the same size on every rank.
    """
    if mesh.size() == 1:
        return [row]
    try:
        groups = [mesh.get_mesh_group()]
    except NotImplementedError:
        groups = [mesh.get_group(axis) for axis in reversed(range(mesh.ndim))]
    block = torch.tensor([row], dtype=torch.int64, device=mesh.device)
    for group in groups:
        size = dist.get_world_size(group)
        if size == 1:
            continue
        if counted_by_comm_debug_mode():
            gathered = torch.ops._c10d_functional.all_gather_into_tensor(
                block, size, str(group.group_name)
            )
            block = torch.ops._c10d_functional.wait_tensor(gathered)
        else:
            out = block.new_empty((size * block.shape[0], block.shape[1]))
            with watch("from_local check", group):
                dist.all_gather_single(out, block, group=group)
            block = out
    rows: list[list[int]] = block.tolist()
    return rows


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 0-3, 6``."""
    ordered = sorted(ranks)
    runs: list[str] = []
    start = prev = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(runs)


def _who_has(values: dict[int, Any], show: Callable[[Any], str] = str) -> str:
    """``rank 0 has 8, ranks 1-3 have 6``: the ranks grouped by value, in rank order."""
    groups: dict[Any, list[int]] = {}
    for rank in sorted(values):
        groups.setdefault(values[rank], []).append(rank)
    parts = [
        f"{_ranks_text(ranks)} {'has' if len(ranks) == 1 else 'have'} {show(value)}"
        for value, ranks in groups.items()
    ]
    shown = 8
    more = f", and {len(parts) - shown} more values" if len(parts) > shown else ""
    return ", ".join(parts[:shown]) + more


def _refuse(message: str) -> ValueError:
    return ValueError(f"DTensor.from_local: {message}")


def _shard_dims(placements: Sequence[Placement], ndim: int) -> dict[int, list[int]]:
    """Tensor dim -> the mesh axes (indices) that shard it, for Shard placements in range
    (one out of range is left for ``Layout`` to refuse)."""
    dims: dict[int, list[int]] = {}
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) and -ndim <= p.dim < ndim:
            dims.setdefault(p.dim % ndim, []).append(axis)
    return dims


def _checked_layout(
    local: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int] | None,
    shard_order: Sequence[str] | None,
) -> Layout:
    """The layout of ``from_local(..., run_check=True)``, from one all-gather of every rank's
    metadata; every rank reaches the same verdict from the same rows."""
    given = None if shape is None else tuple(int(n) for n in shape)
    row = [
        device_mesh.get_rank(),
        local.dim(),
        _DTYPE_CODES[local.dtype],
        int(local.requires_grad),
        -1 if given is None else len(given),
        *_padded(local.shape),
        *_padded(given or ()),
    ]
    rows = {r[0]: r for r in _gather_rows(row, device_mesh)}
    _check_header(rows)
    ndim = local.dim()
    locals_ = {rank: tuple(r[_ROW_HEAD : _ROW_HEAD + ndim]) for rank, r in rows.items()}
    mesh = device_mesh.mesh
    # A RaggedShard local tensor is 1-d (the flattened block): its dims are not the global
    # ones, so only the comparison with the layout below applies.
    ragged = any(isinstance(p, RaggedShard) for p in placements)
    sharded = {} if ragged else _shard_dims(placements, ndim)
    for dim in range(0 if ragged else ndim):
        extents = {rank: s[dim] for rank, s in locals_.items()}
        if dim not in sharded and len(set(extents.values())) > 1:
            raise _refuse(
                f"the ranks disagree on dim {dim}, which no mesh axis shards: {_who_has(extents)}"
            )
    if given is None:
        inferred = list(locals_[device_mesh.get_rank()])
        for dim, axes in sharded.items():
            inferred[dim] = _agreed_total(dim, {r: s[dim] for r, s in locals_.items()}, mesh, axes)
        given = tuple(inferred)
    layout = Layout(given, mesh, placements, shard_order)
    wanted = _local_shapes(layout, locals_)
    misfits = {rank: s for rank, s in locals_.items() if s != wanted[rank]}
    if misfits:
        shown = sorted(misfits.items())[:8]
        text = ", ".join(
            f"rank {rank} has {s} where the layout gives it {wanted[rank]}" for rank, s in shown
        )
        more = f", and {len(misfits) - len(shown)} more ranks" if len(misfits) > len(shown) else ""
        raise _refuse(
            f"the local tensor of {_ranks_text(list(misfits))} does not fit {layout!r}: "
            f"{text}{more}"
        )
    return layout


def _local_shapes(layout: Layout, ranks: Iterable[int]) -> dict[int, tuple[int, ...]]:
    """``layout.local_shape(rank)`` for each of ``ranks``, computed once per distinct
    coordinate on the sharding axes (ranks that differ only along other axes hold the same
    shape), so the check stays cheap on large meshes."""
    mesh = layout.mesh
    axes = [mesh.axis_index(name) for name in layout.sharded_axes]
    by_coordinate: dict[tuple[int, ...], tuple[int, ...]] = {}
    out: dict[int, tuple[int, ...]] = {}
    for rank in ranks:
        coordinate = mesh.coordinate(rank)
        key = tuple(coordinate[a] for a in axes)
        found = by_coordinate.get(key)
        if found is None:
            found = by_coordinate[key] = layout.region_at(coordinate).shape
        out[rank] = found
    return out


def _check_header(rows: dict[int, list[int]]) -> None:
    """The ranks agree on ndim, dtype, ``requires_grad`` and ``shape=`` (else ValueError)."""
    start = _ROW_HEAD + _CHECK_MAX_NDIM
    headers = {(*r[1:_ROW_HEAD], *r[start:]) for r in rows.values()}
    if len(headers) == 1:
        ((ndim, _, _, given_ndim, *_),) = headers
        if max(ndim, given_ndim) <= _CHECK_MAX_NDIM:
            return  # the common case, found with one set of whole headers
    sizes = {rank: max(r[1], r[4]) for rank, r in rows.items()}
    too_many = {rank: n for rank, n in sizes.items() if n > _CHECK_MAX_NDIM}
    if too_many:
        raise _refuse(
            f"run_check compares up to {_CHECK_MAX_NDIM} dims, but {_who_has(too_many)} "
            "(local tensor or shape=); pass shape= and run_check=False for such a tensor"
        )
    ndims = {rank: r[1] for rank, r in rows.items()}
    if len(set(ndims.values())) > 1:
        raise _refuse(f"the ranks' local tensors differ in ndim: {_who_has(ndims)}")
    dtypes = {rank: _DTYPES[r[2]] for rank, r in rows.items()}
    if len(set(dtypes.values())) > 1:
        raise _refuse(f"the ranks' local tensors differ in dtype: {_who_has(dtypes, _dtype_name)}")
    grads = {rank: bool(r[3]) for rank, r in rows.items()}
    if len(set(grads.values())) > 1:
        raise _refuse(f"the ranks' local tensors differ in requires_grad: {_who_has(grads)}")
    shapes = {
        rank: None if r[4] < 0 else tuple(r[start : start + r[4]]) for rank, r in rows.items()
    }
    if len(set(shapes.values())) > 1:
        raise _refuse(f"the ranks pass different shape=: {_who_has(shapes)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _agreed_total(dim: int, extents: dict[int, int], mesh: Mesh, axes: Sequence[int]) -> int:
    """The global extent of ``dim``, sharded over mesh ``axes``: the sum of the local extents
    over each sub-grid those axes span, the same for every sub-grid (else ValueError)."""
    totals: dict[tuple[int, ...], list[int]] = {}
    for rank in sorted(extents):
        coordinate = mesh.coordinate(rank)
        totals.setdefault(tuple(c for a, c in enumerate(coordinate) if a not in axes), []).append(
            rank
        )
    sums = {tuple(ranks): sum(extents[r] for r in ranks) for ranks in totals.values()}
    if len(set(sums.values())) > 1:
        names = [mesh.axis_names[a] for a in axes]
        text = ", ".join(f"{_ranks_text(ranks)} give {total}" for ranks, total in sums.items())
        raise _refuse(
            f"the local extents of dim {dim}, sharded over {names}, add up to different global "
            f"extents: {text}"
        )
    return next(iter(sums.values()))


def _infer_global_shape(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shard_order: Sequence[str] | None,
) -> tuple[int, ...]:
    """The global shape ``from_local(..., run_check=False)`` infers from this rank's view: one
    all-gather of a single extent along each sharding axis (fixed size, so it completes
    whatever the ranks hold; ranks that disagree infer different shapes)."""
    from hp_dtensor import collectives

    shape = list(local.shape)
    order = list(shard_order) if shard_order is not None else list(mesh.mesh_dim_names)
    names = mesh.mesh_dim_names
    # Undo shards from the innermost out: gather the extents along each sharding axis.
    sharding = [n for n in reversed(order) if isinstance(placements[names.index(n)], Shard)]
    for name in sharding:
        placement = placements[names.index(name)]
        assert isinstance(placement, Shard)
        dim = placement.dim % max(1, len(shape))
        extents = collectives.all_gather(
            torch.tensor([shape[dim]], dtype=torch.int64, device=local.device), 0, mesh, name
        )
        shape[dim] = int(extents.sum())
    return tuple(shape)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    shard_order: Sequence[str] | None = None,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Distribute a whole tensor over ``device_mesh``: each rank keeps its shard.

    With ``src_data_rank`` (the default, 0), the tensor of that rank is broadcast first, so
    ranks may pass different data; with ``None`` every rank's ``tensor`` is taken as
    identical. The result requires grad if ``tensor`` does (it is a leaf of its own).
    """
    if isinstance(tensor, DTensor):
        raise TypeError("distribute_tensor takes a plain tensor; use DTensor.redistribute")
    mesh = device_mesh.mesh
    layout = Layout(tuple(tensor.shape), mesh, placements, shard_order)
    requires_grad = tensor.requires_grad
    with torch.no_grad():
        data = tensor.detach()
        if src_data_rank is not None:
            data = _broadcast_from(data, device_mesh, src_data_rank)
        replicated = Layout(tuple(tensor.shape), mesh, [Replicate()] * mesh.ndim)
        local = redistribute_local(data, replicated, layout, device_mesh).contiguous()
        if local.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            local = local.clone()
    local.requires_grad_(requires_grad)
    return DTensor(local, layout, device_mesh)


def _broadcast_from(data: torch.Tensor, mesh: DeviceMesh, src_rank: int) -> torch.Tensor:
    out = data.clone().contiguous()
    if src_rank not in mesh.mesh:
        raise ValueError(f"src_data_rank {src_rank} is not in {mesh!r}")
    if mesh.size() > 1:
        group = mesh.get_mesh_group()
        with watch("broadcast", group):
            dist.broadcast(out, src=src_rank, group=group)
    return out

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

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from hp_dtensor._routing import route
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.gradients import grad_layout
from hp_dtensor.redistribute import redistribute_local
from hp_layout import Layout, Partial, Placement, ReduceOp, Replicate, Shard, Topology

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
    ) -> DTensor:
        """Wrap each rank's ``local_tensor`` as the shards of one DTensor.

        ``shape`` is the global shape; without it, the global extent of each sharded dim is
        found with one small all-gather of the local extents (uneven shards work).
        ``local_tensor`` itself becomes the local tensor, so gradients of the result land in
        ``local_tensor.grad`` (in the dual layout, see :func:`hp_dtensor.grad_layout`).
        """
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


def _infer_global_shape(
    local: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shard_order: Sequence[str] | None,
) -> tuple[int, ...]:
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
    import torch.distributed as dist

    out = data.clone().contiguous()
    if src_rank not in mesh.mesh:
        raise ValueError(f"src_data_rank {src_rank} is not in {mesh!r}")
    if mesh.size() > 1:
        dist.broadcast(out, src=src_rank, group=mesh.get_mesh_group())
    return out

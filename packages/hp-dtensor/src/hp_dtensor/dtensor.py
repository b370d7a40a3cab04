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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.redistribute import redistribute_local
from hp_layout import Layout, Placement, Replicate, Shard, Topology

__all__ = ["DTensor", "distribute_tensor"]


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
        """This rank's shard (differentiable: its gradient flows back into the DTensor)."""
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

    def full_tensor(self) -> torch.Tensor:
        """The whole global tensor on every rank (differentiable)."""
        replicated = self._dist_layout.with_placements([Replicate()] * self._device_mesh.ndim)
        return _redistributed(self, replicated, None)._local

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
        kwargs = kwargs or {}
        special = _attributes.SPECIAL.get(func)
        if special is not None:
            return special(func, tuple(args), kwargs)
        return _dispatch.dispatch(func, tuple(args), kwargs)


# Helpers ---------------------------------------------------------------------------------------


def _unwrap(x: DTensor) -> torch.Tensor:
    return x._local


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


# The dispatch machinery needs the DTensor class; import it once the class exists.
from hp_dtensor import _attributes, _dispatch  # noqa: E402

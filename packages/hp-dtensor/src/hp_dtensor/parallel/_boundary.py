"""Layout conversions at module boundaries in production mode, planned once per shape.

A boundary turns this rank's plain local tensor from one placement on the parallel axis into
another. The first time a boundary sees a local shape, the global extent of a sharded dim is
learned (one tiny all-gather over the axis), the ``hp_layout`` plan is built, checked against
the local shape, and compiled into a :class:`Move`: its steps with every size, dim, slice and
reduction decided, so that a call only runs them (autograd functions with true adjoints) -- no
layout arithmetic, no group or rank look-ups beyond the axis group, no plan walking.
"""

from __future__ import annotations

from typing import Any

import torch

import hp_dtensor._comm as _comm
from hp_dtensor._moves import Move, compile_plan
from hp_dtensor.device_mesh import DeviceMesh
from hp_layout import Layout, Placement, RedistributePlan, Shard, plan_redistribute

__all__ = ["BoundaryConverter", "Move"]


class BoundaryConverter:
    """Converts plain local tensors between placements on a 1-d (parallel-axis) mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        if mesh.ndim != 1:
            raise ValueError(f"a boundary converter works on a 1-d mesh, got {mesh!r}")
        self.mesh = mesh
        self._plans: dict[Any, RedistributePlan | None] = {}
        self._layouts: dict[Any, Layout] = {}

    def global_shape(self, local: torch.Tensor, placement: Placement) -> tuple[int, ...]:
        """The global shape of ``local`` laid out as ``placement`` (collective if sharded)."""
        shape = list(local.shape)
        if isinstance(placement, Shard):
            dim = placement.dim % max(local.dim(), 1)
            group = _comm.AxisGroup.of(self.mesh, 0)
            extent = torch.tensor([shape[dim]], dtype=torch.int64, device=local.device)
            extents = _comm.all_gather_dim(extent, 0, [1] * group.size, group)
            shape[dim] = int(extents.sum())
        return tuple(shape)

    def layout(self, local: torch.Tensor, placement: Placement) -> Layout:
        """The layout of ``local`` laid out as ``placement``, learned once per local shape
        (the first time collectively, as :meth:`global_shape`)."""
        key = (placement, local.shape)
        found = self._layouts.get(key)
        if found is None:
            found = Layout(self.global_shape(local, placement), self.mesh.mesh, [placement])
            self._layouts[key] = found
        return found

    def plan(self, local: torch.Tensor, src: Placement, dst: Placement) -> RedistributePlan | None:
        """The cached plan for ``local`` from ``src`` to ``dst`` (None when nothing moves)."""
        key = (src, dst, tuple(local.shape))
        if key not in self._plans:
            shape = self.global_shape(local, src)
            source = Layout(shape, self.mesh.mesh, [src])
            target = Layout(shape, self.mesh.mesh, [dst])
            self._plans[key] = None if source == target else plan_redistribute(source, target)
        return self._plans[key]

    def move(
        self, local: torch.Tensor, src: Placement, dst: Placement, *, owned: bool = False
    ) -> Move | None:
        """The compiled conversion of tensors shaped like ``local`` from ``src`` to ``dst``
        (None when nothing moves); the caller keeps it for that shape.

        Raises:
            ValueError: ``local`` is not this rank's piece of the layout its ranks' extents
                give (they are not split as ``torch.chunk`` splits).
        """
        plan = self.plan(local, src, dst)
        if plan is None:
            return None
        rank = self.mesh.get_rank()
        expected = plan.src.local_shape(rank)
        if tuple(local.shape) != expected:
            raise ValueError(
                f"rank {rank} holds a local tensor of shape {tuple(local.shape)}, but "
                f"{plan.src!r} gives it {expected}"
            )
        return compile_plan(plan, self.mesh, owned=owned)

    def convert(self, local: torch.Tensor, src: Placement, dst: Placement) -> torch.Tensor:
        """``local`` under ``src`` turned into its shard under ``dst`` (differentiable)."""
        move = self.move(local, src, dst)
        return local if move is None else move(local)

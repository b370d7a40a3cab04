"""Layout conversions at module boundaries in production mode, planned once per shape.

A boundary turns this rank's plain local tensor from one placement on the parallel axis into
another. The global extent of a sharded dim is learned once per local shape (one tiny
all-gather over the axis), the ``hp_layout`` plan is built once and cached, and later calls
only run the plan's collectives (autograd functions with true adjoints).
"""

from __future__ import annotations

from typing import Any

import torch

from hp_dtensor import _comm
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.redistribute import execute_plan
from hp_layout import Layout, Placement, RedistributePlan, Shard, plan_redistribute

__all__ = ["BoundaryConverter"]


class BoundaryConverter:
    """Converts plain local tensors between placements on a 1-d (parallel-axis) mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        if mesh.ndim != 1:
            raise ValueError(f"a boundary converter works on a 1-d mesh, got {mesh!r}")
        self.mesh = mesh
        self._plans: dict[Any, RedistributePlan | None] = {}

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

    def plan(self, local: torch.Tensor, src: Placement, dst: Placement) -> RedistributePlan | None:
        """The cached plan for ``local`` from ``src`` to ``dst`` (None when nothing moves)."""
        key = (src, dst, tuple(local.shape))
        if key not in self._plans:
            shape = self.global_shape(local, src)
            source = Layout(shape, self.mesh.mesh, [src])
            target = Layout(shape, self.mesh.mesh, [dst])
            self._plans[key] = None if source == target else plan_redistribute(source, target)
        return self._plans[key]

    def convert(self, local: torch.Tensor, src: Placement, dst: Placement) -> torch.Tensor:
        """``local`` under ``src`` turned into its shard under ``dst`` (differentiable)."""
        plan = self.plan(local, src, dst)
        return local if plan is None else execute_plan(local, plan, self.mesh)

"""Which ranks shard and which replicate: the FSDP mesh, checked against a topology.

A torch ``DeviceMesh`` passed to ``fully_shard`` (or the one FSDP2 would build by default) is
used as it is: ``hp_dtensor.DeviceMesh.from_torch`` binds an hp-dtensor mesh to it, whose
process groups are the torch mesh's own and whose ``to_torch()`` is the torch mesh itself, the
``device_mesh`` of the per-parameter layout's DTensors (equal to the user's mesh, axis names
kept). No group is created for it, so a mesh over a subgroup (``DeviceMesh.from_group``) and
torch's threaded test process group, whose ranks are threads of one process, work as under
FSDP2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh
from hp_layout import Mesh, Tier, Topology

__all__ = ["FSDPMesh", "as_hp_mesh", "default_torch_mesh", "fsdp_axes", "resolve_mesh"]


@dataclass(frozen=True)
class FSDPMesh:
    """The data-parallel mesh of one fully_shard call.

    Attributes:
        mesh: 1-d (shard) or 2-d (replicate, shard).
        shard_axis: the axis parameters are sharded over (fast tier).
        replicate_axis: the axis shards are replicated over (HSDP, slow tier), or None.
        replicate_tier: the link tier the replicate axis's groups span (what its all-reduces
            cost, :mod:`hp_fsdp.replicate_buckets`): the topology's, or, without one, that of
            the job's hosts (``Topology.from_env``); None without a replicate axis.
    """

    mesh: DeviceMesh
    shard_axis: str
    replicate_axis: str | None
    replicate_tier: Tier | None = None

    @property
    def shard_size(self) -> int:
        """Ranks that share one copy of the parameters."""
        return self.mesh.size(self.shard_axis)

    @property
    def replicate_size(self) -> int:
        """Copies of the sharded parameters (1 without HSDP)."""
        return 1 if self.replicate_axis is None else self.mesh.size(self.replicate_axis)

    def torch_mesh(self) -> Any:
        """The torch ``DeviceMesh`` of this mesh (the user's own when one was passed)."""
        bound = self.mesh.torch_mesh
        if bound is not None:
            return bound
        # hp-dtensor builds the rank grid with the default device; under a
        # ``with torch.device("meta")`` block it would land on meta.
        with torch.device("cpu"):
            return self.mesh.to_torch()


def _is_torch_mesh(mesh: object) -> bool:
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    return isinstance(mesh, TorchDeviceMesh)


def as_hp_mesh(mesh: Any) -> DeviceMesh | None:
    """``mesh`` as this project's DeviceMesh: a torch ``DeviceMesh`` is bound as it is
    (``DeviceMesh.from_torch``); None stays None.

    Raises:
        TypeError: anything else.
        ValueError: a mesh of neither 1 nor 2 dimensions (torch FSDP2's exception).
        AssertionError: a 2-d torch mesh without dimension names (as torch FSDP2 asserts: the
            names say which dimension replicates and which shards).
    """
    if mesh is None or isinstance(mesh, DeviceMesh):
        return mesh
    if _is_torch_mesh(mesh):
        if mesh.ndim not in (1, 2):
            raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
        if mesh.ndim == 2 and mesh.mesh_dim_names is None:
            raise AssertionError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified: fully_shard "
                f"got {mesh} without names; name its dimensions (replicate, shard), e.g. "
                "init_device_mesh(device, shape, mesh_dim_names=('replicate', 'shard'))"
            )
        return DeviceMesh.from_torch(mesh)
    raise TypeError(
        f"fully_shard's mesh must be an hp_dtensor or torch DeviceMesh, got {type(mesh).__name__}"
    )


def default_torch_mesh(device_type: str) -> Any:
    """The mesh torch FSDP2 uses without one: all ranks of the default group, one unnamed
    dimension, made by torch's ``init_device_mesh`` (per call, as FSDP2 does)."""
    from torch.distributed.device_mesh import init_device_mesh

    with torch.device("cpu"):
        return init_device_mesh(device_type, (dist.get_world_size(),))


def fsdp_axes(grid: Mesh, shown: object = None) -> tuple[str, str | None]:
    """``(shard axis, replicate axis)`` of an FSDP mesh's rank grid: a 1-d mesh's axis shards
    (no replicate axis); a 2-d mesh is ``(replicate, shard)``.

    Raises:
        ValueError: a mesh of neither 1 nor 2 dimensions (``shown`` names it, default
            ``grid``).
    """
    if grid.ndim == 1:
        return grid.axis_names[0], None
    if grid.ndim == 2:
        replicate, shard = grid.axis_names
        return shard, replicate
    shown = grid if shown is None else shown
    raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {shown!r}")


def resolve_mesh(
    mesh: DeviceMesh | None, topology: Topology | None, device_type: str = "cpu"
) -> FSDPMesh:
    """The FSDP mesh from the arguments of fully_shard.

    Without a mesh: all ranks, one shard axis (torch FSDP2's default mesh, unnamed: its hp
    axis is ``dim0``); with a topology, ``(replicate, shard)`` where the shard axis spans the
    fastest tier's blocks. With both, the shard axis must not be on a slower tier than the
    replicate axis.
    """
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError("fully_shard needs torch.distributed initialized (or a mesh)")
        world = dist.get_world_size()
        if topology is None:
            default = DeviceMesh.from_torch(default_torch_mesh(device_type))
            return FSDPMesh(default, default.mesh_dim_names[0], None)
        if topology.world_size != world:
            raise ValueError(
                f"topology {topology.name!r} spans {topology.world_size} ranks, the job has {world}"
            )
        fast = topology.tiers[0].size
        if fast >= world:
            return FSDPMesh(DeviceMesh(device_type, Mesh((world,), ("shard",))), "shard", None)
        grid = Mesh((world // fast, fast), ("replicate", "shard"))
        tier = topology.axis_tier(grid, "replicate")
        return FSDPMesh(DeviceMesh(device_type, grid), "shard", "replicate", tier)
    shard_axis, replicate_axis = fsdp_axes(mesh.mesh, mesh)
    if replicate_axis is None:
        return FSDPMesh(mesh, shard_axis, None)
    links = topology if topology is not None else _job_topology(mesh.mesh)
    shard_tier = links.axis_tier(mesh.mesh, shard_axis)
    replicate_tier = links.axis_tier(mesh.mesh, replicate_axis)
    if topology is not None and topology.tier_level(shard_tier) > topology.tier_level(
        replicate_tier
    ):
        raise ValueError(
            f"{mesh!r} does not match topology {topology.name!r}: the shard axis "
            f"{shard_axis!r} spans tier {shard_tier.name!r} but the replicate axis "
            f"{replicate_axis!r} only {replicate_tier.name!r}; shard inside the "
            "fast tier and replicate across the slow one (swap the axes)"
        )
    return FSDPMesh(mesh, shard_axis, replicate_axis, replicate_tier)


def _job_topology(mesh: Mesh) -> Topology:
    """The links of a job given no topology: hosts of ``LOCAL_WORLD_SIZE`` ranks (torchrun's),
    the process group's world (or, without one, the mesh's ranks) in all."""
    world = dist.get_world_size() if dist.is_initialized() else max(mesh.ranks) + 1
    local = os.environ.get("LOCAL_WORLD_SIZE", str(world))
    return Topology.from_env({"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": local})

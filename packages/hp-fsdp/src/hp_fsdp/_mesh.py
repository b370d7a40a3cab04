"""Which ranks shard and which replicate: the FSDP mesh, checked against a topology."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hp_dtensor import DeviceMesh
from hp_layout import Mesh, Topology

__all__ = ["FSDPMesh", "as_hp_mesh", "resolve_mesh"]


@dataclass(frozen=True)
class FSDPMesh:
    """The data-parallel mesh of one fully_shard call.

    Attributes:
        mesh: 1-d (shard) or 2-d (replicate, shard).
        shard_axis: the axis parameters are sharded over (fast tier).
        replicate_axis: the axis shards are replicated over (HSDP, slow tier), or None.
    """

    mesh: DeviceMesh
    shard_axis: str
    replicate_axis: str | None

    @property
    def shard_size(self) -> int:
        """Ranks that share one copy of the parameters."""
        return self.mesh.size(self.shard_axis)

    @property
    def replicate_size(self) -> int:
        """Copies of the sharded parameters (1 without HSDP)."""
        return 1 if self.replicate_axis is None else self.mesh.size(self.replicate_axis)


def as_hp_mesh(mesh: Any) -> DeviceMesh | None:
    """``mesh`` as this project's DeviceMesh (a torch ``DeviceMesh`` is converted; None stays).

    Raises:
        TypeError: anything else.
    """
    if mesh is None or isinstance(mesh, DeviceMesh):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    if isinstance(mesh, TorchDeviceMesh):
        return DeviceMesh.from_torch(mesh)
    raise TypeError(
        f"fully_shard's mesh must be an hp_dtensor or torch DeviceMesh, got {type(mesh).__name__}"
    )


def resolve_mesh(
    mesh: DeviceMesh | None, topology: Topology | None, device_type: str = "cpu"
) -> FSDPMesh:
    """The FSDP mesh from the arguments of fully_shard.

    Without a mesh: all ranks, one shard axis; with a topology, ``(replicate, shard)`` where
    the shard axis spans the fastest tier's blocks. With both, the shard axis must not be on a
    slower tier than the replicate axis.
    """
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError("fully_shard needs torch.distributed initialized (or a mesh)")
        world = dist.get_world_size()
        if topology is None:
            return FSDPMesh(DeviceMesh(device_type, Mesh((world,), ("shard",))), "shard", None)
        if topology.world_size != world:
            raise ValueError(
                f"topology {topology.name!r} spans {topology.world_size} ranks, the job has {world}"
            )
        fast = topology.tiers[0].size
        if fast >= world:
            return FSDPMesh(DeviceMesh(device_type, Mesh((world,), ("shard",))), "shard", None)
        grid = Mesh((world // fast, fast), ("replicate", "shard"))
        return FSDPMesh(DeviceMesh(device_type, grid), "shard", "replicate")
    if mesh.ndim == 1:
        resolved = FSDPMesh(mesh, mesh.mesh_dim_names[0], None)
    elif mesh.ndim == 2:
        replicate, shard = mesh.mesh_dim_names
        resolved = FSDPMesh(mesh, shard, replicate)
    else:
        raise ValueError(
            f"fully_shard takes a 1-d mesh (shard) or a 2-d mesh (replicate, shard), got {mesh!r}"
        )
    if topology is not None and resolved.replicate_axis is not None:
        shard_tier = topology.axis_tier(mesh.mesh, resolved.shard_axis)
        replicate_tier = topology.axis_tier(mesh.mesh, resolved.replicate_axis)
        if topology.tier_level(shard_tier) > topology.tier_level(replicate_tier):
            raise ValueError(
                f"{mesh!r} does not match topology {topology.name!r}: the shard axis "
                f"{resolved.shard_axis!r} spans tier {shard_tier.name!r} but the replicate axis "
                f"{resolved.replicate_axis!r} only {replicate_tier.name!r}; shard inside the "
                "fast tier and replicate across the slow one (swap the axes)"
            )
    return resolved

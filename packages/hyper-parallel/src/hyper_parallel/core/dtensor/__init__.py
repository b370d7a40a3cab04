"""``hyper_parallel.core.dtensor``: hp-dtensor's mesh and DTensor, and deferred initialization."""

from hp_dtensor import DeviceMesh, distribute_tensor, init_device_mesh
from hyper_parallel.core.dtensor.parameter_init import init_parameters, no_init_parameters
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.core.dtensor.upstream_dtensor import DTensor

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_tensor",
    "init_device_mesh",
    "init_parameters",
    "no_init_parameters",
]

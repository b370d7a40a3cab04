"""hp_layout: the layout algebra of hyper-parallel, in pure Python.

Meshes of ranks, topologies of link tiers, placements, layouts and redistribution plans. No
torch and no numpy at import time; :mod:`hp_layout.reference` (numpy) runs plans on virtual
ranks for testing.
"""

from hp_layout.chunking import chunk_bounds, chunk_length, chunk_sizes
from hp_layout.errors import (
    LayoutError,
    MeshError,
    PlacementError,
    RedistributionError,
    TopologyError,
)
from hp_layout.flat_buffer import FlatBufferLayout, FlatSlot, FlatSpan, plan_flat_buffer
from hp_layout.layout import Layout
from hp_layout.mesh import Mesh
from hp_layout.placement import (
    Partial,
    Placement,
    RaggedShard,
    ReduceOp,
    Replicate,
    Shard,
    is_sharding,
)
from hp_layout.redistribute import (
    RedistributePlan,
    Step,
    StepKind,
    plan_gather_then_slice,
    plan_redistribute,
)
from hp_layout.region import Box, Region
from hp_layout.topology import Collective, Tier, Topology
from hp_layout.transfer import (
    Piece,
    TransferPlan,
    local_index_runs,
    plan_full_gather_transfer,
    plan_transfer,
)

__version__ = "0.1.0"

__all__ = [
    "Box",
    "Collective",
    "FlatBufferLayout",
    "FlatSlot",
    "FlatSpan",
    "Layout",
    "LayoutError",
    "Mesh",
    "MeshError",
    "Partial",
    "Piece",
    "Placement",
    "PlacementError",
    "RaggedShard",
    "RedistributePlan",
    "RedistributionError",
    "ReduceOp",
    "Region",
    "Replicate",
    "Shard",
    "Step",
    "StepKind",
    "Tier",
    "Topology",
    "TopologyError",
    "TransferPlan",
    "__version__",
    "chunk_bounds",
    "chunk_length",
    "chunk_sizes",
    "is_sharding",
    "local_index_runs",
    "plan_flat_buffer",
    "plan_full_gather_transfer",
    "plan_gather_then_slice",
    "plan_redistribute",
    "plan_transfer",
]

"""hp_dtensor: runtime device mesh, autograd-aware collectives and a layout-driven DTensor."""

# Importing _attributes (and through it _dispatch) installs DTensor's attribute handlers and
# its op dispatch (see hp_dtensor._routing): every DTensor call goes through them.
from hp_dtensor import _attributes as _attributes
from hp_dtensor import rules
from hp_dtensor._dispatch import implicit_replication
from hp_dtensor.device_mesh import DeviceMesh, init_device_mesh
from hp_dtensor.dtensor import DTensor, distribute_tensor
from hp_dtensor.gradients import grad_layout
from hp_dtensor.interop import (
    InteropError,
    annotate_layout,
    from_torch_dtensor,
    from_torch_state_dict,
    layout_of,
    to_torch_dtensor,
    to_torch_state_dict,
)
from hp_dtensor.redistribute import execute_plan, redistribute_local
from hp_dtensor.rules.registry import (
    OpCall,
    ShardingDecision,
    ShardingRuleError,
    register_sharding_rule,
)
from hp_layout import Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard

__version__ = "0.1.0"

__all__ = [
    "DTensor",
    "DeviceMesh",
    "InteropError",
    "OpCall",
    "Partial",
    "Placement",
    "RaggedShard",
    "ReduceOp",
    "Replicate",
    "Shard",
    "ShardingDecision",
    "ShardingRuleError",
    "__version__",
    "annotate_layout",
    "distribute_tensor",
    "execute_plan",
    "from_torch_dtensor",
    "from_torch_state_dict",
    "grad_layout",
    "implicit_replication",
    "init_device_mesh",
    "layout_of",
    "redistribute_local",
    "register_sharding_rule",
    "rules",
    "to_torch_dtensor",
    "to_torch_state_dict",
]

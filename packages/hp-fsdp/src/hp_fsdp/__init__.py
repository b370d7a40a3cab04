"""hp_fsdp: topology-aware fully sharded data parallel with zero-copy flat buffers."""

from hp_fsdp.api import FSDPModule, fully_shard
from hp_fsdp.call_plan import plan_fully_shard
from hp_fsdp.clip import clip_grad_norm_, total_grad_norm
from hp_fsdp.compat import UnshardHandle, register_fsdp_forward_method
from hp_fsdp.group_plan import GroupPlan, ParamSpec, plan_group, spec_from_plan
from hp_fsdp.policy import (
    CPUOffloadPolicy,
    LowPrecisionCommPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    PrefetchPolicy,
)
from hp_fsdp.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    init_optimizer_state,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__version__ = "0.1.0"

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "GroupPlan",
    "LowPrecisionCommPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamSpec",
    "PrefetchPolicy",
    "UnshardHandle",
    "__version__",
    "clip_grad_norm_",
    "fully_shard",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "init_optimizer_state",
    "plan_fully_shard",
    "plan_group",
    "register_fsdp_forward_method",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "spec_from_plan",
    "total_grad_norm",
]

"""hp_offload: activation checkpointing and swapping, optimizer-state and parameter offload,
and tensors held in memory pools. Depends on torch alone (no hp-* package), so it composes
with hp-fsdp, hp-dtensor or plain torch modules through public module hooks."""

from hp_offload.checkpoint import checkpoint_wrapper
from hp_offload.memory import ActivationMeter
from hp_offload.optimizer import JOINT_STEP_ATTRIBUTE, OffloadedOptimizer, OffloadStepStats
from hp_offload.params import ParameterOffload, offload_parameters
from hp_offload.policy import FULL_RECOMPUTE, ActivationPolicy, BudgetPolicy
from hp_offload.pool import PoolBrokenError, TensorPool
from hp_offload.remote import Host, Peer, Placement, PoolEvent, PoolUsage, RemoteTensor
from hp_offload.swap import HostBufferPool, Swapper, swap_wrapper, unwrap

__version__ = "0.1.0"

__all__ = [
    "FULL_RECOMPUTE",
    "JOINT_STEP_ATTRIBUTE",
    "ActivationMeter",
    "ActivationPolicy",
    "BudgetPolicy",
    "Host",
    "HostBufferPool",
    "OffloadStepStats",
    "OffloadedOptimizer",
    "ParameterOffload",
    "Peer",
    "Placement",
    "PoolBrokenError",
    "PoolEvent",
    "PoolUsage",
    "RemoteTensor",
    "Swapper",
    "TensorPool",
    "__version__",
    "checkpoint_wrapper",
    "offload_parameters",
    "swap_wrapper",
    "unwrap",
]

"""hyper_parallel: HyperParallel's public names over the hyper-parallel libraries.

``from hyper_parallel import fully_shard, shard_module, Schedule1F1B, get_hyper_optimizer, ...``
(and upstream's ``hyper_parallel.core.*`` paths) give the hp-* libraries' implementations:
the same object where upstream's signature is already the library's, a thin adapter where the
arguments differ (:mod:`hyper_parallel.migration` records which, and
:func:`migration_table` prints it). Upstream arguments with no meaning here (MindSpore or
Ascend specifics) raise :class:`NotOfferedError` naming what to use instead. Nothing else
lives here: every computation is an hp-* library's.
"""

from hp_dtensor import (
    DeviceMesh,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from hp_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hp_mpmd import TiedParameter
from hp_muon import ChainedOptimizer, Muon
from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper, swap_wrapper
from hyper_parallel.core.dtensor import DTensor, init_parameters, no_init_parameters
from hyper_parallel.core.fully_shard import fully_shard
from hyper_parallel.core.multicore import MegaMoeExperts
from hyper_parallel.core.optimizer import get_hyper_optimizer
from hyper_parallel.core.pipeline_parallel import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from hyper_parallel.core.shard import ShardingPlan, shard_module
from hyper_parallel.core.tensor_parallel import (
    ColwiseParallel,
    ContextParallel,
    ExpertParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from hyper_parallel.errors import NotOfferedError
from hyper_parallel.migration import migration_table

__version__ = "0.1.0"

#: Upstream's public names served here, in the migration table's order.
UPSTREAM_NAMES: tuple[str, ...] = (
    "init_device_mesh",
    "DeviceMesh",
    "DTensor",
    "distribute_tensor",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "fully_shard",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "ShardingPlan",
    "shard_module",
    "no_init_parameters",
    "init_parameters",
    "parallelize_module",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "ExpertParallel",
    "ContextParallel",
    "PipelineStage",
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "TiedParameter",
    "get_hyper_optimizer",
    "Muon",
    "ChainedOptimizer",
    "checkpoint_wrapper",
    "swap_wrapper",
    "MegaMoeExperts",
)

__all__ = [
    "UPSTREAM_NAMES",
    "CPUOffloadPolicy",
    "ChainedOptimizer",
    "ColwiseParallel",
    "ContextParallel",
    "DTensor",
    "DeviceMesh",
    "ExpertParallel",
    "MegaMoeExperts",
    "MixedPrecisionPolicy",
    "Muon",
    "NotOfferedError",
    "OffloadPolicy",
    "ParallelStyle",
    "Partial",
    "PipelineStage",
    "Placement",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "Replicate",
    "RowwiseParallel",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "SequenceParallel",
    "Shard",
    "ShardingPlan",
    "TiedParameter",
    "__version__",
    "checkpoint_wrapper",
    "distribute_tensor",
    "fully_shard",
    "get_hyper_optimizer",
    "init_device_mesh",
    "init_parameters",
    "migration_table",
    "no_init_parameters",
    "parallelize_module",
    "shard_module",
    "swap_wrapper",
]

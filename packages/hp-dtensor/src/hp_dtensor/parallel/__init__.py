"""Sharding plans, tensor-parallel styles and the two execution modes.

``parallelize_module(model, mesh, plan, mode=...)`` shards a model by a plan of styles
(:class:`ColwiseParallel`, :class:`RowwiseParallel`, :class:`SequenceParallel`,
:class:`PrepareModuleInput`, :class:`PrepareModuleOutput`, or the general
:class:`ShardingPlan`). Production mode runs plain tensors with collectives planned once;
validation mode runs DTensors and checks every op against the plan. Both execute the same
:class:`ParallelPlan`, which :func:`resolve` computes without processes (``print(plan.table())``
shows what will run).
"""

from hp_dtensor.parallel.api import Mode, parallelize_module
from hp_dtensor.parallel.context import (
    CausalAttention,
    context_parallel_cross_entropy,
    gather_sequence,
    global_token_mean,
    local_positions,
    sequence_sharding,
    shard_sequence,
)
from hp_dtensor.parallel.context_plan import (
    ContextParallelError,
    ContextParallelPlan,
    SequenceSharding,
)
from hp_dtensor.parallel.exact_region import (
    exact_gradients_of,
    partial_gradients_of,
    run_in_exact_region,
)
from hp_dtensor.parallel.expert_module import ExpertModule
from hp_dtensor.parallel.init import MaterializeError, materialize
from hp_dtensor.parallel.loss import GradConvention, loss_parallel, vocab_parallel_cross_entropy
from hp_dtensor.parallel.plan import (
    Boundary,
    ExpertParallelPlan,
    PlanError,
    PlanLayoutLengthError,
    ShardingPlan,
    lower_plan,
)
from hp_dtensor.parallel.plans import TransformerNames, transformer_tp_plan
from hp_dtensor.parallel.random import (
    DropoutVariant,
    distributed_dropout,
    parallel_dropout_forward,
    random_region,
    take_region,
)
from hp_dtensor.parallel.resolved import (
    BoundaryPlan,
    GradReductionPlan,
    ModulePlan,
    ParallelPlan,
    ParamFlatSlot,
    ParamPlan,
    ReductionTime,
    resolve,
)
from hp_dtensor.parallel.styles import (
    ColwiseParallel,
    ContextParallel,
    ExpertParallel,
    ExpertTensorParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from hp_dtensor.parallel.validation import PlanMismatchError, check_gradients

__all__ = [
    "Boundary",
    "BoundaryPlan",
    "CausalAttention",
    "ColwiseParallel",
    "ContextParallel",
    "ContextParallelError",
    "ContextParallelPlan",
    "DropoutVariant",
    "ExpertModule",
    "ExpertParallel",
    "ExpertParallelPlan",
    "ExpertTensorParallel",
    "GradConvention",
    "GradReductionPlan",
    "MaterializeError",
    "Mode",
    "ModulePlan",
    "ParallelPlan",
    "ParallelStyle",
    "ParamFlatSlot",
    "ParamPlan",
    "PlanError",
    "PlanLayoutLengthError",
    "PlanMismatchError",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "ReductionTime",
    "RowwiseParallel",
    "SequenceParallel",
    "SequenceSharding",
    "ShardingPlan",
    "TransformerNames",
    "check_gradients",
    "context_parallel_cross_entropy",
    "distributed_dropout",
    "exact_gradients_of",
    "gather_sequence",
    "global_token_mean",
    "local_positions",
    "loss_parallel",
    "lower_plan",
    "materialize",
    "parallel_dropout_forward",
    "parallelize_module",
    "partial_gradients_of",
    "random_region",
    "resolve",
    "run_in_exact_region",
    "sequence_sharding",
    "shard_sequence",
    "take_region",
    "transformer_tp_plan",
    "vocab_parallel_cross_entropy",
]

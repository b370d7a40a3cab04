"""``hyper_parallel.core.tensor_parallel``: :func:`parallelize_module` and the tensor-parallel
styles (hp-dtensor's)."""

from hp_dtensor.parallel import (
    ColwiseParallel,
    ContextParallel,
    ExpertParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
)
from hyper_parallel.core.tensor_parallel.api import parallelize_module

__all__ = [
    "ColwiseParallel",
    "ContextParallel",
    "ExpertParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "loss_parallel",
    "parallelize_module",
]

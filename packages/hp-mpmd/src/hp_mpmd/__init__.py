"""hp_mpmd: pipeline parallelism and heterogeneous MPMD stages.

Schedules are pure plans (:mod:`hp_mpmd.actions`, :mod:`hp_mpmd.schedules`), checked and
simulated without processes (:mod:`hp_mpmd.check`, :mod:`hp_mpmd.simulate`) and executed by a
runtime (:mod:`hp_mpmd.runtime`). :mod:`hp_mpmd.torch_compat` offers
``torch.distributed.pipelining``'s stage and schedule classes over them.
"""

from hp_mpmd.actions import Action, ActionKind, SchedulePlan
from hp_mpmd.runtime import (
    PipelineError,
    PipelineSchedule,
    ShapeMismatchError,
    StepResult,
    all_reduce_gradients,
    run_plan,
)
from hp_mpmd.split import (
    SplitError,
    balanced_boundaries,
    boundaries_by_names,
    build_stages,
    layers_of,
    measured_costs,
    parameter_costs,
)
from hp_mpmd.stage import PipelineStage, StageError, StagePlacement
from hp_mpmd.tied import TiedParameter

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionKind",
    "PipelineError",
    "PipelineSchedule",
    "PipelineStage",
    "SchedulePlan",
    "ShapeMismatchError",
    "SplitError",
    "StageError",
    "StagePlacement",
    "StepResult",
    "TiedParameter",
    "__version__",
    "all_reduce_gradients",
    "balanced_boundaries",
    "boundaries_by_names",
    "build_stages",
    "layers_of",
    "measured_costs",
    "parameter_costs",
    "run_plan",
]

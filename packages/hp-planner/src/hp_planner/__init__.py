"""hp-planner: the whole job's plan as frozen data.

``plan_job(stages, dims, parallelism, training, topology)`` returns a :class:`JobPlan` from
meta-device models and configs, without any process group: per pipeline stage the meshes,
the tensor-parallel plan (with FSDP slots and optimizer groups), the expert- and
context-parallel modules, hp-fsdp's plan of every ``fully_shard`` call and the activation
and offload policy; and the pipeline schedule. Executors take their parts of it and check
they would have planned the same.
"""

from hp_planner.inputs import (
    CP_VARIANTS,
    JobDims,
    ModelParallelism,
    PlanInputError,
    TrainingPolicy,
)
from hp_planner.job import (
    ContextPlan,
    ExpertPlan,
    FsdpGroup,
    JobPlan,
    MuonView,
    StagePlan,
    to_jsonable,
)
from hp_planner.meshes import StageMeshes, job_grid, stage_meshes, stage_of
from hp_planner.plan_job import plan_job, plan_schedule

__all__ = [
    "CP_VARIANTS",
    "ContextPlan",
    "ExpertPlan",
    "FsdpGroup",
    "JobDims",
    "JobPlan",
    "ModelParallelism",
    "MuonView",
    "PlanInputError",
    "StageMeshes",
    "StagePlan",
    "TrainingPolicy",
    "job_grid",
    "plan_job",
    "plan_schedule",
    "stage_meshes",
    "stage_of",
    "to_jsonable",
]

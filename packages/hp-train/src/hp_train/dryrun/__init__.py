"""The dry-run planner: predict a run's memory, communication and step time without processes.

The dry run reads the trainer's :class:`hp_planner.JobPlan` (:func:`job_plan`, cached per
configuration; :mod:`~hp_train.dryrun.shapes`) and plans nothing itself: shapes, tensor
parallelism, optimizer groups, the FSDP groups (hp-fsdp's plan of every ``fully_shard`` call),
every parameter's layout (:func:`predicted_layouts`, what ``layout_of`` reports in the real
run), Muon's exchange (the JobPlan's Muon step, or analytically at scale) and the pipeline's
schedule; the fits check and the model presets are the trainer's, costs
``hp_layout.Topology``'s alpha-beta model, compute from a FLOPs model; expert and context
parallelism's collectives from the runtime's exchanges (:mod:`~hp_train.dryrun.expert_comm`,
:mod:`~hp_train.dryrun.context_comm`), checkpointing policies' activations
(:mod:`~hp_train.dryrun.activation`), the pipeline's bubble from hp-mpmd's plan and simulator
(:mod:`~hp_train.dryrun.schedule`), the trainer's refused pairs from
:mod:`hp_train.config.combinations` (:mod:`~hp_train.dryrun.refusals`), the paper reproduction in
:mod:`~hp_train.dryrun.reproduce`. Every planning function is pure and returns frozen
dataclasses; :mod:`~hp_train.dryrun.report`
formats them and :mod:`~hp_train.dryrun.cli` is ``hp-dryrun`` / ``python -m hp_train.dryrun``.
"""

from hp_train.dryrun.activation import (
    BlockActivations,
    KeptActivations,
    block_activations,
    kept_activations,
)
from hp_train.dryrun.comm import KINDS, CollectiveRecord, RankGrid
from hp_train.dryrun.memory import MemoryBreakdown, memory_breakdown
from hp_train.dryrun.muon_traffic import MuonTraffic, muon_traffic
from hp_train.dryrun.planner import DryRun, KindSummary, StageResult, StepTime, dry_run
from hp_train.dryrun.predict import PREDICTED_KINDS, Prediction, predict_for_run
from hp_train.dryrun.presets import (
    DEVICE_PRESETS,
    MODEL_PRESETS,
    MOE_505B_PARAMS,
    Device,
    DryRunError,
    ModelPreset,
    model_preset,
    topology_preset,
)
from hp_train.dryrun.refusals import check_runtime_accepts
from hp_train.dryrun.reproduce import PAPER, Reproduction, format_reproduction, reproduce_paper
from hp_train.dryrun.schedule import PipelineTiming, pipeline_timing
from hp_train.dryrun.search import SearchResult, SearchSpace, search
from hp_train.dryrun.shapes import (
    GroupSpec,
    ParamSpec,
    fsdp_groups,
    job_plan,
    model_parameters,
    parameter_count,
    planned_model,
    predicted_layouts,
    resolved_plan,
)
from hp_train.dryrun.workload import BF16_MIXED, FP32, RUNTIMES, Precision, StepShape

__all__ = [
    "BF16_MIXED",
    "DEVICE_PRESETS",
    "FP32",
    "KINDS",
    "MODEL_PRESETS",
    "MOE_505B_PARAMS",
    "PAPER",
    "PREDICTED_KINDS",
    "RUNTIMES",
    "BlockActivations",
    "CollectiveRecord",
    "Device",
    "DryRun",
    "DryRunError",
    "GroupSpec",
    "KeptActivations",
    "KindSummary",
    "MemoryBreakdown",
    "ModelPreset",
    "MuonTraffic",
    "ParamSpec",
    "PipelineTiming",
    "Precision",
    "Prediction",
    "RankGrid",
    "Reproduction",
    "SearchResult",
    "SearchSpace",
    "StageResult",
    "StepShape",
    "StepTime",
    "block_activations",
    "check_runtime_accepts",
    "dry_run",
    "format_reproduction",
    "fsdp_groups",
    "job_plan",
    "kept_activations",
    "memory_breakdown",
    "model_parameters",
    "model_preset",
    "muon_traffic",
    "parameter_count",
    "pipeline_timing",
    "planned_model",
    "predict_for_run",
    "predicted_layouts",
    "reproduce_paper",
    "resolved_plan",
    "search",
    "topology_preset",
]

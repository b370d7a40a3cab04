"""Pricing a JobPlan: a step's memory, communication and time, and the layout search, without
processes.

The pricing reads the :class:`hp_planner.JobPlan` of a :class:`PricedModel` (:func:`job_plan`,
cached per model and degrees; :mod:`~hp_planner.price.structure`) and plans nothing itself:
shapes, tensor parallelism, optimizer groups, the FSDP groups (hp-fsdp's plan of every
``fully_shard`` call), every parameter's layout (:func:`predicted_layouts`, what ``layout_of``
reports in the real run), Muon's exchange (the JobPlan's Muon step, or analytically at scale)
and the pipeline's schedule. Costs are ``hp_layout.Topology``'s alpha-beta model, compute a
FLOPs model of the model's :class:`TransformerShape` (:mod:`~hp_planner.price.workload`);
expert and context parallelism's collectives follow the runtime's exchanges
(:mod:`~hp_planner.price.expert_comm`, :mod:`~hp_planner.price.context_comm`), checkpointing
policies' activations :mod:`~hp_planner.price.activation`, the pipeline's bubble hp-mpmd's plan
and simulator (:mod:`~hp_planner.price.schedule`); the paper reproduction is
:mod:`~hp_planner.price.reproduce`. Every function is pure and returns frozen dataclasses;
:mod:`~hp_planner.price.report` formats them.

A model is priced through a :class:`PricedModel`: a trainer's (hp-train's ``TrainerModel``,
with its stage cuts, its fits check and its refused pairs) or :class:`MetaModel` for any
``nn.Module`` built on ``meta`` (a Hugging Face or torchtitan model, not pipelined).
"""

from hp_planner.price.activation import (
    BlockActivations,
    KeptActivations,
    block_activations,
    kept_activations,
)
from hp_planner.price.comm import KINDS, CollectiveRecord, RankGrid
from hp_planner.price.devices import DEVICE_PRESETS, Device, device_for, topology_preset
from hp_planner.price.memory import GIB, MemoryBreakdown, memory_breakdown
from hp_planner.price.model import (
    MetaModel,
    MoEDims,
    MoEShape,
    PricedModel,
    PricingError,
    TransformerDims,
    TransformerShape,
)
from hp_planner.price.muon_traffic import MuonTraffic, muon_traffic
from hp_planner.price.report import format_dry_run, format_search
from hp_planner.price.reproduce import PAPER, Reproduction, format_reproduction, reproduce_paper
from hp_planner.price.run import DryRun, KindSummary, StageResult, StepTime, dry_run
from hp_planner.price.schedule import PipelineTiming, pipeline_timing
from hp_planner.price.search import SearchResult, SearchSpace, search
from hp_planner.price.structure import (
    GroupSpec,
    ParamSpec,
    fsdp_groups,
    job_plan,
    model_parameters,
    parameter_count,
    planned_model,
    predicted_layouts,
    rank_stage,
    resolved_plan,
)
from hp_planner.price.workload import BF16_MIXED, FP32, RUNTIMES, Precision, StepShape, precision_of

__all__ = [
    "BF16_MIXED",
    "DEVICE_PRESETS",
    "FP32",
    "GIB",
    "KINDS",
    "PAPER",
    "RUNTIMES",
    "BlockActivations",
    "CollectiveRecord",
    "Device",
    "DryRun",
    "GroupSpec",
    "KeptActivations",
    "KindSummary",
    "MemoryBreakdown",
    "MetaModel",
    "MoEDims",
    "MoEShape",
    "MuonTraffic",
    "ParamSpec",
    "PipelineTiming",
    "Precision",
    "PricedModel",
    "PricingError",
    "RankGrid",
    "Reproduction",
    "SearchResult",
    "SearchSpace",
    "StageResult",
    "StepShape",
    "StepTime",
    "TransformerDims",
    "TransformerShape",
    "block_activations",
    "device_for",
    "dry_run",
    "format_dry_run",
    "format_reproduction",
    "format_search",
    "fsdp_groups",
    "job_plan",
    "kept_activations",
    "memory_breakdown",
    "model_parameters",
    "muon_traffic",
    "parameter_count",
    "pipeline_timing",
    "planned_model",
    "precision_of",
    "predicted_layouts",
    "rank_stage",
    "reproduce_paper",
    "resolved_plan",
    "search",
    "topology_preset",
]

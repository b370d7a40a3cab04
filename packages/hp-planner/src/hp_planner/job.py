"""The whole job's plan as frozen data: :class:`JobPlan`, one :class:`StagePlan` per stage.

A JobPlan is what :func:`hp_planner.plan_job` returns and what the executors take their parts
of: the tensor-parallel executor the stage's :class:`~hp_dtensor.parallel.ParallelPlan`, the
expert-parallel executor each MoE module's plan, ``hp_fsdp.fully_shard(..., plan=)`` the
:class:`~hp_fsdp.GroupPlan` of its call on its FSDP mesh, the pipeline runtime the
:class:`~hp_mpmd.SchedulePlan`. Plans compare by value; :meth:`JobPlan.to_dict` is the
JSON form a run writes as ``plan.json`` and :meth:`JobPlan.table` the text ``--print-plan``
shows.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from hp_dtensor.contract import ParamFlatSlot
from hp_dtensor.parallel import ParallelPlan
from hp_fsdp import GroupPlan
from hp_layout import Layout, Mesh, Topology
from hp_mpmd import SchedulePlan
from hp_muon import MuonStepPlan
from hp_planner.inputs import JobDims, TrainingPolicy
from hp_planner.meshes import StageMeshes
from hp_planner.report import job_table

__all__ = [
    "ContextPlan",
    "ExpertPlan",
    "FsdpGroup",
    "JobPlan",
    "MuonView",
    "StagePlan",
    "to_jsonable",
]


@dataclass(frozen=True)
class FsdpGroup:
    """One ``fully_shard`` call on one FSDP mesh.

    Attributes:
        unit: the name of the module it is called on in the stage model (``""``: the root).
        mesh: the FSDP mesh (1-d shard, or 2-d replicate and shard).
        plans: hp-fsdp's plans of the call on that mesh, one per storage dtype
            (``hp_fsdp.plan_fully_shard``; ``fully_shard(..., plan=plans)`` checks them).
    """

    unit: str
    mesh: Mesh
    plans: tuple[GroupPlan, ...]

    def flat_slots(self) -> dict[str, ParamFlatSlot]:
        """Every parameter's slot, by its name in the stage model."""
        prefix = f"{self.unit}." if self.unit else ""
        return {prefix + n: s for plan in self.plans for n, s in plan.flat_slots().items()}


@dataclass(frozen=True)
class ExpertPlan:
    """One MoE module under expert parallelism.

    Attributes:
        module: its name in the stage model.
        plan: its parallel plan over the stage's expert mesh (parameter names relative to
            the module), as the expert-parallel executor applies it.
    """

    module: str
    plan: ParallelPlan


@dataclass(frozen=True)
class ContextPlan:
    """Context parallelism of a stage.

    Attributes:
        variant: ``"ring"`` or ``"ulysses"``.
        modules: the attention cores it replaces (parameter-free).
        mesh: the ``(dp_replicate, dp_shard, cp, tp)`` mesh whose ``cp`` axis it runs on.
    """

    variant: str
    modules: tuple[str, ...]
    mesh: Mesh


@dataclass(frozen=True)
class MuonView:
    """The Muon step the ranks of one FSDP mesh plan (they hold the same layouts).

    Attributes:
        ranks: the FSDP mesh's ranks.
        plan: ``hp_muon.plan_muon`` of the stage's Muon parameters as those ranks hold them
            (``hp_muon.Muon(..., plan=)`` checks it at the first step).
    """

    ranks: tuple[int, ...]
    plan: MuonStepPlan


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage's plan (the whole job without pipelining).

    Attributes:
        index: the stage.
        meshes: its meshes.
        parallel: the tensor-parallel plan of the stage model over ``meshes.stage`` (every
            parameter replicated when ``tp == 1``), with each parameter's FSDP slot on the
            stage's first rank and its optimizer group.
        experts: the MoE modules' expert-parallel plans (``ep > 1``).
        context: context parallelism (``cp > 1``), else None.
        fsdp: every ``fully_shard`` call on every FSDP mesh of the stage: per mesh (in rank
            order), the expert units (over their own meshes), then the units, then the root.
        muon: the Muon step of every FSDP mesh (``()`` with AdamW alone).
        activation: the activation policy and the modules it applies to.
        offload: what lives on the host.
    """

    index: int
    meshes: StageMeshes
    parallel: ParallelPlan
    experts: tuple[ExpertPlan, ...]
    context: ContextPlan | None
    fsdp: tuple[FsdpGroup, ...]
    muon: tuple[MuonView, ...]
    activation: tuple[str, tuple[str, ...]]
    offload: str

    @property
    def ranks(self) -> tuple[int, ...]:
        """The stage's ranks, ascending."""
        return tuple(sorted(self.meshes.stage.ranks))

    def group_plans(self, unit: str, rank: int) -> tuple[GroupPlan, ...]:
        """The plans of the ``fully_shard`` call on ``unit`` seen by ``rank``.

        Raises:
            KeyError: no call on ``unit`` holds ``rank``.
        """
        for group in self.fsdp:
            if group.unit == unit and rank in group.mesh:
                return group.plans
        raise KeyError(
            f"stage {self.index} has no fully_shard call on {unit!r} holding rank {rank}"
        )

    def flat_slots(self, rank: int) -> dict[str, ParamFlatSlot]:
        """Every parameter's FSDP slot on ``rank``, by its name in the stage model."""
        slots: dict[str, ParamFlatSlot] = {}
        for group in self.fsdp:
            if rank in group.mesh:
                slots.update(group.flat_slots())
        return slots

    def muon_plan(self, rank: int) -> MuonStepPlan | None:
        """The Muon step plan of ``rank`` (None with AdamW alone)."""
        for view in self.muon:
            if rank in view.ranks:
                return view.plan
        return None

    def layouts(self, rank: int) -> dict[str, Layout]:
        """Every parameter's layout on ``rank`` once sharded (FSDP over its tensor- or
        expert-parallel layout), by its name in the stage model."""
        out: dict[str, Layout] = {}
        for group in self.fsdp:
            if rank in group.mesh:
                prefix = f"{group.unit}." if group.unit else ""
                for plan in group.plans:
                    out.update(
                        {prefix + n: lay for n, lay in zip(plan.fqns, plan.layouts, strict=True)}
                    )
        return out

    def expert_plan(self, module: str) -> ParallelPlan:
        """The expert-parallel plan of MoE module ``module``.

        Raises:
            KeyError: ``module`` is not an expert-parallel MoE module of the stage.
        """
        for expert in self.experts:
            if expert.module == module:
                return expert.plan
        raise KeyError(f"stage {self.index} has no expert-parallel module {module!r}")


@dataclass(frozen=True)
class JobPlan:
    """The whole job's plan (module docstring).

    Attributes:
        dims: the ranks along each axis.
        training: the training policy it was planned for.
        grid: the job's rank grid.
        stages: one plan per pipeline stage, in stage order.
        schedule: the pipeline schedule (``pp > 1``), else None.
        topology: the topology it was planned on, None when none was given.
    """

    dims: JobDims
    training: TrainingPolicy
    grid: Mesh
    stages: tuple[StagePlan, ...]
    schedule: SchedulePlan | None = None
    topology: Topology | None = None

    def stage_of(self, rank: int) -> StagePlan:
        """The stage holding ``rank``.

        Raises:
            KeyError: ``rank`` is not in the job.
        """
        for stage in self.stages:
            if rank in stage.meshes.stage:
                return stage
        raise KeyError(f"rank {rank} is not in the job's {self.dims.world_size} ranks")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: every field, parallel plans as
        :meth:`~hp_dtensor.parallel.ParallelPlan.to_dict` gives them, placements as their
        repr, meshes as shape, axis names and ranks."""
        out = to_jsonable(self)
        assert isinstance(out, dict)
        return out

    def to_json(self, indent: int | None = 1) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        """One table per stage: a line naming the stage, its ranks and meshes, the parallel
        plan's table (local shapes of the stage's first rank), then its FSDP groups."""
        return job_table(self)


def to_jsonable(value: Any) -> Any:
    """``value`` as JSON-ready data (see :meth:`JobPlan.to_dict`)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, ParallelPlan):
        return value.to_dict()
    if isinstance(value, Mesh):
        return {
            "shape": list(value.shape),
            "axis_names": list(value.axis_names),
            "ranks": list(value.ranks),
        }
    if isinstance(value, Layout):
        return {
            "global_shape": list(value.global_shape),
            "mesh": to_jsonable(value.mesh),
            "placements": [repr(p) for p in value.placements],
            "shard_order": to_jsonable(getattr(value, "shard_order", None)),
        }
    if isinstance(value, enum.Enum):
        return value.name
    if is_dataclass(value) and not isinstance(value, type):
        if type(value).__module__.startswith("hp_layout.placement"):
            return repr(value)
        return {f.name: to_jsonable(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [to_jsonable(v) for v in value]
    return repr(value)

"""The dry run prices the trainer's JobPlan instead of planning again.

The oracle of every check is the trainer's own plan, :func:`hp_train.parallel.job.plan_run`
(every mesh, the Muon step, the schedule), made apart from the dry run's cached, restricted
plans: the FSDP groups the dry run prices are that plan's ``fully_shard`` calls, its Muon
figures are that plan's Muon step, its pipeline timing simulates that plan's schedule; and
``hp_planner.plan_job(ranks=, muon=)`` (what the dry run plans with) is the full plan on the
meshes it keeps.
"""

from __future__ import annotations

import pytest

from hp_dtensor.parallel import ParallelPlan
from hp_fsdp import plan_fully_shard, spec_from_plan
from hp_mpmd.simulate import simulate
from hp_muon import plan_muon
from hp_planner import JobPlan, PlanInputError, StagePlan, plan_job
from hp_planner.price import fsdp_groups, model_parameters, pipeline_timing
from hp_planner.price.muon_traffic import job_muon_step, planned_traffic
from hp_planner.price.structure import job_plan
from hp_train.config.presets import MODEL_PRESETS
from hp_train.config.schema import ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.dryrun import TrainerModel
from hp_train.parallel.job import model_parallelism, plan_run, stage_models, training_policy

TINY = MODEL_PRESETS["tiny"].model
TINY_MOE = MODEL_PRESETS["tiny-moe"].model
ODD = ModelConfig(vocab_size=250, dim=48, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=100)
MOE3 = ModelConfig(
    n_layers=3, moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=32, n_shared_experts=1)
)
MUON = TrainConfig(optimizer="muon")


def _trainer(model: ModelConfig, parallel: ParallelConfig) -> JobPlan:
    return plan_run(model, parallel, MUON)


def _calls(stage: StagePlan, rank: int) -> list[tuple[str, tuple[str, ...], int, int]]:
    """The ``fully_shard`` calls holding ``rank`` in forward order (an MoE layer's before its
    block's), each as (unit, parameter names, padded elements, tail start)."""
    experts = {e.module for e in stage.experts}
    dense = [g for g in stage.fsdp if rank in g.mesh and g.unit not in experts]
    moe = {g.unit: g for g in stage.fsdp if rank in g.mesh and g.unit in experts}
    out = []
    for group in dense:
        for call in ([moe[f"{group.unit}.ffn"]] if f"{group.unit}.ffn" in moe else []) + [group]:
            (plan,) = call.plans
            prefix = f"{call.unit}." if call.unit else ""
            names = tuple(prefix + n for n in plan.fqns)
            out.append((call.unit or "root", names, plan.flat.padded_numel, plan.extra_start))
    return out


CASES = [
    ("fsdp", TINY, ParallelConfig(1, 4, 1, 1)),
    ("hsdp x tp", ODD, ParallelConfig(2, 2, 2, 1)),
    ("pp x tp", ODD, ParallelConfig(1, 1, 2, 2)),
    ("ep", MOE3, ParallelConfig(1, 4, 1, 1, ep=2)),
    ("ep x tp", TINY_MOE, ParallelConfig(1, 2, 2, 1, ep=2, ep_tp=True)),
]


@pytest.mark.parametrize(("name", "model", "parallel"), CASES, ids=[c[0] for c in CASES])
def test_priced_groups_are_the_trainers_fully_shard_calls(
    name: str, model: ModelConfig, parallel: ParallelConfig
) -> None:
    """Every stage and tensor-parallel coordinate: the groups the dry run prices are the
    trainer's plan's calls holding that coordinate's first data-parallel rank, in order,
    with the same parameters, buffer and tail."""
    trainer = _trainer(model, parallel)
    specs = {p.name: p for p in model_parameters(TrainerModel(model))}
    for k, stage in enumerate(trainer.stages):
        for c in range(parallel.tp):
            rank = stage.ranks[0] + c
            groups = fsdp_groups(
                TrainerModel(model),
                parallel.dp_shard,
                parallel.tp,
                tp_coordinate=c,
                pp=parallel.pp,
                stage=k,
                ep=parallel.ep,
                ep_tp=parallel.ep_tp,
            )
            got = [
                (g.name, tuple(p.name for p in g.params), g.flat.padded_numel, g.extra_start)
                for g in groups
            ]
            assert got == _calls(stage, rank), (name, k, c)
            for g in groups:
                for p in g.params:
                    assert p == specs[p.name]
                    assert p.optimizer == stage.parallel.param(p.name).optimizer_group


def _planned(model: ModelConfig, parallel: ParallelConfig, **kwargs: object) -> JobPlan:
    from dataclasses import asdict

    from hp_planner import JobDims

    return plan_job(
        stage_models(model, parallel.pp),
        JobDims(**asdict(parallel)),
        model_parallelism(model, parallel),
        training_policy(MUON),
        **kwargs,  # type: ignore[arg-type]
    )


def test_plan_job_on_some_ranks_is_the_full_plan_on_their_meshes() -> None:
    """``ranks=``: exactly the calls (and Muon steps) of the full plan on the meshes holding
    those ranks; ``muon=False``: no Muon step, the rest equal; a missing first rank refused."""
    parallel = ParallelConfig(1, 4, 1, 1, ep=2)
    full = _trainer(MOE3, parallel)
    some = _planned(MOE3, parallel, ranks={0})  # expert meshes [0, 2] and [1, 3]: one kept
    (stage,) = full.stages
    (kept,) = some.stages
    assert kept.fsdp == tuple(g for g in stage.fsdp if 0 in g.mesh)
    assert len(kept.fsdp) < len(stage.fsdp)
    assert kept.parallel == stage.parallel
    assert kept.muon == tuple(v for v in stage.muon if 0 in v.ranks)
    for rank in (0, 2):
        assert kept.layouts(rank) == stage.layouts(rank)
    bare = _planned(MOE3, parallel, muon=False)
    assert bare.stages[0].muon == () != stage.muon
    assert bare.stages[0].fsdp == stage.fsdp
    assert bare.stages[0].parallel == stage.parallel
    with pytest.raises(PlanInputError, match="first rank 0"):
        _planned(MOE3, parallel, ranks={1})


@pytest.mark.parametrize("parallel", [ParallelConfig(2, 2, 1, 1), ParallelConfig(1, 2, 2, 1)])
def test_muon_figures_read_the_trainers_muon_step(parallel: ParallelConfig) -> None:
    """The dry run's Muon step is the trainer's plan's (hp_muon re-plans its parameters and
    layouts only for another bucket size), and its bytes are that plan's per-rank sends."""
    trainer = _trainer(TINY, parallel)
    priced = job_plan(TrainerModel(TINY), parallel, ranks=frozenset(range(4)), muon=True)
    for rank in range(4):
        step = trainer.stages[0].muon_plan(rank)
        assert step is not None
        assert job_muon_step(priced, rank, 32.0) == step
        layouts = trainer.stages[0].layouts(rank)
        names = [n for g in step.groups for n in g.names]
        small = plan_muon(
            [(n, layouts[n]) for n in names], bucket_cap_mb=0.01, group_ranks=range(4), rank=rank
        )
        assert job_muon_step(priced, rank, 0.01) == small != step
        # Brute force over the plan's jobs: a matrix's gathered pieces this rank holds go to
        # its owner, and the owner sends every other holder its pieces back.
        sent = 0
        for group in step.groups:
            for job in group.plan.jobs:
                if job.owner != rank:
                    sent += sum(p.numel for p in job.sources if p.rank == rank)
                else:
                    sent += sum(p.numel for p in job.targets if p.rank != rank)
        traffic = planned_traffic(step, rank, parallel.dp_shard * parallel.tp)
        assert traffic.source == "plan"
        assert traffic.sent_bytes == 2 * sent


def test_pipeline_timing_simulates_the_trainers_schedule() -> None:
    """The bubble the dry run prices is hp-mpmd's simulation of the trainer's plan's
    ``JobPlan.schedule``, for both schedules."""
    for schedule in ("gpipe", "1f1b"):
        train = TrainConfig(optimizer="muon", pp_schedule=schedule, microbatches=3)
        plan = plan_run(ODD, ParallelConfig(1, 1, 1, 3), train)
        assert plan.schedule is not None
        sim = simulate(plan.schedule, forward=1.0, backward=2.0, comm=0.25)
        timing = pipeline_timing(schedule, 3, 3, 1.0, 2.0, 0.25)
        assert timing.makespan == sim.makespan
        assert timing.in_flight == sim.peak_in_flight


@pytest.mark.parametrize(
    "parallel", [ParallelConfig(1, 4, 1, 1, ep=2), ParallelConfig(1, 2, 2, 1, ep=2)]
)
def test_every_call_is_hp_fsdps_plan_of_it(parallel: ParallelConfig) -> None:
    """hp-planner plans alike calls once (a stage's blocks, its MoE modules): every call of
    the plan is still ``hp_fsdp.plan_fully_shard`` of that call, asked directly."""
    (model,) = stage_models(MOE3, 1)
    plan = _planned(MOE3, parallel, ranks={0}).stages[0]
    experts = {e.module: e.plan for e in plan.experts}
    done: dict[object, list[str]] = {}
    for group in plan.fsdp:
        first = group.mesh.ranks[0]
        module = model.get_submodule(group.unit)
        tp: ParallelPlan | None
        if group.unit in experts:
            tp = experts[group.unit]
            nested: list[str] = []
        else:
            tp = plan.parallel if parallel.tp > 1 else None
            nested = done.setdefault(group.mesh, list(experts))
        specs = None
        if tp is not None:
            prefix = "" if group.unit in experts or not group.unit else f"{group.unit}."
            specs = {
                p: spec_from_plan(tp.param(prefix + n), first) for n, p in module.named_parameters()
            }
        expected = plan_fully_shard(
            module, group.mesh, nested=[model.get_submodule(n) for n in nested], specs=specs
        )
        assert group.plans == tuple(p.with_owner(group.unit) for p in expected), group.unit
        if group.unit not in experts:
            nested.append(group.unit)

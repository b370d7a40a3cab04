"""``plan_job`` on models nobody in hp-planner wrote, checked three ways.

* By formula: every parameter is in exactly one ``fully_shard`` call per FSDP mesh; each
  call's buffer holds the sum of its parameters' local sizes (Colwise splits dim 0, Rowwise
  dim 1, by ``tp``), rounded up to a whole number of 16-byte-aligned chunks.
* Against the executors: the same model laid out for real on 4 gloo ranks (hp-dtensor's
  ``parallelize_module``, then hp-fsdp's ``fully_shard`` on each block and the root) records
  exactly the flat slots and layouts the plan holds for every rank.
* As data: equal inputs give equal plans and equal JSON; bad inputs are named.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_dtensor.parallel import ColwiseParallel, PlanError, RowwiseParallel
from hp_planner import (
    JobDims,
    JobPlan,
    ModelParallelism,
    PlanInputError,
    TrainingPolicy,
    plan_job,
)
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)
TP_PLAN = {
    "layers.*.attn.q_proj": ColwiseParallel(),
    "layers.*.attn.k_proj": ColwiseParallel(),
    "layers.*.attn.v_proj": ColwiseParallel(),
    "layers.*.attn.o_proj": RowwiseParallel(),
    "layers.*.ffn.w1": ColwiseParallel(),
    "layers.*.ffn.w3": ColwiseParallel(),
    "layers.*.ffn.w2": RowwiseParallel(),
}
COLWISE = ("q_proj", "k_proj", "v_proj", "w1", "w3")
ROWWISE = ("o_proj", "w2")


def _meta_model() -> Llama:
    with torch.device("meta"):
        return Llama(CONFIG)


def _plan(dims: JobDims, optimizer: str = "muon") -> JobPlan:
    return plan_job(
        _meta_model(),
        dims,
        ModelParallelism.of(TP_PLAN, fsdp_units=("layers.*",)),
        TrainingPolicy(optimizer=optimizer),
    )


def _local_numel(name: str, shape: tuple[int, ...], tp: int) -> int:
    """The formula: Colwise keeps 1/tp of the rows, Rowwise of the columns, the rest whole."""
    leaf = name.split(".")[-2]
    if tp > 1 and leaf in COLWISE:
        return (shape[0] // tp) * shape[1]
    if tp > 1 and leaf in ROWWISE:
        return shape[0] * (shape[1] // tp)
    return math.prod(shape)


@pytest.mark.parametrize(
    "dims",
    [JobDims(dp_shard=2), JobDims(dp_shard=2, tp=2), JobDims(dp_replicate=2, dp_shard=2)],
    ids=repr,
)
def test_every_parameter_in_one_call_per_fsdp_mesh_with_the_buffer_sizes_of_the_formula(
    dims: JobDims,
) -> None:
    plan = _plan(dims)
    assert plan == _plan(dims)
    assert plan.to_json() == _plan(dims).to_json()
    (stage,) = plan.stages
    shapes = {n: tuple(p.shape) for n, p in _meta_model().named_parameters()}
    meshes = {g.mesh for g in stage.fsdp}
    assert len(meshes) == dims.tp
    shards = dims.dp_shard
    for mesh in meshes:
        calls = [g for g in stage.fsdp if g.mesh == mesh]
        assert [g.unit for g in calls] == ["layers.0", "layers.1", ""]
        assert all(len(g.plans) == 1 for g in calls)  # one dtype: one buffer per call
        names = [f"{g.unit}.{f}" if g.unit else f for g in calls for f in g.plans[0].fqns]
        assert sorted(names) == sorted(shapes)
        for g in calls:
            (group,) = g.plans
            prefix = f"{g.unit}." if g.unit else ""
            numel = sum(_local_numel(prefix + f, shapes[prefix + f], dims.tp) for f in group.fqns)
            assert numel <= group.flat.padded_numel
            # 16-byte alignment of fp32 (4 elements) per parameter, then whole chunks.
            assert group.flat.padded_numel - numel < 4 * len(group.fqns) + shards * 4
            assert group.flat.padded_numel % shards == 0
            assert group.chunk_numel * shards == group.flat.padded_numel
    groups = {p.fqn: p.optimizer_group for p in stage.parallel.params}
    assert groups["layers.0.attn.q_proj.weight"] == "muon"
    assert groups["tok_embeddings.weight"] == groups["norm.weight"] == "adamw"
    assert set(_plan(dims, "adamw").stages[0].parallel.params[0].optimizer_group or "") == set(
        "adamw"
    )
    table = plan.table()
    assert all(name in table for name in shapes)
    assert json.loads(plan.to_json())["dims"]["tp"] == dims.tp


def _lay_out(dims: JobDims, muon_plans: dict[int, Any]) -> dict[str, Any]:
    """On each rank: the model laid out by the executors, what they recorded; then one Muon
    step given this rank's planned Muon step (``Muon(plan=)`` refuses any other)."""
    from hp_dtensor import DeviceMesh
    from hp_dtensor.contract import parallel_plan_of
    from hp_dtensor.parallel import parallelize_module
    from hp_fsdp import fully_shard
    from hp_layout import Mesh
    from hp_muon import Muon, split_params

    torch.manual_seed(0)
    model = Llama(CONFIG)
    grid = Mesh((dims.dp_replicate, dims.dp_shard, dims.tp), ("dp_replicate", "dp_shard", "tp"))
    mesh = DeviceMesh("cpu", grid)
    axes = ["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else ["dp_shard"]
    if dims.tp > 1:
        parallelize_module(model, mesh, TP_PLAN, tp_axis="tp", dp_axes=("dp_replicate", "dp_shard"))
    for block in model.layers:
        fully_shard(block, mesh=mesh[axes])
    fully_shard(model, mesh=mesh[axes])
    applied = parallel_plan_of(model)
    assert applied is not None
    muon = Muon(split_params(model).muon_params, lr=0.01, plan=muon_plans[dist.get_rank()])
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    model(tokens).float().square().mean().backward()
    muon.step()  # plans its step and compares it with the given plan first
    return {
        "rank": dist.get_rank(),
        "slots": {p.fqn: p.flat for p in applied.params if p.flat is not None},
        "layouts": {p.fqn: (p.layout, p.reduction) for p in applied.params},
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "dims", [JobDims(dp_shard=2, tp=2), JobDims(dp_replicate=2, dp_shard=2)], ids=repr
)
def test_the_executors_record_what_the_plan_says_on_every_rank(dims: JobDims) -> None:
    plan = _plan(dims)
    (stage,) = plan.stages
    muon_plans = {r: stage.muon_plan(r) for r in range(dims.world_size)}
    for got in run_on_ranks(dims.world_size, _lay_out, dims, muon_plans, timeout=120):
        rank = got["rank"]
        want = {}
        for g in stage.fsdp:
            if rank in g.mesh:
                prefix = f"{g.unit}." if g.unit else ""
                want.update({prefix + n: s for p in g.plans for n, s in p.flat_slots().items()})
        assert got["slots"] == want, rank
        if dims.tp > 1:
            assert got["layouts"] == {p.fqn: (p.layout, p.reduction) for p in stage.parallel.params}


def test_ranks_plans_only_the_meshes_holding_them() -> None:
    dims = JobDims(dp_shard=2, tp=2)
    full = _plan(dims)
    part = plan_job(
        _meta_model(),
        dims,
        ModelParallelism.of(TP_PLAN, fsdp_units=("layers.*",)),
        TrainingPolicy(),
        ranks=[0],
    )
    (stage,) = part.stages
    assert {g.mesh.ranks for g in stage.fsdp} == {(0, 2)}  # tp innermost: rank 0's dp peers
    assert stage.fsdp == tuple(g for g in full.stages[0].fsdp if 0 in g.mesh)
    assert stage.parallel == full.stages[0].parallel
    assert full.stages[0].muon
    quick = plan_job(
        _meta_model(),
        dims,
        ModelParallelism.of(TP_PLAN, fsdp_units=("layers.*",)),
        TrainingPolicy(),
        muon=False,
    )
    assert quick.stages[0].muon == ()
    assert quick.stages[0].fsdp == full.stages[0].fsdp


def test_a_middle_stage_root_call_is_planned_with_no_group() -> None:
    """A pipeline stage holding blocks only: ``fully_shard`` is still called on its root,
    which makes no group; the plan says so (``plan=()``)."""
    middle = _meta_model()
    middle.tok_embeddings = None  # type: ignore[assignment]
    middle.norm = None  # type: ignore[assignment]
    middle.output = None  # type: ignore[assignment]
    parallelism = ModelParallelism.of(TP_PLAN, fsdp_units=("layers.*",))
    plan = plan_job(
        [_meta_model(), middle], JobDims(pp=2, dp_shard=2), parallelism, TrainingPolicy()
    )
    stage = plan.stages[1]
    assert [g.unit for g in stage.fsdp] == ["layers.0", "layers.1", ""]
    assert stage.group_plans("", 2) == ()
    assert stage.group_plans("layers.0", 3)


def test_two_models_planned_with_the_same_patterns_get_their_own_modules() -> None:
    parallelism = ModelParallelism.of(TP_PLAN, fsdp_units=("layers.*",))
    for n_layers in (2, 3, 1):
        with torch.device("meta"):
            model = Llama(LlamaConfig(**{**CONFIG.__dict__, "n_layers": n_layers}))
        (stage,) = plan_job(model, JobDims(dp_shard=2), parallelism, TrainingPolicy()).stages
        units = [f"layers.{i}" for i in range(n_layers)]
        assert [g.unit for g in stage.fsdp] == [*units, ""]


def test_the_optimizer_split_follows_the_recipe_and_muon_runs_on_every_rank() -> None:
    parallelism = ModelParallelism.of(TP_PLAN, fsdp_units=("layers.*",))
    training = TrainingPolicy(adamw_patterns=("layers.0.attn.q_proj.*",))
    plan = plan_job(
        [_meta_model(), _meta_model()], JobDims(pp=2, dp_shard=2), parallelism, training
    )
    for stage in plan.stages:
        groups = {p.fqn: p.optimizer_group for p in stage.parallel.params}
        assert groups["layers.0.attn.q_proj.weight"] == "adamw"
        assert groups["layers.1.attn.q_proj.weight"] == "muon"
        matrices = sum(1 for g in groups.values() if g == "muon")
        for rank in stage.ranks:
            step = stage.muon_plan(rank)
            assert step is not None
            (group,) = step.groups
            # Muon's default process group: every rank of the job, each stage's too.
            assert group.ranks == (0, 1, 2, 3)
            assert len(group.indices) == matrices


def test_a_hugging_face_model_plans_without_processes() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    hf_plan = {
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    }
    plan = plan_job(
        model,
        JobDims(dp_shard=2, tp=2),
        ModelParallelism.of(hf_plan, fsdp_units=("model.layers.*",)),
        TrainingPolicy(),
    )
    (stage,) = plan.stages
    names = {n for n, _ in model.named_parameters()}  # the tied head under its first name
    for mesh in {g.mesh for g in stage.fsdp}:
        held = [
            f"{g.unit}.{f}" if g.unit else f
            for g in stage.fsdp
            if g.mesh == mesh
            for p in g.plans
            for f in p.fqns
        ]
        assert sorted(held) == sorted(names)
    q = stage.parallel.param("model.layers.0.self_attn.q_proj.weight")
    assert q.layout.local_shape(0) == (16, 32)
    k = stage.parallel.param("model.layers.1.self_attn.k_proj.weight")
    assert k.layout.local_shape(1) == (8, 32)


def test_bad_inputs_are_named() -> None:
    parallelism = ModelParallelism.of(TP_PLAN, fsdp_units=("blocks.*",))
    with pytest.raises(PlanInputError, match=r"fsdp_units entry 'blocks\.\*' names no module"):
        plan_job(_meta_model(), JobDims(dp_shard=2), parallelism, TrainingPolicy())
    with pytest.raises(PlanInputError, match="pp=2 needs one model per pipeline stage, got 1"):
        plan_job(_meta_model(), JobDims(pp=2), ModelParallelism(), TrainingPolicy())
    with pytest.raises(PlanInputError, match="ep=2 needs expert_modules"):
        plan_job(_meta_model(), JobDims(dp_shard=2, ep=2), ModelParallelism(), TrainingPolicy())
    with pytest.raises(PlanInputError, match="optimizer must be one of"):
        TrainingPolicy(optimizer="sgd")
    with pytest.raises(PlanError, match="attn_norm"):
        plan_job(
            _meta_model(),
            JobDims(tp=2),
            ModelParallelism.of({"layers.*.attn_norm": ColwiseParallel()}),
            TrainingPolicy(),
        )

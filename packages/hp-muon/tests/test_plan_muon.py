"""``plan_muon``: the plan of a whole Muon step from layouts alone, and ``Muon(plan=...)``.

* Pure: the step's matrices split by the ranks their layouts span (several: the exchanged
  group, keyed by the process group's ranks, in buckets of ``bucket_cap_mb`` MiB of bf16;
  one: the single-rank group, keyed by the rank, one bucket); names are labels, not compared.
  A difference is named: the rank groups, a matrix's owner (with its parameter), the bucket
  size.
* One device: ``Muon.planned()`` is ``plan_muon`` of the parameters' layouts; ``plan=`` equal
  steps bit for bit as without it; a different plan raises before any state changes.
* World 2, for plain, DDP-replicated (``replicate_group``), torch FSDP2, hp DTensor
  tensor-parallel and hp production tensor-parallel parameters: the same, with the layouts
  read through ``hp_dtensor.layout_of`` (a DDP parameter: its shape replicated over the
  world, as ``Muon(replicate_group=...)`` takes it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _sharders import sharders
from hp_dtensor import layout_of
from hp_layout import Layout, Mesh, Replicate, Shard
from hp_muon import MatrixTensor, Muon, MuonStepPlan, plan_muon, plan_muon_step
from hp_muon.plan_check import check_muon_plan
from hp_muon.tensors import is_plain, local_data
from hp_testing import run_on_ranks

SHAPES = ((18, 8), (8, 18), (12, 20), (3, 6, 4), (2, 3))
CAP_MB = 0.0002  # 104 bf16 elements: several buckets
CAP_NUMEL = int(CAP_MB * 2**20) // 2

TP = Mesh((2,), ("tp",))


def _layouts() -> list[tuple[str, Layout]]:
    return [
        ("a", Layout((18, 8), TP, [Shard(0)])),
        ("plain", Layout((4, 4), Mesh((1,), ("replica",), (1,)), [Replicate()])),
        ("b", Layout((8, 6), TP, [Shard(1)])),
    ]


def _with_owner(plan: MuonStepPlan, group: int, job: int, owner: int) -> MuonStepPlan:
    g = plan.groups[group]
    jobs = list(g.plan.jobs)
    jobs[job] = dataclasses.replace(jobs[job], owner=owner)
    changed = dataclasses.replace(g, plan=dataclasses.replace(g.plan, jobs=tuple(jobs)))
    groups = list(plan.groups)
    groups[group] = changed
    return MuonStepPlan(tuple(groups))


# Pure -----------------------------------------------------------------------------------------


def test_plan_muon_splits_by_ranks_and_buckets_by_size() -> None:
    assert not dist.is_initialized()
    named = _layouts()
    plan = plan_muon(named, bucket_cap_mb=CAP_MB, group_ranks=(0, 1), rank=1)
    assert CAP_NUMEL == 104
    assert [(g.ranks, g.local, g.indices, g.bucket_numel) for g in plan.groups] == [
        ((0, 1), False, (0, 2), 104),
        ((1,), True, (1,), 2**62),
    ]
    spread = plan_muon_step(
        [MatrixTensor(named[0][1]), MatrixTensor(named[2][1])], bucket_numel=104
    )
    assert plan.by_ranks() == {
        (0, 1): spread,
        (1,): plan_muon_step([MatrixTensor(named[1][1])], bucket_numel=2**62),
    }
    # 144 + 48 elements over a 104-element bucket: one matrix per bucket.
    assert spread.buckets == ((0,), (1,))
    # Names label; they are not compared.
    renamed = [(f"x{i}", layout) for i, (_, layout) in enumerate(named)]
    assert plan_muon(renamed, bucket_cap_mb=CAP_MB, group_ranks=(0, 1), rank=1) == plan
    with pytest.raises(ValueError, match="bucket_cap_mb must be positive"):
        plan_muon(named, bucket_cap_mb=0)


def test_a_different_plan_is_named() -> None:
    named = _layouts()
    plan = plan_muon(named, bucket_cap_mb=CAP_MB, group_ranks=(0, 1), rank=1)
    check_muon_plan(plan, plan)
    owner = plan.groups[0].plan.jobs[1].owner
    moved = _with_owner(plan, 0, 1, 1 - owner)
    with pytest.raises(ValueError, match="group of ranks") as error:
        check_muon_plan(plan, moved)
    assert (
        f"group of ranks (0, 1): matrix 1 (parameter 'b', matrix 0 of it): owner planned "
        f"{owner}, given {1 - owner}" in str(error.value)
    )
    bigger = plan_muon(named, bucket_cap_mb=1.0, group_ranks=(0, 1), rank=1)
    with pytest.raises(ValueError, match="bucket size planned 104 elements, given 524288"):
        check_muon_plan(plan, bigger)
    other_rank = plan_muon(named, bucket_cap_mb=CAP_MB, group_ranks=(0, 1), rank=0)
    with pytest.raises(ValueError, match=r"rank groups planned \[\(0, 1\), \(1,\)\], given"):
        check_muon_plan(plan, other_rank)
    with pytest.raises(TypeError, match="MuonStepPlan"):
        check_muon_plan(plan, plan.by_ranks())


def _step(opt: Muon, params: list[nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def test_one_device_muon_plans_what_plan_muon_returns() -> None:
    torch.manual_seed(0)
    fulls = [torch.randn(s) for s in SHAPES]
    plain = [nn.Parameter(f.clone()) for f in fulls]
    given = [nn.Parameter(f.clone()) for f in fulls]
    expected = plan_muon([(f"p{i}", layout_of(p)) for i, p in enumerate(plain)], rank=0)
    opt = Muon(plain, ns_dtype=torch.bfloat16, fuse_shapes=False)
    checked = Muon(given, ns_dtype=torch.bfloat16, fuse_shapes=False, plan=expected)
    assert opt.planned() is None
    for seed in range(2):
        _step(opt, plain, seed)
        _step(checked, given, seed)
    assert opt.planned() == expected == checked.planned()
    assert all(torch.equal(a, b) for a, b in zip(plain, given, strict=True))
    wrong = [nn.Parameter(f.clone()) for f in fulls]
    refused = Muon(
        wrong, plan=plan_muon([(str(i), layout_of(p)) for i, p in enumerate(wrong)], rank=1)
    )
    with pytest.raises(ValueError, match=r"rank groups planned \[\(0,\)\], given \[\(1,\)\]"):
        _step(refused, wrong, 0)
    # Checked before any state changed: no momentum, the parameters as they were.
    assert not refused.state
    assert all(torch.equal(p, f) for p, f in zip(wrong, fulls, strict=True))


# World 2 --------------------------------------------------------------------------------------

NAMES = ["plain", "ddp", "torch_fsdp2", "hp_dtensor", "hp_tp_production"]


def _planning_layout(name: str, p: torch.Tensor) -> Layout:
    """The layout a planner hands plan_muon: ``layout_of``, or for DDP the parameter's shape
    replicated over the world (``Muon(replicate_group=WORLD)``)."""
    if name == "ddp":
        assert is_plain(p)
        world = dist.get_world_size()
        return Layout(tuple(p.shape), Mesh((world,), ("replicate",), range(world)), [Replicate()])
    return layout_of(p)


def _agree(name: str) -> dict[str, str]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    sharder = next(s for s in sharders(world) if s.name == name)
    torch.manual_seed(0)
    fulls = [torch.randn(s) for s in SHAPES]
    kwargs = {"bucket_cap_mb": CAP_MB, "ns_dtype": torch.bfloat16, "fuse_shapes": False}
    kwargs.update(sharder.muon_kwargs())

    def planned(params: list[nn.Parameter], **options: object) -> MuonStepPlan:
        named = [(f"p{i}", _planning_layout(name, p)) for i, p in enumerate(params)]
        settings = {"bucket_cap_mb": CAP_MB, "group_ranks": range(world), "rank": rank}
        settings.update(options)
        return plan_muon(named, **settings)  # type: ignore[arg-type]

    def step(opt: Muon, params: list[nn.Parameter], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for p, shape in zip(params, SHAPES, strict=True):
            p.grad = sharder.grad(p, torch.randn(shape, generator=g))
        opt.step()

    plain, given = sharder.make(fulls), sharder.make(fulls)
    expected = planned(plain)
    opt = Muon(plain, **kwargs)  # type: ignore[arg-type]
    checked = Muon(given, plan=expected, **kwargs)  # type: ignore[arg-type]
    for seed in range(2):
        step(opt, plain, seed)
        step(checked, given, seed)
    assert opt.planned() == expected == checked.planned()
    exchanged = [g for g in expected.groups if not g.local]
    assert bool(exchanged) == (name != "plain")
    for a, b in zip(plain, given, strict=True):
        assert torch.equal(local_data(a), local_data(b)), name
    errors: dict[str, str] = {}
    wrong: dict[str, MuonStepPlan] = {}
    if not exchanged:
        wrong["rank"] = planned(plain, rank=1 - rank)
    else:
        wrong["bucket"] = planned(plain, bucket_cap_mb=1.0)
        job = exchanged[0].plan.jobs[0]
        wrong["owner"] = _with_owner(expected, 0, 0, 1 - job.owner)
    for case, plan in wrong.items():
        params = sharder.make(fulls)
        refused = Muon(params, plan=plan, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="the given plan differs") as error:
            step(refused, params, 0)
        assert not refused.state
        errors[case] = str(error.value)
    return errors


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", NAMES)
def test_muon_plans_what_plan_muon_returns(name: str) -> None:
    for rank, errors in enumerate(run_on_ranks(2, _agree, name, timeout=120)):
        if name == "plain":
            assert f"rank groups planned [({rank},)], given [({1 - rank},)]" in errors["rank"]
            continue
        assert "group of ranks (0, 1): bucket size planned 104 elements" in errors["bucket"]
        assert (
            "matrix 0 (parameter 'parameter 0', matrix 0 of it): owner planned" in errors["owner"]
        )

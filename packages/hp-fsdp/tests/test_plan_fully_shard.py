"""``plan_fully_shard``: the group plans of one fully_shard call, without processes, and
``fully_shard(plan=...)``, which checks a given plan before it allocates.

* Pure (no process group): on a meta model, the plan names the parameters the call manages
  (those outside nested calls, a tied weight once) with the shapes, dtypes and mesh given by
  hand (``ParamSpec``s written out, planned by ``plan_group``); several storage dtypes give one
  plan each; a list call names its members' parameters ``"<index>.<name>"``.
* World 2: on a block-structured toy and on a tensor-parallel MLP
  (``parallelize_module`` Colwise/Rowwise over ``tp``, FSDP over ``dp``, meshes (dp, tp) of
  (1, 2) and (2, 1)), the plans of a meta copy (parallelized, or only resolved with
  ``hp_dtensor.parallel.resolve`` and read through ``spec_from_plan``) equal the plans
  fully_shard records on the live modules (``hp_fsdp._state.fsdp_state(module).groups[i].plan``,
  whose ``owner`` fully_shard sets once the root is sharded, so it is compared with the owner
  put back to ``""``).
* World 2: ``plan=`` equal trains bit for bit as without it; a plan of another mesh, another
  param dtype, or with its parameters reordered raises ``ValueError`` naming the field and both
  values, and the module is untouched (same parameter objects and values, not sharded).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module, resolve
from hp_fsdp import (
    GroupPlan,
    MixedPrecisionPolicy,
    ParamSpec,
    fully_shard,
    plan_fully_shard,
    plan_group,
    spec_from_plan,
)
from hp_fsdp._state import fsdp_state
from hp_layout import Mesh, ReduceOp
from hp_testing import run_on_ranks


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.proj(self.norm(x))
        return out


class Toy(nn.Module):
    """Embedding, blocks, a head tied to the embedding (one parameter, two places)."""

    def __init__(self, vocab: int = 11, dim: int = 6, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(blocks)])
        self.out_norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.out_norm(x))
        return logits


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(self.norm(x))))
        return out


def _meta_toy() -> Toy:
    with torch.device("meta"):
        return Toy()


# Pure -----------------------------------------------------------------------------------------


def test_a_meta_toy_plans_what_is_written_by_hand() -> None:
    assert not dist.is_initialized()
    model = _meta_toy()
    mesh = Mesh((2,), ("shard",))
    (block,) = plan_fully_shard(model.blocks[1], mesh)
    assert block == plan_group(
        [
            ParamSpec("norm.weight", (6,)),
            ParamSpec("norm.bias", (6,)),
            ParamSpec("proj.weight", (6, 6)),
            ParamSpec("proj.bias", (6,)),
        ],
        mesh,
        "shard",
    )
    # The root, blocks sharded by nested calls: the embedding (the head's weight is the same
    # parameter, once) and the final norm.
    (root,) = plan_fully_shard(model, mesh, nested=list(model.blocks))
    assert root == plan_group(
        [
            ParamSpec("embed.weight", (11, 6)),
            ParamSpec("out_norm.weight", (6,)),
            ParamSpec("out_norm.bias", (6,)),
        ],
        mesh,
        "shard",
    )
    assert root.owner == ""
    # Without the nested calls named, the root takes every parameter.
    (everything,) = plan_fully_shard(model, mesh)
    assert len(everything.fqns) == 3 + 4 * 2


def test_policies_and_lists_plan_as_fully_shard_would() -> None:
    model = _meta_toy()
    hsdp = Mesh((2, 2), ("replicate", "shard"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    (plan,) = plan_fully_shard(model.blocks[0], hsdp, mp_policy=mp, param_layout="per_param")
    assert (plan.shard_axis, plan.replicate_axes) == ("shard", ("replicate",))
    assert (plan.storage_dtype, plan.param_dtype, plan.reduce_dtype) == (
        "float32",
        "bfloat16",
        "float32",
    )
    assert plan.rows is not None
    (pair,) = plan_fully_shard([model.blocks[0], model.out_norm], Mesh((2,), ("shard",)))
    assert pair.fqns == (
        "0.norm.weight",
        "0.norm.bias",
        "0.proj.weight",
        "0.proj.bias",
        "1.weight",
        "1.bias",
    )
    # Two storage dtypes (a frozen bf16 weight beside fp32 ones): two groups.
    model.blocks[1].proj.to(torch.bfloat16).requires_grad_(False)
    plans = plan_fully_shard(model.blocks[1], Mesh((2,), ("shard",)))
    assert [(p.storage_dtype, p.fqns) for p in plans] == [
        ("float32", ("norm.weight", "norm.bias")),
        ("bfloat16", ("proj.weight", "proj.bias")),
    ]
    with pytest.raises(ValueError, match="param_layout must be"):
        plan_fully_shard(model, Mesh((2,), ("shard",)), param_layout="rows")


# World 2 --------------------------------------------------------------------------------------


def _recorded(module: nn.Module) -> list[GroupPlan]:
    """The plans fully_shard recorded on ``module``, owner put back to the planner's ``""``."""
    state = fsdp_state(module)
    assert state is not None
    return [g.plan.with_owner("") for g in state.groups]


def _toy_plans_agree() -> None:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("shard",)))
    meta = _meta_toy()
    planned = {
        "blocks.0": plan_fully_shard(meta.blocks[0], mesh.mesh),
        "blocks.1": plan_fully_shard(meta.blocks[1], mesh),  # a DeviceMesh is read too
        "": plan_fully_shard(meta, mesh.mesh, nested=list(meta.blocks)),
    }
    torch.manual_seed(0)
    model = Toy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name, plans in planned.items():
        assert tuple(_recorded(model.get_submodule(name))) == plans, name
    assert fsdp_state(model.blocks[1]).groups[0].plan.owner == "blocks.1"  # type: ignore[union-attr]


def _tp_plans_agree(shape: tuple[int, int]) -> None:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh(shape, ("dp", "tp")))
    styles = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    with torch.device("meta"):
        meta = MLP()
    # Without processes: the tensor-parallel plan resolved, not applied, on another meta copy.
    with torch.device("meta"):
        unapplied = MLP()
    resolved = resolve(unapplied, mesh.mesh, styles, tp_axis="tp")
    rank = dist.get_rank()
    specs = {p: spec_from_plan(resolved.param(n), rank) for n, p in unapplied.named_parameters()}
    from_resolved = plan_fully_shard(unapplied, mesh["dp"].mesh, specs=specs)
    parallelize_module(meta, mesh, styles, tp_axis="tp")
    planned = plan_fully_shard(meta, mesh["dp"].mesh)
    assert from_resolved == planned
    torch.manual_seed(0)
    model = MLP()
    parallelize_module(model, mesh, styles, tp_axis="tp")
    fully_shard(model, mesh=mesh["dp"])
    (recorded,) = _recorded(model)
    assert planned == (recorded,)
    # The tensor-parallel layouts reached the plan: up is cut by rows over tp (its local
    # shard packed), the norm (replicated on tp) last, its gradient summed over tp.
    up = recorded.fqns.index("up.weight")
    base = recorded.bases[up]
    assert base is not None
    assert base.global_shape == (12, 8)
    assert recorded.shapes[up] == (12 // shape[1], 8)
    if shape[1] > 1:
        # Parameters replicated on tp (the norm, the row-wise bias) are packed last.
        assert recorded.fqns[-3:] == ("norm.weight", "norm.bias", "down.bias")
        assert recorded.extra_reduce == (("tp", ReduceOp.SUM),)


def _train(model: Toy, steps: int = 2) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        ids = torch.randint(0, 11, (3, 4), generator=g)
        opt.zero_grad()
        model(ids).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _sharded(plans: dict[str, Any] | None = None) -> Toy:
    """A Toy sharded block by block, then at the root, each call given ``plans[its name]``."""
    mesh = DeviceMesh("cpu", Mesh((2,), ("shard",)))
    torch.manual_seed(0)
    model = Toy()
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, plan=None if plans is None else plans[f"blocks.{i}"])
    fully_shard(model, mesh=mesh, plan=None if plans is None else plans[""])
    return model


def _given_plans() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = Mesh((2,), ("shard",))
    plain = _train(_sharded())
    meta = _meta_toy()
    by_module: dict[str, Any] = {
        # The owner is not compared (fully_shard names it once the root is sharded).
        "blocks.0": [p.with_owner("blocks.0") for p in plan_fully_shard(meta.blocks[0], mesh)],
        "blocks.1": plan_fully_shard(meta.blocks[1], mesh)[0],  # one GroupPlan alone
        "": plan_fully_shard(meta, mesh, nested=list(meta.blocks)),
    }
    torch.manual_seed(0)
    with_plan = _train(_sharded(by_module))
    assert all(torch.equal(a, b) for a, b in zip(plain, with_plan, strict=True))

    errors: dict[str, str] = {}
    (good,) = plan_fully_shard(meta.blocks[0], mesh)
    wrong = {
        "mesh": plan_fully_shard(meta.blocks[0], Mesh((2,), ("shard",), (1, 0))),
        "dtype": plan_fully_shard(
            meta.blocks[0], mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        ),
        "reordered": (replace(good, fqns=good.fqns[::-1]),),
        "groups": (good, good),
    }
    for case, plan in wrong.items():
        torch.manual_seed(0)
        model = Toy()
        before = [(p, p.detach().clone()) for p in model.parameters()]
        with pytest.raises(ValueError, match="plan") as error:
            fully_shard(model.blocks[0], mesh=DeviceMesh("cpu", mesh), plan=plan)
        errors[case] = str(error.value)
        # Raised before anything was allocated or changed.
        after = list(model.parameters())
        assert all(p is q for (p, _), q in zip(before, after, strict=True))
        assert all(torch.equal(v, p.detach()) for p, v in before)
        assert fsdp_state(model.blocks[0]) is None
        assert all(not hasattr(p, "_hp_fsdp_owner") for p in after)
        fully_shard(model.blocks[0], mesh=DeviceMesh("cpu", mesh))  # still shardable
    return errors


@pytest.mark.multiprocess
def test_meta_toy_plans_equal_what_fully_shard_records() -> None:
    run_on_ranks(2, _toy_plans_agree)


@pytest.mark.multiprocess
@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
def test_tensor_parallel_meta_plans_equal_what_fully_shard_records(
    shape: tuple[int, int],
) -> None:
    run_on_ranks(2, _tp_plans_agree, shape)


@pytest.mark.multiprocess
def test_given_plan_is_checked_before_allocation() -> None:
    for errors in run_on_ranks(2, _given_plans):
        mesh = "layouts[0].mesh.ranks (parameter 'norm.weight'): planned (0, 1), given (1, 0)"
        assert mesh in errors["mesh"]
        assert "field param_dtype: planned 'float32', given 'bfloat16'" in errors["dtype"]
        names = ("norm.weight", "norm.bias", "proj.weight", "proj.bias")
        reordered = f"field fqns: planned {names}, given {names[::-1]}"
        assert reordered in errors["reordered"]
        assert "plan= has 2 group plan(s), this call makes 1" in errors["groups"]
        assert all("fully_shard('Block')" in e for e in errors.values())

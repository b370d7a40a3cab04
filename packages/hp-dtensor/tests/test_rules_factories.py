"""Factory rules: ``*_like`` keep the input's layout (Partial -> Replicate); ``new_*`` replicate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from hp_dtensor import DeviceMesh, DTensor, distribute_tensor
from hp_dtensor.rules.registry import OpCall, ShardingDecision, ShardingRuleError, rule_for
from hp_layout import Layout, Mesh, Partial, Placement, RaggedShard, Replicate, Shard
from hp_testing import run_on_ranks

SHAPE = (5, 3)


def _source(mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    value = torch.arange(15, dtype=torch.float64).reshape(SHAPE)
    if any(isinstance(p, RaggedShard) for p in placements):
        layout = Layout(SHAPE, mesh.mesh, placements)
        rank = mesh.get_rank()
        start, stop = layout.local_region(rank).flat or (0, 0)
        local = value.flatten()[start:stop].clone()
        return DTensor.from_local(local, mesh, placements, shape=SHAPE)
    plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
    out = distribute_tensor(value, mesh, plain, src_data_rank=None)
    if plain == list(placements):
        return out
    return DTensor.from_local(out.to_local() / 2, mesh, placements, shape=SHAPE)


Check = tuple[str, Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], bool]]


def _like_checks() -> list[Check]:
    return [
        ("zeros_like", torch.zeros_like, lambda t: bool((t == 0).all())),
        ("ones_like", torch.ones_like, lambda t: bool((t == 1).all())),
        ("full_like", lambda x: torch.full_like(x, 2.5), lambda t: bool((t == 2.5).all())),
        ("empty_like", torch.empty_like, lambda t: True),
        ("rand_like", torch.rand_like, lambda t: bool(((t >= 0) & (t < 1)).all())),
        ("randn_like", torch.randn_like, lambda t: bool(torch.isfinite(t).all())),
        (
            "randint_like",
            lambda x: torch.randint_like(x, 3, 7),
            lambda t: bool(((t >= 3) & (t < 7) & (t == t.round())).all()),
        ),
        (
            "zeros_like_int",
            lambda x: torch.zeros_like(x, dtype=torch.int32),
            lambda t: t.dtype == torch.int32 and bool((t == 0).all()),
        ),
    ]


def _like_body(mesh_shape: tuple[int, ...], cases: list[tuple[Placement, ...]]) -> list[str]:
    torch.set_num_threads(1)
    names = ("a", "b")[: len(mesh_shape)]
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    problems: list[str] = []
    for placements in cases:
        x = _source(mesh, placements)
        want = x.dist_layout.with_placements(
            [Replicate() if isinstance(p, Partial) else p for p in placements],
            x.dist_layout.shard_order,
        )
        for name, factory, valid in _like_checks():
            torch.manual_seed(7)  # replicas draw identical values
            out = factory(x)
            assert isinstance(out, DTensor)
            label = f"{name} {list(placements)}"
            if out.dist_layout != want:
                problems.append(f"{label}: layout {out.dist_layout!r}, want {want!r}")
            if tuple(out.shape) != SHAPE or out.to_local().shape != x.to_local().shape:
                problems.append(f"{label}: shape {tuple(out.shape)} / local {out.to_local().shape}")
            if name != "empty_like" and not valid(out.full_tensor()):
                problems.append(f"{label}: values out of range")
        grad = torch.zeros_like(x, requires_grad=True)
        if not (grad.requires_grad and grad.is_leaf):
            problems.append(f"zeros_like(requires_grad=True) {list(placements)}: not a leaf")
    return problems


def _new_body(mesh_shape: tuple[int, ...]) -> list[str]:
    torch.set_num_threads(1)
    names = ("a", "b")[: len(mesh_shape)]
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    x = _source(mesh, [Shard(0)] * len(mesh_shape))
    expected: list[tuple[str, torch.Tensor, torch.Tensor]] = [
        ("new_zeros", x.new_zeros(4, 2), torch.zeros(4, 2, dtype=x.dtype)),
        ("new_ones", x.new_ones((3,)), torch.ones(3, dtype=x.dtype)),
        ("new_full", x.new_full([2, 3], 7.0), torch.full((2, 3), 7.0, dtype=x.dtype)),
        ("new_empty", x.new_empty(size=(2, 2)), torch.empty(2, 2, dtype=x.dtype)),
        (
            "new_tensor",
            x.new_tensor([[1, 2], [3, 4]]),
            torch.tensor([[1.0, 2], [3, 4]], dtype=x.dtype),
        ),
        ("new_zeros_dtype", x.new_zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)),
    ]
    problems = []
    for name, out, want in expected:
        assert isinstance(out, DTensor)
        if out.placements != (Replicate(),) * len(mesh_shape):
            problems.append(f"{name}: placements {out.placements}")
        if out.to_local().shape != want.shape or out.dtype != want.dtype:
            problems.append(f"{name}: local {out.to_local().shape} {out.dtype}")
        if name != "new_empty" and not torch.equal(out.to_local(), want):
            problems.append(f"{name}: values {out.to_local()}")
    return problems


@pytest.mark.multiprocess
def test_like_factories_keep_the_layout_on_a_1d_mesh() -> None:
    cases: list[tuple[Placement, ...]] = [
        (Replicate(),),
        (Shard(0),),
        (Shard(1),),
        (Partial(),),
        (RaggedShard((5, 10)),),
    ]
    for rank, problems in enumerate(run_on_ranks(2, _like_body, (2,), cases)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
    for rank, problems in enumerate(run_on_ranks(2, _new_body, (2,))):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.multiprocess
def test_like_factories_keep_the_layout_on_a_2d_mesh() -> None:
    cases: list[tuple[Placement, ...]] = [
        (Shard(0), Shard(0)),
        (Partial(), Shard(1)),
        (Replicate(), Partial()),
        (Replicate(), RaggedShard((6, 9))),
    ]
    for rank, problems in enumerate(run_on_ranks(4, _like_body, (2, 2), cases)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
    for rank, problems in enumerate(run_on_ranks(4, _new_body, (2, 2))):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


# Pure decisions --------------------------------------------------------------------------------

MESH = Mesh((2,), ("tp",))


def _decide(func: Any, *args: Any, **kwargs: Any) -> ShardingDecision:
    rule = rule_for(func)
    assert rule is not None, func
    name = getattr(func, "__name__", "op")
    return rule(OpCall(func, name, args, kwargs, rank=0))


def test_like_of_a_partial_tensor_is_replicated_without_communication() -> None:
    x = Layout((5, 3), MESH, [Partial()])
    decision = _decide(torch.ones_like, x, dtype=torch.float32)
    assert decision.inputs == (x,)  # no reduction: only the shape is read
    assert decision.outputs.placements == (Replicate(),)
    sharded = Layout((5, 3), MESH, [Shard(1)])
    assert _decide(torch.randn_like, sharded).outputs == sharded


def test_new_factories_give_a_replicated_tensor_of_the_global_size() -> None:
    x = Layout((5, 3), MESH, [Shard(0)])
    assert _decide(torch.Tensor.new_zeros, x, 4, 2).outputs.global_shape == (4, 2)
    assert _decide(torch.Tensor.new_ones, x, (3,)).outputs.global_shape == (3,)
    assert _decide(torch.Tensor.new_empty, x, size=[2]).outputs.global_shape == (2,)
    assert _decide(torch.Tensor.new_full, x, (2, 2), 1.0).outputs.global_shape == (2, 2)
    tensor = _decide(torch.Tensor.new_tensor, x, [[1, 2, 3]])
    assert tensor.outputs == Layout((1, 3), MESH, [Replicate()])
    assert _decide(torch.Tensor.new_zeros, x, ()).outputs.global_shape == ()


def test_factories_reject_a_second_dtensor() -> None:
    x = Layout((5, 3), MESH, [Shard(0)])
    with pytest.raises(ShardingRuleError, match="only the first argument may be a DTensor"):
        _decide(torch.Tensor.new_tensor, x, x)

"""DTensor construction, conversion, autograd bookkeeping, errors, and optimizer steps."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from _harness import as_dtensor
from hp_dtensor import (
    DeviceMesh,
    DTensor,
    ShardingRuleError,
    distribute_tensor,
    grad_layout,
    implicit_replication,
    init_device_mesh,
)
from hp_layout import Mesh, Partial, Placement, Replicate, Shard
from hp_testing import run_on_ranks


def _mesh2d() -> DeviceMesh:
    return DeviceMesh("cpu", Mesh((2, 2), ("dp", "tp"), (0, 2, 1, 3)))


def _construction() -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = _mesh2d()
    rank = dist.get_rank()
    full = torch.arange(35.0).reshape(5, 7)
    x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    out: dict[str, Any] = {
        "shape": tuple(x.shape),
        "size": tuple(x.size()),
        "dtype": x.dtype,
        "numel": x.numel(),
        "local_shape": tuple(x.to_local().shape),
        "full_ok": torch.equal(x.full_tensor(), full),
    }
    # from_local infers the uneven global shape with one small all-gather per sharded axis.
    y = DTensor.from_local(x.to_local().clone(), mesh, [Shard(0), Shard(1)])
    out["inferred_shape"] = tuple(y.shape)
    # Nested order: tp splits rows first, then dp splits each tp piece.
    z = distribute_tensor(full, mesh, [Shard(0), Shard(0)], shard_order=["tp", "dp"])
    out["nested_full_ok"] = torch.equal(z.full_tensor(), full)
    out["nested_local"] = z.to_local().tolist()
    r = x.redistribute(placements=[Replicate(), Shard(0)])
    out["redistributed_ok"] = torch.equal(r.to_local(), full.chunk(2, 0)[mesh.get_local_rank("tp")])
    # src_data_rank: rank 0's data wins.
    mine = torch.full((2, 2), float(rank))
    out["broadcast_value"] = (
        distribute_tensor(mine, mesh, [Replicate(), Replicate()]).to_local()[0, 0].item()
    )
    out["repr"] = repr(x)[:8]
    out["init_mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")).mesh.shape
    sub = mesh["tp"]
    out["sub_ranks"] = sub.mesh.ranks
    return out


@pytest.mark.multiprocess
def test_construction_and_queries() -> None:
    results = run_on_ranks(4, _construction)
    for out in results:
        assert out["shape"] == (5, 7) == out["size"] == out["inferred_shape"]
        assert out["numel"] == 35
        assert out["full_ok"]
        assert out["nested_full_ok"]
        assert out["redistributed_ok"]
        assert out["broadcast_value"] == 0.0
        assert out["repr"] == "DTensor("
        assert out["init_mesh"] == (2, 2)
    # Mesh (dp, tp) over ranks [[0, 2], [1, 3]]: rank 1 is (dp=1, tp=0).
    assert results[1]["local_shape"] == (2, 4)
    assert results[3]["local_shape"] == (2, 3)
    # tp first (rows 0-2 / 3-4), then dp splits each: rank 2 (dp=0, tp=1) gets row 3.
    assert results[2]["nested_local"] == [[21.0, 22.0, 23.0, 24.0, 25.0, 26.0, 27.0]]
    assert results[0]["sub_ranks"] == (0, 2)
    assert results[1]["sub_ranks"] == (1, 3)


def _autograd() -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    w_full = torch.randn(6, 4)
    x_full = torch.randn(3, 4)
    w = distribute_tensor(w_full, mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(torch.zeros(6), mesh, [Replicate()]).requires_grad_()
    out = F.linear(distribute_tensor(x_full, mesh, [Replicate()]), w, b)
    loss = out.sum()
    loss.backward()
    ref_w = w_full.clone().requires_grad_()
    ref_b = torch.zeros(6, requires_grad=True)
    F.linear(x_full, ref_w, ref_b).sum().backward()
    param = torch.nn.Parameter(w.detach())
    gx = distribute_tensor(x_full, mesh, [Replicate()]).requires_grad_()
    (grad_x,) = torch.autograd.grad((gx * 2).sum(), [gx])
    return {
        "w_grad_ok": torch.allclose(as_dtensor(w.grad).full_tensor(), ref_grad(ref_w)),
        "b_grad_layout": as_dtensor(b.grad).dist_layout.placements,
        "b_grad_ok": torch.allclose(as_dtensor(b.grad).full_tensor(), ref_grad(ref_b)),
        "leaf": w.is_leaf,
        "out_requires_grad": out.requires_grad,
        "out_has_grad_fn": out.grad_fn is not None,
        "param": isinstance(param, torch.nn.Parameter) and isinstance(param, DTensor),
        "param_requires_grad": param.requires_grad,
        "grad_x_ok": torch.allclose(as_dtensor(grad_x).full_tensor(), torch.full((3, 4), 2.0)),
        "deepcopy_ok": torch.equal(as_dtensor(copy.deepcopy(w.detach())).full_tensor(), w_full),
    }


@pytest.mark.multiprocess
def test_autograd_bookkeeping_and_grad_layouts() -> None:
    for out in run_on_ranks(2, _autograd):
        assert out["w_grad_ok"]
        assert out["b_grad_ok"]
        assert out["grad_x_ok"]
        # A replicated parameter's gradient is the per-replica contribution: Partial(sum).
        assert out["b_grad_layout"] == (Partial(),)
        assert out["leaf"]
        assert out["out_requires_grad"]
        assert out["out_has_grad_fn"]
        assert out["param"]
        assert out["param_requires_grad"]
        assert out["deepcopy_ok"]


def ref_grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _optimizer_steps(name: str) -> float:
    torch.manual_seed(0)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)).double()
    model = copy.deepcopy(ref)
    placements: dict[str, Placement] = {
        "0.weight": Shard(0),
        "0.bias": Shard(0),
        "1.weight": Shard(1),
        "1.bias": Replicate(),
    }
    for pname, param in list(model.named_parameters()):
        module_name, attr = pname.rsplit(".", 1)
        module = model.get_submodule(module_name)
        dt = distribute_tensor(param.detach(), mesh, [placements[pname]])
        setattr(module, attr, torch.nn.Parameter(dt))

    def make(params: Any) -> torch.optim.Optimizer:
        if name == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)

    opt, ref_opt = make(model.parameters()), make(ref.parameters())
    for step in range(3):
        x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        for m, o, inp in (
            (ref, ref_opt, x),
            (model, opt, distribute_tensor(x, mesh, [Replicate()])),
        ):
            o.zero_grad()
            out = m(inp)
            if isinstance(out, DTensor):
                out = out.redistribute(placements=[Replicate()])
            (out**2).mean().backward()
            o.step()
    err = 0.0
    for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        err = max(err, (as_dtensor(p).full_tensor() - q).abs().max().item())
    return err


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_torch_optimizers_step_dtensor_parameters(optimizer: str) -> None:
    for err in run_on_ranks(2, _optimizer_steps, optimizer):
        assert err < 1e-12, err


def _errors() -> list[str]:
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    x = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    messages = []
    for attempt in (
        lambda: torch.linalg.svd(x),
        lambda: x + torch.ones(4, 4),
        lambda: x.item(),
        lambda: torch.Tensor.exp_(distribute_tensor(torch.ones(2), mesh, [Partial()])),
        lambda: x.to("meta"),
        lambda: DTensor.from_local(torch.ones(3, 4), mesh, [Shard(0)], shape=(4, 4)),
    ):
        try:
            attempt()
            messages.append("no error")
        except (ShardingRuleError, TypeError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


@pytest.mark.multiprocess
def test_errors_name_the_op_and_the_layouts() -> None:
    messages = run_on_ranks(2, _errors)[0]
    assert "no sharding rule for 'linalg_svd'" in messages[0] or "svd" in messages[0]
    assert "Shard(0)" in messages[0]
    assert "make it a DTensor" in messages[1]
    assert "needs a fully replicated layout" in messages[2]
    assert "in-place exp on a Partial" in messages[3]
    assert "to('meta')" in messages[4]
    assert "does not fit" in messages[5]


def test_grad_layout_is_the_dual() -> None:
    from hp_layout import Layout

    mesh = Mesh((2, 2), ("a", "b"))
    layout = Layout((4, 4), mesh, [Replicate(), Shard(0)])
    assert grad_layout(layout).placements == (Partial(), Shard(0))
    assert grad_layout(Layout((4,), mesh, [Partial(), Replicate()])).placements == (
        Replicate(),
        Partial(),
    )
    assert grad_layout(Layout((4,), mesh, [Partial("avg"), Shard(0)])).placements == (
        Partial(),
        Shard(0),
    )


def _same_device_moves_and_implicit_replication() -> dict[str, object]:
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    whole = torch.arange(16.0).reshape(4, 4)
    x = distribute_tensor(whole, mesh, [Shard(0)])
    cast = x.to(device=x.device, dtype=torch.float64)  # as model code writes it
    with implicit_replication():
        mixed = x + torch.ones(4, 4)
    assert isinstance(cast, DTensor)
    assert isinstance(mixed, DTensor)
    return {
        "same": x.to("cpu") is x and x.to(torch.device("cpu"), non_blocking=True) is x,
        "cast": (cast.dtype, cast.placements, torch.equal(cast.full_tensor(), whole.double())),
        "mixed": (mixed.placements, torch.equal(mixed.full_tensor(), whole + 1)),
    }


@pytest.mark.multiprocess
def test_to_the_same_device_is_no_move_and_implicit_replication_wraps_plain_tensors() -> None:
    out = run_on_ranks(2, _same_device_moves_and_implicit_replication)[0]
    assert out["same"]
    assert out["cast"] == (torch.float64, (Shard(0),), True)
    assert out["mixed"] == ((Shard(0),), True)

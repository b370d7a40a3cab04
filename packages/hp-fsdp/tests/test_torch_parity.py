"""Behaviours torch FSDP2 promises (its ``test_fully_shard_init.py``, ``_state_dict.py`` and
``_training.py`` exercise them), run on torch FSDP2 and on hp-fsdp side by side.

Each case runs the same code with ``torch.distributed.fsdp.fully_shard`` and with
``hp_fsdp.fully_shard`` (both parameter layouts where they differ) and compares what happens:
the same result, or the same exception type. The table in the README lists them.

* ``reshard_after_forward`` on the root: None keeps the root's parameters after forward, an
  explicit True (or ``set_reshard_after_forward(True)``) reshards them, False keeps them.
* Meshes: a 2-d torch mesh without dimension names fails with ``AssertionError``, a 3-d one with
  ``ValueError``; the per-parameter DTensors' ``device_mesh`` is the user's mesh itself; a mesh
  made with ``DeviceMesh.from_group`` over a subgroup trains like torch FSDP2 (world 4, two
  groups of 2); under torch's threaded test process group (ranks are threads of one process)
  two ranks train without sharing groups.
* Parameters: a 0-d one is refused with ``ValueError`` (per-parameter layout), a
  ``channels_last`` one with ``NotImplementedError``; a frozen FP8 parameter beside trainable
  fp32 ones needs no ``MixedPrecisionPolicy`` (the gradients equal torch FSDP2's).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_testing import run_on_ranks

KINDS = ("torch", "flat", "per_param")


def _fully_shard(kind: str) -> Callable[..., Any]:
    """``fully_shard`` of ``kind``, taking torch's arguments."""
    if kind == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        return torch_fully_shard
    from hp_fsdp import fully_shard

    def shard(module: Any, **kwargs: Any) -> Any:
        return fully_shard(module, param_layout=kind, **kwargs)

    return shard


def _torch_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _mlp(seed: int = 0) -> nn.Sequential:
    """The same small model on every rank (from a generator of its own: the ranks of the
    threaded process group are threads sharing torch's global one)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return model


def _input() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(1 + dist.get_rank()))


# Resharding the root after forward -------------------------------------------------------------


def _root_reshard(kind: str) -> dict[str, bool]:
    """For each setting: whether a root-only module holds its sharded parameters after
    forward (resharded) or the unsharded ones."""
    torch.set_num_threads(1)
    mesh = _torch_mesh((dist.get_world_size(),), ("shard",))
    out: dict[str, bool] = {}
    for setting in (None, True, False):
        model = _mlp()
        _fully_shard(kind)(model, mesh=mesh, reshard_after_forward=setting)
        sharded = model[0].weight
        model(_input()).sum().backward()
        model(_input())
        out[str(setting)] = model[0].weight is sharded
    model = _mlp()
    _fully_shard(kind)(model, mesh=mesh)
    sharded = model[0].weight
    model(_input())  # the root's lazy initialization (which keeps its parameters)
    out["default, after the first forward"] = model[0].weight is sharded
    model.set_reshard_after_forward(True)  # type: ignore[operator]
    model.reshard()  # type: ignore[operator]
    model(_input())
    out["set_reshard_after_forward(True)"] = model[0].weight is sharded
    return out


@pytest.mark.multiprocess
def test_root_reshard_after_forward_as_torch() -> None:
    reports = {kind: run_on_ranks(2, _root_reshard, kind, timeout=60)[0] for kind in KINDS}
    assert reports["torch"] == {
        "None": False,
        "True": True,
        "False": False,
        "default, after the first forward": False,
        "set_reshard_after_forward(True)": True,
    }
    assert reports["flat"] == reports["torch"], reports
    assert reports["per_param"] == reports["torch"], reports


# Meshes and parameters refused -----------------------------------------------------------------


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as error:
        return type(error).__name__
    return "ok"


def _refusals(kind: str) -> dict[str, str]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    shard = _fully_shard(kind)
    out = {
        "unnamed 2-d mesh": _outcome(lambda: shard(_mlp(), mesh=_torch_mesh((1, world), None))),
        "3-d mesh": _outcome(
            lambda: shard(_mlp(), mesh=_torch_mesh((1, 1, world), ("a", "b", "c")))
        ),
    }
    mesh = _torch_mesh((world,), ("fsdp",))

    def scalar() -> None:
        module = nn.Linear(4, 4)
        module.register_parameter("scale", nn.Parameter(torch.tensor(2.0)))
        shard(module, mesh=mesh)

    def channels_last() -> None:
        conv = nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        shard(conv, mesh=mesh)

    out["scalar parameter"] = _outcome(scalar)
    out["channels_last parameter"] = _outcome(channels_last)
    model = _mlp()
    shard(model, mesh=mesh)
    import torch.distributed.fsdp as torch_fsdp

    import hp_fsdp

    owner: Any = torch_fsdp.fully_shard if kind == "torch" else hp_fsdp.fully_shard
    state_of = owner.state
    out["fully_shard.state"] = f"{state_of(model) is not None}, {state_of(nn.Linear(2, 2))}"
    weight: Any = model[0].weight
    if kind != "flat":  # the flat layout's parameters are 1-d pieces, not DTensors
        out["device_mesh is the user's"] = str(weight.device_mesh == mesh)
        out["mesh_dim_names"] = str(weight.device_mesh.mesh_dim_names)
    return out


@pytest.mark.multiprocess
def test_refusals_and_meshes_as_torch() -> None:
    reports = {kind: run_on_ranks(2, _refusals, kind, timeout=60)[0] for kind in KINDS}
    want = {
        "unnamed 2-d mesh": "AssertionError",
        "3-d mesh": "ValueError",
        "scalar parameter": "ValueError",
        "channels_last parameter": "NotImplementedError",
        "device_mesh is the user's": "True",
        "mesh_dim_names": "('fsdp',)",
        "fully_shard.state": "True, None",
    }
    assert reports["torch"] == want
    assert reports["per_param"] == want, reports
    flat = {
        k: v for k, v in want.items() if k not in ("device_mesh is the user's", "mesh_dim_names")
    }
    # The flat layout packs a 0-d parameter into its buffer like any other.
    assert reports["flat"] == {**flat, "scalar parameter": "ok"}, reports


# A frozen FP8 parameter beside trainable fp32 ones -----------------------------------------------


class _ScaledLinear(nn.Module):
    """A linear layer whose output is multiplied by a frozen FP8 per-channel scale."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        scale = (torch.arange(4, dtype=torch.float32) / 4 + 0.5).to(torch.float8_e4m3fn)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) * self.scale.to(torch.float32)
        return out


def _frozen_fp8(kind: str) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _ScaledLinear()
    _fully_shard(kind)(model, mesh=_torch_mesh((dist.get_world_size(),), ("shard",)))
    model(_input()).square().sum().backward()
    weight = model.linear.weight
    assert weight.grad is not None
    if kind == "flat":
        from hp_dtensor import DeviceMesh, layout_of
        from hp_dtensor.parallel.equivalence import full_value

        mesh = DeviceMesh.lookup("cpu", layout_of(weight).mesh)
        return [full_value(weight.grad, mesh, like=weight).reshape(4, 8)]
    return [weight.grad.full_tensor()]  # type: ignore[attr-defined]


@pytest.mark.multiprocess
def test_frozen_fp8_parameter_beside_fp32_as_torch() -> None:
    want = run_on_ranks(2, _frozen_fp8, "torch", timeout=60)[0][0]
    for kind in ("flat", "per_param"):
        got = run_on_ranks(2, _frozen_fp8, kind, timeout=60)[0][0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# Meshes torch makes in other ways --------------------------------------------------------------


def _train_steps(kind: str, mesh: Any) -> list[float]:
    model = _mlp()
    _fully_shard(kind)(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(_input()).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _microbatches_not_last(kind: str) -> list[torch.Tensor]:
    """Two microbatches per step, the first backward marked not last (FSDP2's pipelining
    use): the gradients after the step's last backward."""
    model = _mlp()
    _fully_shard(kind)(model[0])
    _fully_shard(kind)(model)
    x = _input()
    for index, part in enumerate(x.chunk(2)):
        model.set_is_last_backward(index == 1)  # type: ignore[operator]
        model(part).square().mean().backward()
    return [_local(p.grad) for p in model.parameters() if p.grad is not None]


def _local(t: Any) -> torch.Tensor:
    local: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return local.detach().clone()


def test_set_is_last_backward_gives_torchs_gradients() -> None:
    want = run_on_ranks(2, _microbatches_not_last, "torch", timeout=60)
    got = run_on_ranks(2, _microbatches_not_last, "per_param", timeout=60)
    for ours, theirs in zip(got, want, strict=True):
        assert len(ours) == len(theirs) == 4
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def _subgroup(kind: str) -> list[float]:
    """Train on a 1-d mesh made from a subgroup (ranks {0, 1} and {2, 3})."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    torch.set_num_threads(1)
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = TorchDeviceMesh.from_group(groups[rank // 2], "cpu", mesh_dim_names=("shard",))
    return _train_steps(kind, mesh)


@pytest.mark.multiprocess
def test_mesh_from_a_subgroup_as_torch() -> None:
    want = run_on_ranks(4, _subgroup, "torch", timeout=60)
    for kind in ("flat", "per_param"):
        assert run_on_ranks(4, _subgroup, kind, timeout=60) == want


def _threaded(kind: str, world: int = 2) -> list[Any]:
    """``_train_steps`` on every rank of torch's threaded process group (one thread a rank)."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    # What torch's own threaded tests (spawn_threads_and_init_comms) set up.
    isolation: Any = torch._C._distributed_c10d
    isolation._set_thread_isolation_mode(True)
    world_data = _install_threaded_pg()
    store = dist.HashStore()  # type: ignore[attr-defined]
    results: list[Any] = [None] * world

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            mesh = _torch_mesh((world,), ("shard",))
            results[rank] = _train_steps(kind, mesh)
        except BaseException as error:  # reported to the test below
            results[rank] = error
            ProcessLocalGroup.exception_handle(error)
        finally:
            if world_data is dist.distributed_c10d._world:
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        _uninstall_threaded_pg()
        isolation._set_thread_isolation_mode(False)
    assert not any(thread.is_alive() for thread in threads), f"{kind}: a rank thread hangs"
    return results


def test_threaded_process_group_as_torch() -> None:
    torch.set_num_threads(1)
    want = _threaded("torch")
    assert all(isinstance(r, list) for r in want), want
    for kind in ("flat", "per_param"):
        got = _threaded(kind)
        assert got == want, (kind, got)

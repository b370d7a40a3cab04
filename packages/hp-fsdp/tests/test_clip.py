"""clip_grad_norm_ over sharded gradients equals torch.nn.utils.clip_grad_norm_ on the
single-device model: 1-d FSDP (world 2), HSDP 2x2 and FSDP x TP on a (dp, tp) mesh (world 4),
norm types 2, 1 and inf, with and without clipping."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh, layout_of, redistribute_local
from hp_dtensor.parallel import ParallelStyle, parallelize_module, transformer_tp_plan
from hp_fsdp import fully_shard
from hp_fsdp.clip import clip_grad_norm_
from hp_fsdp.state_dict import fsdp_params
from hp_layout import Layout, Mesh, Replicate
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

NORM_TYPES = (2.0, 1.0, math.inf)
MAX_NORMS = (0.05, 1e3)  # clipping, and a bound above every norm (coefficient 1)
LLAMA = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    # Uneven sizes over 2 and 4 shards: 3x7, 7, 7x5, 5, 5x2, 2.
    return nn.Sequential(
        nn.Linear(3, 7),
        nn.Tanh(),
        nn.Sequential(nn.Linear(7, 5), nn.Tanh()),
        nn.Linear(5, 2),
    )


def _tp_plan() -> dict[str, ParallelStyle]:
    return transformer_tp_plan()


def _setup(kind: str) -> tuple[nn.Module, nn.Module, int, int]:
    """(reference, sharded model, data-parallel index, data-parallel size)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "fsdp_tp":
        torch.manual_seed(0)
        reference: nn.Module = Llama(LLAMA)
        torch.manual_seed(0)
        llama = Llama(LLAMA)
        mesh = DeviceMesh("cpu", Mesh((2, 2), ("dp", "tp")))
        parallelize_module(llama, mesh, _tp_plan(), mode="production", tp_axis="tp")
        for block in llama.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(llama, mesh=mesh["dp"])
        return reference, llama, mesh.get_local_rank("dp"), 2
    shape, names = ((world,), ("shard",)) if kind == "fsdp" else ((2, 2), ("replicate", "shard"))
    mesh = DeviceMesh("cpu", Mesh(shape, names))
    reference, model = _net(), _net()
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return reference, model, rank, world


def _backward(model: nn.Module, kind: str, dp: int, dp_size: int) -> None:
    """Gradients of the loss on the global batch (the rank's data-parallel part of it)."""
    model.zero_grad()
    g = torch.Generator().manual_seed(5)
    if kind == "fsdp_tp":
        ids = torch.randint(0, LLAMA.vocab_size, (4, 6), generator=g)
        targets = torch.randint(0, LLAMA.vocab_size, (4, 6), generator=g)
        ids, targets = ids.chunk(dp_size)[dp], targets.chunk(dp_size)[dp]
        logits = model(ids)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        return
    x = torch.randn(8, 3, generator=g).chunk(dp_size)[dp]
    model(x).pow(2).mean().backward()


def _whole(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The whole gradient of the sharded parameter ``p`` (collective)."""
    layout = layout_of(p)
    replicated = Layout(layout.global_shape, layout.mesh, [Replicate()] * layout.mesh.ndim)
    mesh = DeviceMesh.lookup("cpu", layout.mesh)
    return redistribute_local(grad, layout, replicated, mesh)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.abs().max().item(), 1e-30)
    return (got - want).abs().max().item() / scale


def _clip_case(kind: str) -> dict[str, Any]:
    """Per norm type and bound: the relative errors of the norm and of the clipped gradients
    against torch on the single-device model, and the spread of the norm over ranks."""
    torch.set_num_threads(1)
    reference, model, dp, dp_size = _setup(kind)
    managed = fsdp_params(model)
    out: dict[str, Any] = {"norm_error": 0.0, "grad_error": 0.0, "rank_spread": 0.0}
    for norm_type in NORM_TYPES:
        for max_norm in MAX_NORMS:
            _backward(reference, kind, 0, 1)
            _backward(model, kind, dp, dp_size)
            want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
            # A module, or the parameters as a list.
            target = model if max_norm < 1 else list(model.parameters())
            got = clip_grad_norm_(target, max_norm, norm_type)
            norms = [torch.zeros(()) for _ in range(dist.get_world_size())]
            dist.all_gather(norms, got.detach().reshape(()))
            spread = max(n.item() for n in norms) - min(n.item() for n in norms)
            out["rank_spread"] = max(out["rank_spread"], spread)
            out["norm_error"] = max(out["norm_error"], abs(got.item() / want.item() - 1))
            for fqn, fp in managed.items():
                assert fp.sharded.grad is not None, fqn
                whole = _whole(fp.sharded, fp.sharded.grad).reshape(fp.layout.global_shape)
                ref_grad = reference.get_parameter(fqn).grad
                assert ref_grad is not None, fqn
                out["grad_error"] = max(out["grad_error"], _relative(whole, ref_grad))
    return out


def _nonfinite() -> list[str]:
    """A nan in one rank's piece makes the norm nan on every rank."""
    torch.set_num_threads(1)
    _, model, dp, dp_size = _setup("fsdp")
    _backward(model, "fsdp", dp, dp_size)
    if dist.get_rank() == 0:
        grad = next(iter(fsdp_params(model).values())).sharded.grad
        assert grad is not None
        grad[0] = float("nan")
    assert clip_grad_norm_(model, 1.0).isnan()
    try:
        clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
    except RuntimeError as error:
        return [str(error)]
    return []


@pytest.mark.multiprocess
def test_clip_1d_fsdp_world_2() -> None:
    for result in run_on_ranks(2, _clip_case, "fsdp", timeout=120):
        # fp32: norms and clipped gradients equal torch's to rounding.
        assert result["norm_error"] < 1e-6, result
        assert result["grad_error"] < 1e-6, result
        assert result["rank_spread"] == 0.0, result
    for messages in run_on_ranks(2, _nonfinite, timeout=120):
        assert messages, "error_if_nonfinite did not raise"
        assert "non-finite" in messages[0]


def _world_4_cases() -> dict[str, dict[str, Any]]:
    return {kind: _clip_case(kind) for kind in ("hsdp", "fsdp_tp")}


@pytest.mark.multiprocess
def test_clip_hsdp_and_fsdp_tp_world_4() -> None:
    for results in run_on_ranks(4, _world_4_cases, timeout=180):
        for kind, result in results.items():
            assert result["norm_error"] < 1e-6, (kind, result)
            assert result["grad_error"] < 1e-5, (kind, result)
            assert result["rank_spread"] == 0.0, (kind, result)

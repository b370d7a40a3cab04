"""``fully_shard(..., param_layout="per_param")``: parameters as torch ``DTensor``s of their global
shape (``Shard(0)``), as FSDP2 hands them out, side by side with torch FSDP2 on the same model.

The local rows are views of hp-fsdp's flat chunk; the layout equals FSDP2's, so the all-gather
and reduce-scatter move the same elements in the same order. Asserted at world 2 and 4 (1-d)
and HSDP (2, 2), bit for bit against FSDP2 (losses at every step, every parameter after
training), with three optimizers: AdamW, ``torch.optim.Muon`` (on the 2-d weights; AdamW on
the rest) and a shape-aware optimizer of this test's own (each matrix row's update normalized
by that row's gradient norm: it reads ``grad.shape`` and reduces over dim 1). torch's
``Adafactor`` is not used: it fails on FSDP2's own DTensor parameters (an in-place ``pow_`` of
a partial norm that torch DTensor cannot propagate). Also: ``param.shape`` is global,
``placements`` and ``full_tensor()`` are torch's, the state dict holds the parameters
themselves, and the meta-device flow of FSDP2 codebases (build on meta, shard, ``to_empty``,
``reset_parameters`` on the DTensors) gives FSDP2's values.

Over more than two shard ranks hp-fsdp runs gloo's own reduce-scatter here
(:func:`native_reduce_scatter`), the collective FSDP2 uses: its default on gloo, an all-to-all
summed in rank order, adds in another order than gloo's ring, which bit equality would see
(that sum is checked bit for bit against its own oracle in ``test_gradient_path.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)
STEPS = 4


def _mesh(kind: str, hsdp: bool) -> Any:
    world = dist.get_world_size()
    shape, names = ((2, 2), ("replicate", "shard")) if hsdp else ((world,), ("shard",))
    if kind == "hp":
        from hp_dtensor import DeviceMesh
        from hp_layout import Mesh

        return DeviceMesh("cpu", Mesh(shape, names))
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _shard(model: Llama, kind: str, hsdp: bool) -> None:
    mesh = _mesh(kind, hsdp)
    if kind == "hp":
        from hp_fsdp import fully_shard

        def shard(m: nn.Module) -> None:
            fully_shard(m, mesh=mesh, param_layout="per_param")

    else:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        def shard(m: nn.Module) -> None:
            torch_fully_shard(m, mesh=mesh)

    for block in model.layers:
        shard(block)
    shard(model)


class RowNormalizedSGD(torch.optim.Optimizer):
    """SGD whose step for a matrix divides each row's gradient by that row's norm (shape-aware:
    it needs the global shape, and the rows whole on one rank)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        del closure
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.ndim == 2:
                    grad = grad / (grad.norm(dim=1, keepdim=True) + 1e-8)
                p.add_(grad, alpha=-group["lr"])


def _optimizers(model: nn.Module, name: str) -> list[torch.optim.Optimizer]:
    params = list(model.parameters())
    if name == "adamw":
        return [torch.optim.AdamW(params, lr=1e-2)]
    if name == "row_normalized":
        return [RowNormalizedSGD(params, lr=1e-2)]
    matrices = [p for p in params if p.ndim == 2]
    rest = [p for p in params if p.ndim != 2]
    return [torch.optim.Muon(matrices, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)]


@contextlib.contextmanager
def native_reduce_scatter(kind: str, shard_ranks: int) -> Iterator[None]:
    """hp-fsdp's reduce-scatters in this block run as gloo's own when ``kind`` is ``"hp"`` and
    the shard axis has more than two ranks: the same order of additions as torch FSDP2's, for
    tests that compare the two bit for bit or within rounding of that order."""
    if kind != "hp" or shard_ranks <= 2:
        yield
        return
    from hp_fsdp._collectives import ReduceScatterPrimitive, reduce_scatter_by

    with reduce_scatter_by(ReduceScatterPrimitive.NATIVE):
        yield


def _train(kind: str, hsdp: bool, optimizer_name: str, on_meta: bool = False) -> dict[str, Any]:
    with native_reduce_scatter(kind, 2 if hsdp else dist.get_world_size()):
        return _trained(kind, hsdp, optimizer_name, on_meta)


def _trained(kind: str, hsdp: bool, optimizer_name: str, on_meta: bool) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if on_meta:
        with torch.device("meta"):
            model = Llama(CONFIG)
    else:
        model = Llama(CONFIG)
    _shard(model, kind, hsdp)
    if on_meta:
        model.to_empty(device="cpu")
        torch.manual_seed(1)
        with torch.no_grad():
            for module in model.modules():
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()
    weight: Any = cast(Any, model.layers[0]).attn.q_proj.weight
    out: dict[str, Any] = {
        "dtensor": isinstance(weight, DTensor),
        "global_shape": tuple(weight.shape) == (CONFIG.dim, CONFIG.dim),
        "placement": isinstance(weight, DTensor) and isinstance(weight.placements[-1], Shard),
        "full": weight.full_tensor().clone() if isinstance(weight, DTensor) else None,
    }
    optimizers = _optimizers(model, optimizer_name)
    g = torch.Generator().manual_seed(17)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, CONFIG.vocab_size, (2 * world, 8), generator=g).chunk(world)[rank]
        for opt in optimizers:
            opt.zero_grad()
        logits = model(ids)
        targets = ids.roll(1, 1).reshape(-1)
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), targets)
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    out["losses"] = losses
    out["params"] = [cast(Any, p).full_tensor().detach() for p in model.parameters()]
    named: dict[str, Any] = dict(model.named_parameters())
    out["state_dict_aliases"] = all(
        isinstance(v, DTensor) and v.to_local().data_ptr() == named[k].to_local().data_ptr()
        for k, v in model.state_dict().items()
        if k in named
    )
    return out


CASES = [(2, False, "adamw"), (4, False, "adamw"), (4, True, "adamw"), (2, False, "muon")]
CASES += [(4, False, "row_normalized")]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "hsdp", "optimizer"), CASES)
def test_per_param_layout_equals_torch_fsdp(world: int, hsdp: bool, optimizer: str) -> None:
    ours = run_on_ranks(world, _train, "hp", hsdp, optimizer, timeout=300)
    theirs = run_on_ranks(world, _train, "torch", hsdp, optimizer, timeout=300)
    for a, b in zip(ours, theirs, strict=True):
        assert a["dtensor"]
        assert a["global_shape"]
        assert a["placement"]
        assert torch.equal(a["full"], b["full"])
        assert a["state_dict_aliases"]
        assert a["losses"] == b["losses"]
        for x, y in zip(a["params"], b["params"], strict=True):
            assert torch.equal(x, y)


@pytest.mark.multiprocess
def test_meta_to_empty_reset_parameters_like_torch_fsdp() -> None:
    ours = run_on_ranks(2, _train, "hp", False, "adamw", True, timeout=300)
    theirs = run_on_ranks(2, _train, "torch", False, "adamw", True, timeout=300)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a["full"], b["full"])
        assert a["losses"] == b["losses"]

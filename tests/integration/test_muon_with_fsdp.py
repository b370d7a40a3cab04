"""hp-muon with hp-fsdp and with torch FSDP2: Llama training against one device.

The packages are siblings in the DAG (neither imports the other), so their combination is
tested here, with both installed (``nox -s integration``). The same Llama (same seed) trains
with ``muon_with_adamw`` (Muon on the block matrices, AdamW on embeddings, norms and the head)
on the same global batches:

* one device: ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the whole batch;
* ``hp_fsdp.fully_shard`` (world 2, and HSDP 2 x 2 on world 4) + ``hp_muon``;
* ``torch.distributed.fsdp.fully_shard`` (same meshes) + ``hp_muon``.

Measured (torch 2.13 CPU, gloo): hp-fsdp and torch FSDP2 give bit-identical losses and
parameters (both reduce the same per-rank gradients in the same order, and hp-muon's update is
bit-equal to torch.optim.Muon on equal gradients). Against one device, the averaged gradients
differ from the whole-batch gradients by fp32 rounding, which bf16 Newton-Schulz can round to a
different bf16 value: the bounds below allow one bf16 rounding step of the update per step.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor as TorchDTensor

from hp_muon import muon_with_adamw, split_params
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)
STEPS, GLOBAL_BATCH, SEQ, DATASET = 8, 8, 16, 4
MUON_LR = 0.02
MUON: dict[str, Any] = {"lr": MUON_LR, "weight_decay": 0.01, "adjust_lr_fn": "match_rms_adamw"}
ADAMW: dict[str, Any] = {"lr": 3e-3, "weight_decay": 0.01}
# Largest adjusted Muon lr (match_rms_adamw: 0.2 * lr * sqrt(max dim) = 64): an update entry
# differing by one bf16 ulp (2**-7 relative, |O| < 2 so 2**-6 absolute) moves a parameter by
# 2**-6 * lr_adj; over STEPS steps, and the divergence feeding back into the gradients.
PARAM_BOUND = STEPS * 2**-6 * 0.2 * MUON_LR * math.sqrt(64)
LOSS_BOUND = 1e-3


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step % DATASET)
    ids = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
    targets = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, SEQ), generator=g)
    return ids, targets


def _loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _train(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int
) -> list[float]:
    losses = []
    for step in range(STEPS):
        ids, targets = (t.chunk(world)[rank] for t in _global_batch(step))
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model, ids, targets)
        loss.backward()
        optimizer.step()
        reduced = loss.detach().clone()
        if world > 1:
            dist.all_reduce(reduced)
        losses.append(reduced.item() / world)
    return losses


def _single_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    split = split_params(model)
    muon = torch.optim.Muon(split.muon_params, **MUON)
    adamw = torch.optim.AdamW(split.adamw_params, **ADAMW)

    class _Both(torch.optim.Optimizer):
        def __init__(self) -> None:
            super().__init__([*muon.param_groups, *adamw.param_groups], {})

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            muon.step()
            adamw.step()

    losses = _train(model, _Both(), 0, 1)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded_model(kind: str, mesh_shape: tuple[int, ...]) -> nn.Module:
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    torch.manual_seed(0)
    model = Llama(CONFIG)
    if kind == "hp_fsdp":
        from hp_dtensor import DeviceMesh
        from hp_fsdp import fully_shard
        from hp_layout import Mesh

        mesh: Any = DeviceMesh("cpu", Mesh(mesh_shape, names))
        shard: Any = fully_shard
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        shard = torch_fully_shard
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _distributed(kind: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _sharded_model(kind, mesh_shape)
    # Every parameter is sharded by FSDP: its layout names its replicas (HSDP), so Muon needs
    # no replicate_group.
    optimizer = muon_with_adamw(model, muon=MUON, adamw=ADAMW)
    losses = _train(model, optimizer, rank, world)
    full = {}
    for name, value in model.state_dict().items():
        full[name] = value.full_tensor() if isinstance(value, TorchDTensor) else value.clone()
    muon = optimizer.optimizers[0]
    stats = getattr(muon, "last_step_stats", None)
    assert stats is not None
    return {
        "losses": losses,
        "params": full,
        "orthogonalized": stats.orthogonalized,
        "matrices": stats.matrices,
    }


@pytest.fixture(scope="module")
def single_device() -> tuple[list[float], dict[str, torch.Tensor]]:
    return _single_device()


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["fsdp_w2", "hsdp_2x2"])
def test_muon_adamw_under_hp_fsdp_and_torch_fsdp2(
    mesh_shape: tuple[int, ...], single_device: tuple[list[float], dict[str, torch.Tensor]]
) -> None:
    world = math.prod(mesh_shape)
    ref_losses, ref_params = single_device
    per_rank = {
        kind: run_on_ranks(world, _distributed, kind, mesh_shape, timeout=300)
        for kind in ("hp_fsdp", "torch_fsdp2")
    }
    hp, torch_fsdp = per_rank["hp_fsdp"][0], per_rank["torch_fsdp2"][0]
    # The two sharders feed hp-muon the same gradients: the same training, bit for bit.
    assert hp["losses"] == torch_fsdp["losses"]
    for name in ref_params:
        assert torch.equal(hp["params"][name], torch_fsdp["params"][name]), name
    # Against one device: within the rounding bound.
    loss_diff = max(abs(a - b) for a, b in zip(hp["losses"], ref_losses, strict=True))
    param_diff = max((hp["params"][n] - ref_params[n]).abs().max().item() for n in ref_params)
    print(
        f"{mesh_shape}: losses {hp['losses'][0]:.4f} -> {hp['losses'][-1]:.4f}; "
        f"max |loss - one device| = {loss_diff:.3g} (bound {LOSS_BOUND}); "
        f"max |param - one device| = {param_diff:.3g} (bound {PARAM_BOUND:.3g})"
    )
    assert hp["losses"][-1] < hp["losses"][0]
    assert loss_diff <= LOSS_BOUND
    assert param_diff <= PARAM_BOUND
    # Every block matrix is orthogonalized once in the whole job, not once per rank.
    for kind, results in per_rank.items():
        assert all(r["matrices"] == CONFIG.n_layers * 7 for r in results), kind
        assert sum(r["orthogonalized"] for r in results) == CONFIG.n_layers * 7, kind

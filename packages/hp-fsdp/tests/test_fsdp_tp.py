"""FSDP over tensor parallelism on a 2x2 (dp, tp) mesh, and a Llama-style model under 1-d FSDP
and HSDP: equal to a single-device run (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh, DTensor
from hp_dtensor.parallel import ParallelStyle, parallelize_module, transformer_tp_plan
from hp_dtensor.parallel.equivalence import full_value
from hp_dtensor.parallel.validation import check_gradients
from hp_fsdp import fully_shard
from hp_layout import Mesh, Replicate, Shard
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)


def _tp_plan() -> dict[str, ParallelStyle]:
    return transformer_tp_plan()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _shard_blocks(model: Llama, mesh: DeviceMesh) -> None:
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _train(kind: str, mode: str) -> float:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = Llama(CONFIG)
    torch.manual_seed(0)
    model = Llama(CONFIG)
    if kind == "fsdp_tp":
        mesh = DeviceMesh("cpu", Mesh((2, 2), ("dp", "tp")))
        parallelize_module(model, mesh, _tp_plan(), mode=mode, tp_axis="tp")  # type: ignore[arg-type]
        dp_mesh = mesh["dp"]
        dp, dp_size = mesh.get_local_rank("dp"), 2
        _shard_blocks(model, dp_mesh)
        if mode == "validation":
            model.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    else:
        shape = (world,) if kind == "fsdp" else (2, 2)
        names = ("shard",) if kind == "fsdp" else ("replicate", "shard")
        mesh = DeviceMesh("cpu", Mesh(shape, names))
        dp, dp_size = rank, world
        _shard_blocks(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, CONFIG.vocab_size, (4, 6), generator=g)
        targets = torch.randint(0, CONFIG.vocab_size, (4, 6), generator=g)
        ref_opt.zero_grad()
        _loss(reference(ids), targets).backward()
        ref_opt.step()
        opt.zero_grad()
        local_ids, local_targets = ids.chunk(dp_size)[dp], targets.chunk(dp_size)[dp]
        out = model(local_ids)
        if isinstance(out, DTensor):
            # Validation mode: the loss is the global mean over the dp-sharded batch, so the
            # gradients are summed over dp rather than averaged.
            tgt = DTensor.from_local(local_targets, out.device_mesh, [Shard(0), Replicate()])
            loss = _loss(out, tgt)
        else:
            loss = _loss(out, local_targets)
        loss.backward()
        if mode == "validation":
            check_gradients(model)
        opt.step()
    error = 0.0
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        value = full_value(p, mesh).reshape(q.shape)
        error = max(error, ((value - q).abs().max() / q.abs().max()).item())
        del name
    return error


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("kind", "mode", "world"),
    [
        ("fsdp", "production", 2),
        ("hsdp", "production", 4),
        ("fsdp_tp", "production", 4),
        ("fsdp_tp", "validation", 4),
    ],
)
def test_llama_under_fsdp_matches_single_device(kind: str, mode: str, world: int) -> None:
    for error in run_on_ranks(world, _train, kind, mode, timeout=300):
        # fp32 after 3 AdamW steps (Adam divides by the gradient's root mean square, which
        # magnifies rounding differences of tiny gradients): 1e-4 of each tensor's largest entry.
        assert error < 1e-4, error


def _unused(model: nn.Module) -> None:
    del model

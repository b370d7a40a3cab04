"""One fully_shard group holding parameters of several storage dtypes under a
``MixedPrecisionPolicy``: bf16 linear and embedding weights beside fp32 norms, one flat buffer
per storage dtype.

torch FSDP2 refuses this model ("FSDP expects uniform original parameter dtype"); the
workaround it leaves is one fully_shard call per dtype (each norm sharded on its own). Both
compute in bf16 and reduce gradients in fp32, then keep each gradient in its parameter's
dtype. Asserted at world 2 and 4 (AdamW, 5 steps): the losses and every parameter after
training equal that workaround's bit for bit (the same per-element reductions), each block
has one buffer per storage dtype, and each gradient has its parameter's dtype; and torch FSDP2
still refuses the model (if it learns to shard it, this test should compare with it).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig, RMSNorm

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)
STEPS = 5


def _mixed_model() -> Llama:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            module.to(torch.bfloat16)
    return model


def _train(kind: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    from hp_dtensor import DeviceMesh
    from hp_fsdp import MixedPrecisionPolicy, fully_shard
    from hp_layout import Mesh

    model = _mixed_model()
    mesh = DeviceMesh("cpu", Mesh((world,), ("shard",)))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        if kind == "per_dtype_calls":
            for norm in (block.attn_norm, block.ffn_norm):
                fully_shard(norm, mesh=mesh, mp_policy=policy)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    if kind == "per_dtype_calls":
        fully_shard(model.norm, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(11)
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, CONFIG.vocab_size, (2 * world, 8), generator=g).chunk(world)[rank]
        optimizer.zero_grad()
        logits = model(ids)
        loss = F.cross_entropy(
            logits.float().reshape(-1, CONFIG.vocab_size), ids.roll(1, 1).reshape(-1)
        )
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    out: dict[str, Any] = {"losses": losses, "params": _flat_pieces(model)}
    out["grad_dtypes_match"] = all(
        p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters()
    )
    block_state: Any = cast(Any, model.layers[0])._hp_fsdp_state
    out["block_buffers"] = sorted(str(g.sharded_flat.dtype) for g in block_state.groups)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    out["norm_dtype"] = str(norms[0].weight.dtype)
    return out


def _flat_pieces(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter gathered whole, by name."""
    from hp_dtensor import DeviceMesh
    from hp_dtensor.parallel.equivalence import full_value
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("shard",)))
    return [full_value(p, mesh).reshape(-1) for _, p in sorted(model.named_parameters())]


def _torch_refuses() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = _mixed_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch_fully_shard(model, mesh=mesh, mp_policy=TorchPolicy(param_dtype=torch.bfloat16))
    try:
        model(torch.zeros(1, 4, dtype=torch.long))
    except AssertionError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_mixed_storage_dtypes_in_one_group(world: int) -> None:
    ours = run_on_ranks(world, _train, "hp", timeout=300)
    separate = run_on_ranks(world, _train, "per_dtype_calls", timeout=300)
    for a, b in zip(ours, separate, strict=True):
        assert a["block_buffers"] == ["torch.bfloat16", "torch.float32"]
        assert b["block_buffers"] == ["torch.bfloat16"]
        assert a["norm_dtype"] == "torch.float32"
        assert a["grad_dtypes_match"]
        assert b["grad_dtypes_match"]
        assert a["losses"] == b["losses"]
        for x, y in zip(a["params"], b["params"], strict=True):
            assert x.dtype == y.dtype
            assert torch.equal(x, y)
    if world == 2:
        assert "uniform original parameter dtype" in run_on_ranks(2, _torch_refuses)[0]

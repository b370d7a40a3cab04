"""hp-fsdp side by side with torch FSDP2 (``torch.distributed.fsdp.fully_shard``).

The same ``hp_testing.llama.Llama`` (same seed; blocks sharded, then the root) trains with
AdamW on the same batches under both, on world 2 (1-d mesh) and on world 4 as HSDP (2, 2)
(torch: ``init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))``). Each rank
feeds its own slice of every global batch; the loss of every rank is compared step by step.

* fp32, 100 steps: the loss curves agree to rounding (Pearson correlation and the largest
  absolute difference are printed and bounded; measured: identical).
* bf16 mixed precision (``param_dtype=bfloat16``, ``reduce_dtype=float32`` for both), 20 steps:
  the losses stay close (measured: identical; the bound allows bf16 rounding differences).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)
FP32_STEPS, BF16_STEPS = 100, 20
LOCAL_BATCH, SEQ, DATASET = 2, 16, 4  # batches cycled, so that the loss goes down
LR = 1e-2

# Measured (torch 2.13 CPU, gloo, worlds 2 and 4): max |hp - torch| = 0.0 in fp32 over 100
# steps and in bf16 over 20 steps -- bitwise identical curves: both reduce-scatter (and, for
# HSDP, all-reduce across replicas) the same per-rank gradients in the same order, and scaling
# by 1/2 or 1/4 is exact. The bounds leave room for a different summation order or scaling
# (one fp32 rounding per step, amplified by AdamW's normalization; in bf16 a flipped last bit
# of an unsharded parameter moves the loss by ~1e-3).
FP32_MAX_ABS = 1e-5
FP32_MIN_PEARSON = 0.9999
BF16_MAX_ABS = 1e-2


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of global batch ``step % DATASET``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1000 + step % DATASET)
    ids = torch.randint(0, CONFIG.vocab_size, (LOCAL_BATCH * world, SEQ), generator=g)
    targets = torch.randint(0, CONFIG.vocab_size, (LOCAL_BATCH * world, SEQ), generator=g)
    return ids.chunk(world)[rank], targets.chunk(world)[rank]


def _hp_model(mesh_shape: tuple[int, ...], bf16: bool) -> nn.Module:
    from hp_dtensor import DeviceMesh
    from hp_fsdp import MixedPrecisionPolicy, fully_shard
    from hp_layout import Mesh

    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _torch_model(mesh_shape: tuple[int, ...], bf16: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
    )
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _losses(model: nn.Module, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        ids, targets = _batches(step)
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train(mesh_shape: tuple[int, ...]) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    out = {}
    for label, bf16, steps in (("fp32", False, FP32_STEPS), ("bf16", True, BF16_STEPS)):
        out[f"hp_{label}"] = _losses(_hp_model(mesh_shape, bf16), steps)
        out[f"torch_{label}"] = _losses(_torch_model(mesh_shape, bf16), steps)
    return out


def _pearson(a: list[float], b: list[float]) -> float:
    mean_a, mean_b = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b, strict=True))
    var_a = sum((x - mean_a) ** 2 for x in a)
    var_b = sum((y - mean_b) ** 2 for y in b)
    return cov / math.sqrt(var_a * var_b)


def _max_abs(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@functools.cache
def _results(world: int, mesh_shape: tuple[int, ...]) -> list[dict[str, list[float]]]:
    return run_on_ranks(world, _train, mesh_shape, timeout=120.0)


CASES = [(2, (2,)), (4, (2, 2))]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "mesh_shape"), CASES)
def test_fp32_loss_curves_match_torch_fsdp2(world: int, mesh_shape: tuple[int, ...]) -> None:
    for rank, result in enumerate(_results(world, mesh_shape)):
        ours, theirs = result["hp_fp32"], result["torch_fp32"]
        pearson, worst = _pearson(ours, theirs), _max_abs(ours, theirs)
        print(
            f"mesh {mesh_shape} rank {rank} fp32 {FP32_STEPS} steps: loss {ours[0]:.4f} -> "
            f"{ours[-1]:.4f}, pearson {pearson:.9f}, max |hp - torch| {worst:.2e}"
        )
        assert ours[-1] < 0.5 * ours[0], "the model did not train; the comparison means nothing"
        assert pearson > FP32_MIN_PEARSON, (pearson, ours, theirs)
        assert worst < FP32_MAX_ABS, (worst, ours, theirs)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "mesh_shape"), CASES)
def test_bf16_mixed_precision_losses_close_to_torch_fsdp2(
    world: int, mesh_shape: tuple[int, ...]
) -> None:
    for rank, result in enumerate(_results(world, mesh_shape)):
        ours, theirs = result["hp_bf16"], result["torch_bf16"]
        worst = _max_abs(ours, theirs)
        print(
            f"mesh {mesh_shape} rank {rank} bf16 {BF16_STEPS} steps: loss {ours[0]:.4f} -> "
            f"{ours[-1]:.4f}, max |hp - torch| {worst:.2e}"
        )
        assert worst < BF16_MAX_ABS, (worst, ours, theirs)


def test_pearson() -> None:
    assert _pearson([1.0, 2.0, 3.0], [2.0, 4.0, 6.5]) > 0.99
    assert _pearson([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)

"""Distributed Muon against single-device ``torch.optim.Muon``, for every sharder.

Each rank builds the same full parameters and, every step, the same full gradients; the
reference is ``torch.optim.Muon`` on whole matrices (a 3-D parameter is one torch parameter per
matrix), the candidate is ``hp_muon.Muon`` on the sharder's parameters with the sharder's
gradients. Shapes include uneven and empty shards (18 rows and 3 rows over 4 ranks), tall and
wide matrices of transposed shapes (fused on the owner) and an expert stack ``[3, 6, 4]``.

Tolerance: the update of each matrix is its owner's bf16 Newton-Schulz of exactly the same bf16
input as torch's (momentum is elementwise on the local shards and the pieces travel in bf16),
so the results are bit-equal whenever the owner's batched run equals torch's per-matrix run.
``fuse_shapes=False`` guarantees that: compared with ``torch.equal``. With fusion (the default)
the bound is one bf16 rounding of the orthogonalized update times the adjusted lr per step
(``2**-7 * lr_adj``); a batch mixing a matrix with its transposed shape computes the tall one
in the wide orientation, where torch uses a transposed view, so it may round differently.
Also checked per step: each matrix is orthogonalized by exactly one rank (DDP and all sharders;
plain parameters without a replicate group are orthogonalized by every rank, as torch would),
and the elements sent, summed over ranks, are at most twice the elements held.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from _sharders import matrices_in, sharders
from hp_muon import Muon
from hp_testing import run_on_ranks

SHAPES: tuple[tuple[int, ...], ...] = (
    (18, 8),  # 5, 5, 5, 3 rows over 4 ranks
    (3, 8),  # 1, 1, 1, 0 rows over 4 ranks: one empty shard
    (8, 18),
    (12, 20),
    (20, 12),  # transposed shape of the one above: fused with it
    (12, 20),
    (3, 6, 4),  # an expert stack: 3 matrices
    (2, 3),
)
STEPS = 3
LR = 0.02
# Fused runs: one bf16 rounding (2**-7 relative for |O| < 2) of the orthogonalized update per
# step, times the adjusted lr, accumulated over the steps (weight decay keeps it).
BOUND = STEPS * 2**-7


def _reference_params(fulls: list[torch.Tensor]) -> list[list[torch.nn.Parameter]]:
    return [[torch.nn.Parameter(m.clone()) for m in f.reshape(-1, *f.shape[-2:])] for f in fulls]


def _case(name: str, fuse: bool, adjust_lr_fn: str | None) -> dict[str, float]:
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    sharder = next(s for s in sharders(world) if s.name == name)
    fulls = [torch.randn(s) for s in SHAPES]
    reference = _reference_params(fulls)
    kwargs = {"lr": LR, "weight_decay": 0.1, "adjust_lr_fn": adjust_lr_fn}
    ref_opt = torch.optim.Muon([p for ps in reference for p in ps], **kwargs)  # type: ignore[arg-type]
    params = sharder.make(fulls)
    opt = Muon(params, fuse_shapes=fuse, **kwargs, ns_dtype=torch.bfloat16, **sharder.muon_kwargs())  # type: ignore[arg-type]
    worst = 0.0
    sent = orthogonalized = 0
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        grads = [torch.randn(s, generator=g) for s in SHAPES]
        for ps, full in zip(reference, grads, strict=True):
            for p, m in zip(ps, full.reshape(-1, *full.shape[-2:]), strict=True):
                p.grad = m.clone()
        for p, full in zip(params, grads, strict=True):
            p.grad = sharder.grad(p, full)
        ref_opt.step()
        opt.step()
        stats = opt.last_step_stats
        assert stats is not None
        sent, orthogonalized = stats.elements_sent, stats.orthogonalized
        for p, ps in zip(params, reference, strict=True):
            got = sharder.full(p)
            want = torch.stack([r.detach() for r in ps]).reshape(got.shape)
            diff = (got - want).abs().max().item() if got.numel() else 0.0
            worst = max(worst, diff)
            if not fuse:
                assert torch.equal(got, want), f"{name} rank {rank} step {step}: differs by {diff}"
    return {"worst": worst, "sent": float(sent), "orthogonalized": float(orthogonalized)}


def _held_elements(name: str, world: int) -> int:
    per_copy = sum(math.prod(s) for s in SHAPES)
    replicas = {"plain": world, "ddp": world, "torch_hsdp": 2}.get(name, 1)
    return per_copy * replicas


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "name",
    [
        "plain",
        "ddp",
        "torch_fsdp2",
        "torch_tp",
        "hp_fsdp_flat",
        "hp_tp_production",
        "hp_expert_parallel",
        "hp_dtensor",
        "torch_hsdp",
        "torch_fsdp_x_tp",
    ],
)
def test_equal_to_single_device_torch_muon(name: str, world: int) -> None:
    if name in ("torch_hsdp", "torch_fsdp_x_tp") and world != 4:
        pytest.skip("a (2, 2) mesh needs 4 ranks")
    results = run_on_ranks(world, _case, name, False, None, timeout=120)
    fused = run_on_ranks(world, _case, name, True, "match_rms_adamw", timeout=120)
    adjusted = LR * 0.2 * math.sqrt(20)  # the largest adjusted lr among SHAPES
    worst = max(r["worst"] for r in fused)
    matrices = matrices_in(SHAPES)
    done = sum(int(r["orthogonalized"]) for r in results)
    sent = sum(int(r["sent"]) for r in results)
    print(
        f"{name} world {world}: fused max |hp - torch| = {worst:.3g} (bound {BOUND * adjusted:.3g})"
        f" = {worst / adjusted:.3g} * lr_adj; sent {sent / _held_elements(name, world):.3f} x held"
    )
    assert worst <= BOUND * adjusted
    assert done == (matrices * world if name == "plain" else matrices), (name, done)
    assert sent <= 2 * _held_elements(name, world), (name, sent)
    if name == "plain":
        assert sent == 0

"""Context parallelism against references written here, apart from the package.

* Attention: a brute-force causal attention in float64, one query position at a time
  (``softmax_j(scale * q_p . k_j)`` over ``j <= p``, the row maximum taken out by hand), and
  each rank's zigzag positions written out by hand (rank ``r`` of ``cp`` holds chunks ``r``
  and ``2 cp - 1 - r`` of ``2 cp``), not taken from the package. Ring and Ulysses, at CP 2
  and 4, with ordinary scores and with scores in the hundreds (``exp`` overflows fp32 beyond
  88: only a stable log-sum-exp survives), outputs and query/key/value gradients.
* A softmax scale given by the attention module (``CausalAttention(scale=...)``) must reach
  the context-parallel forward in both modes.
* The context-parallel loss with ignored targets spread unevenly over the ranks: the mean is
  over the non-ignored tokens of the whole sequence (``F.cross_entropy`` of the whole).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hp_dtensor import DeviceMesh, DTensor
from hp_dtensor.parallel import (
    CausalAttention,
    ContextParallel,
    context_parallel_cross_entropy,
    gather_sequence,
    global_token_mean,
    local_positions,
    parallelize_module,
)
from hp_dtensor.parallel.context_attention import ring_attention, ulysses_attention
from hp_layout import Mesh, Shard
from hp_testing import run_on_ranks

BATCH, HEADS, SEQ, HEAD = 1, 4, 16, 8


def _zigzag(seq: int, cp: int, rank: int, balanced: bool = True) -> list[int]:
    """Rank ``rank``'s global positions, by the documented rule."""
    if not balanced:
        n = seq // cp
        return list(range(rank * n, (rank + 1) * n))
    n = seq // (2 * cp)
    return list(range(rank * n, (rank + 1) * n)) + list(
        range((2 * cp - 1 - rank) * n, (2 * cp - rank) * n)
    )


def _brute_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention, one query position at a time, float64."""
    rows = []
    for p in range(q.shape[2]):
        s = (q[:, :, p : p + 1] * k[:, :, : p + 1]).sum(-1) * scale  # [b, h, p + 1]
        e = torch.exp(s - s.max(dim=-1, keepdim=True).values)
        w = e / e.sum(dim=-1, keepdim=True)
        rows.append((w.unsqueeze(-1) * v[:, :, : p + 1]).sum(2))
    return torch.stack(rows, dim=2)


def _attention_errors(world: int) -> dict[str, float]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((world,), ("cp",)))
    rank = mesh.get_local_rank("cp")
    errors: dict[str, float] = {}
    for magnitude in (1.0, 40.0):
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(BATCH, HEADS, SEQ, HEAD, generator=g) for _ in range(3))
        q = q * magnitude
        probe = torch.randn(BATCH, HEADS, SEQ, HEAD, generator=g)
        scale = 1.0 / math.sqrt(HEAD)
        whole = [t.double().requires_grad_() for t in (q, k, v)]
        want = _brute_attention(whole[0], whole[1], whole[2], scale)
        (want * probe.double()).sum().backward()
        if magnitude > 1.0:
            top = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() * scale
            assert top > 100.0, top  # exp(score) overflows fp32 (past 88.7): the regime is reached
        for variant, fn in (("ring", ring_attention), ("ulysses", ulysses_attention)):
            for balanced in (True, False):
                pos = torch.tensor(_zigzag(SEQ, world, rank, balanced))
                local = [t.index_select(2, pos).clone().requires_grad_() for t in (q, k, v)]
                out = fn(local[0], local[1], local[2], mesh, "cp", balanced=balanced)
                (out * probe.index_select(2, pos)).sum().backward()
                label = f"{variant} balanced={balanced} x{magnitude:g}"
                ref = want.detach().index_select(2, pos)
                errors[f"{label} out"] = _rel(out, ref)
                for name, mine, full in zip("qkv", local, whole, strict=True):
                    assert mine.grad is not None
                    assert full.grad is not None
                    errors[f"{label} d{name}"] = _rel(mine.grad, full.grad.index_select(2, pos))
    return errors


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    if not bool(torch.isfinite(got).all()):
        return math.inf
    scale = max(want.abs().max().item(), 1e-12)
    return (got.double() - want.double()).abs().max().item() / scale


# fp32 against the float64 brute force, relative to each tensor's largest entry, worst over
# CP 2 and 4, both variants, both shardings (torch 2.13, x86 CPU). Ordinary scores: outputs
# 2.4e-7, gradients 4.2e-7; asserted 3e-6. Scores up to ~120: the fp32 rounding of a score
# (~120 * 6e-8) moves its weight by ~1e-5 relative and the query/key gradients carry the 40x
# query: outputs 1.8e-6, gradients 5.6e-5 (Ulysses' fp32 SDPA 1.6e-5); asserted 2e-4. An
# overflow gives inf or nan, which fails either bound.
BOUNDS = {1.0: 3e-6, 40.0: 2e-4}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_attention_equals_a_brute_force_per_position_reference(world: int) -> None:
    results = run_on_ranks(world, _attention_errors, world, timeout=120)
    worst = {key: max(r[key] for r in results) for key in results[0]}
    for magnitude, bound in BOUNDS.items():
        mine = {k: v for k, v in worst.items() if k.split()[2] == f"x{magnitude:g}"}
        print(world, magnitude, {k: f"{v:.1e}" for k, v in mine.items()})
        bad = {key: value for key, value in mine.items() if not value < bound}
        assert not bad, (magnitude, bad)


def _module_scale(variant: str, mode: str) -> float:
    """``CausalAttention(scale=0.3)`` under ContextParallel against the brute force."""
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("cp",)))
    rank = mesh.get_local_rank("cp")
    core = parallelize_module(
        CausalAttention(scale=0.3),
        mesh,
        {"": ContextParallel(variant=variant)},
        mode=mode,  # type: ignore[arg-type]
        tp_axis="cp",
    )
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, HEAD, generator=g) for _ in range(3))
    want = _brute_attention(q.double(), k.double(), v.double(), 0.3)
    pos = torch.tensor(_zigzag(SEQ, 2, rank))
    local = [t.index_select(2, pos) for t in (q, k, v)]
    if mode == "validation":
        args: list[Any] = [DTensor.from_local(t, mesh, [Shard(2)]) for t in local]
        out = core(*args).to_local()
    else:
        out = core(*local)
    return _rel(out.detach(), want.index_select(2, pos))


@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["ring", "ulysses"])
@pytest.mark.parametrize("mode", ["production", "validation"])
def test_the_module_scale_reaches_context_parallel_attention(variant: str, mode: str) -> None:
    for err in run_on_ranks(2, _module_scale, variant, mode, timeout=120):
        assert err < BOUNDS[1.0], err


def _loss_with_ignored_targets() -> dict[str, float]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", Mesh((world,), ("cp",)))
    rank = mesh.get_local_rank("cp")
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, SEQ, 5, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 5, (2, SEQ), generator=g)
    # Ignore most of rank 0's tokens and none of the others': the ranks' counts differ.
    mine0 = _zigzag(SEQ, world, 0)
    targets[:, mine0[1:]] = -1
    whole = logits.clone().requires_grad_()
    want = F.cross_entropy(whole.reshape(-1, 5), targets.reshape(-1), ignore_index=-1)
    want.backward()
    assert whole.grad is not None
    pos = torch.tensor(_zigzag(SEQ, world, rank))
    assert torch.equal(local_positions(SEQ, mesh, "cp"), pos)
    local = logits.index_select(1, pos).clone().requires_grad_()
    loss = context_parallel_cross_entropy(
        local, targets.index_select(1, pos), mesh, "cp", ignore_index=-1
    )
    loss.backward()  # every rank: the whole gradient of the one global mean (exact convention)
    assert local.grad is not None
    gathered = gather_sequence(local.detach(), 1, mesh, "cp")
    # The mean of per-rank sums and counts: sum over ranks r of (r + 1) / sum of (r + 2).
    sums = [float(r + 1) for r in range(world)]
    counts = [r + 2 for r in range(world)]
    mean = global_token_mean(torch.tensor(sums[rank]), counts[rank], mesh, "cp")
    return {
        "mean": abs(mean.item() - sum(sums) / sum(counts)),
        "loss": abs(loss.item() - want.item()),
        "grad": (local.grad - whole.grad.index_select(1, pos)).abs().max().item(),
        "gather": (gathered - logits).abs().max().item(),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_loss_mean_is_over_the_non_ignored_tokens_of_the_whole_sequence(world: int) -> None:
    for errors in run_on_ranks(world, _loss_with_ignored_targets, timeout=120):
        assert errors["gather"] == 0.0, errors
        assert errors["mean"] < 1e-7, errors
        assert errors["loss"] < 1e-12, errors
        assert errors["grad"] < 1e-14, errors

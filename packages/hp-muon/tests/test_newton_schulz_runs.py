"""``Muon``'s Newton-Schulz run counter (``MuonStepStats.newton_schulz_runs``, and the running
total ``Muon.newton_schulz_runs``), checked against the calls actually made and against counts
derived in the test.

A *run* is one call of ``orthogonalize`` (one matrix) or ``orthogonalize_batch`` (a batch of
matrices of one shape class: a shape and its transpose). The oracle counts those calls by
wrapping both functions where ``hp_muon.newton_schulz`` looks them up, and derives the expected
numbers by hand: unfused, one run per matrix; fused, one per shape class per settings group.

* one device: the counter equals the calls and the hand count, fused and unfused;
* world 2 (torch FSDP2 layouts): six matrices of equal-cost pairs; the balanced optimum (each
  rank one (12, 12) and two of the (8, 16) class) is derived in the test, so each rank
  orthogonalizes 3 matrices in 3 runs unfused and 2 runs fused (one per shape class it owns);
  the job's runs per step are the sum over ranks (6 unfused, 4 fused), and every matrix is
  orthogonalized once;
* gradient accumulation (world 2, torch FSDP2, 3 micro-batches per step, 2 steps): the counter
  grows by one step's runs per optimizer step, not per micro-batch, and the parameters equal
  ``torch.optim.Muon`` on one device bit for bit.

A silent fallback to AdamW (no run), or a Newton-Schulz run per micro-batch, fails these.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh as torch_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor as torch_distribute

import hp_muon.newton_schulz as ns
from hp_muon import Muon
from hp_testing import run_on_ranks

LR = 0.02


@contextmanager
def _counting() -> Iterator[dict[str, int]]:
    """Count the calls of the two Newton-Schulz entry points while the block runs."""
    calls = {"orthogonalize": 0, "orthogonalize_batch": 0}
    real = {name: getattr(ns, name) for name in calls}

    def wrap(name: str) -> Callable[..., torch.Tensor]:
        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls[name] += 1
            out: torch.Tensor = real[name](*args, **kwargs)
            return out

        return counted

    for name in calls:
        setattr(ns, name, wrap(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(ns, name, fn)


# One device ------------------------------------------------------------------------------------

# Keller's coefficients: (16, 8) x2 and its transpose (8, 16), one class; (12, 12); a [3, 10, 6]
# expert stack, 3 matrices of one class; and, in a group of its own with the same Newton-Schulz
# settings, a (12, 8) with row blocks (4, 8): a (4, 8) and an (8, 8) matrix. you_5step (other
# settings, so other runs): (16, 8) and (10, 6).
GROUP_A = ((16, 8), (16, 8), (8, 16), (12, 12), (3, 10, 6))
BLOCKED = (12, 8)
GROUP_B = ((16, 8), (10, 6))
MATRICES = 4 + 3 + 2 + 2  # unfused: one run per matrix
# Fused, Keller: {8x16 class: 3 members} and {6x10 class: 3 experts} batched; {12x12}, {4x8} and
# {8x8} alone (classes span parameter groups of equal settings). you_5step: {8x16} and {6x10},
# alone (a class does not span settings).
BATCHED, ALONE = 2, 3 + 2
CLASSES = BATCHED + ALONE


def _single_device_step(fuse: bool) -> tuple[int, dict[str, int], Muon]:
    g = torch.Generator().manual_seed(0)
    a = [nn.Parameter(torch.randn(s, generator=g)) for s in GROUP_A]
    blocked = nn.Parameter(torch.randn(BLOCKED, generator=g))
    b = [nn.Parameter(torch.randn(s, generator=g)) for s in GROUP_B]
    idle = nn.Parameter(torch.randn(9, 9, generator=g))  # no gradient: no run
    groups: list[dict[str, Any]] = [
        {"params": [*a, idle]},
        {"params": [blocked], "row_blocks": (4, 8)},
        {"params": b, "ns_coefficients": "you_5step"},
    ]
    opt = Muon(
        groups,
        lr=LR,
        fuse_shapes=fuse,
        ns_dtype=torch.bfloat16,
    )
    for p in (*a, blocked, *b):
        p.grad = torch.randn(p.shape, generator=g)
    with _counting() as calls:
        opt.step()
    stats = opt.last_step_stats
    assert stats is not None
    assert stats.orthogonalized == MATRICES
    return stats.newton_schulz_runs, calls, opt


def test_one_device_counts_one_run_per_matrix_unfused() -> None:
    runs, calls, opt = _single_device_step(fuse=False)
    assert calls == {"orthogonalize": MATRICES, "orthogonalize_batch": 0}
    assert runs == MATRICES
    assert opt.newton_schulz_runs == MATRICES


def test_one_device_counts_one_run_per_shape_class_fused() -> None:
    runs, calls, opt = _single_device_step(fuse=True)
    # Classes with several members run batched, the others alone.
    assert calls == {"orthogonalize": ALONE, "orthogonalize_batch": BATCHED}
    assert runs == CLASSES == sum(calls.values())
    # The running total adds each step's runs; this step only the first group has gradients.
    opt.zero_grad()
    for p in opt.param_groups[0]["params"][:-1]:
        p.grad = torch.ones_like(p)
    opt.step()
    stats = opt.last_step_stats
    assert stats is not None
    assert stats.newton_schulz_runs == 3  # 8x16 (3 members), 12x12, 6x10 (3 experts)
    assert opt.newton_schulz_runs == CLASSES + 3


def test_no_gradient_no_run() -> None:
    p = nn.Parameter(torch.randn(6, 4))
    opt = Muon([p], ns_dtype=torch.bfloat16)
    with _counting() as calls:
        opt.step()
    assert sum(calls.values()) == 0
    stats = opt.last_step_stats
    assert stats is not None
    assert stats.newton_schulz_runs == opt.newton_schulz_runs == 0


# World 2: one owner per matrix, batched same-shape runs ---------------------------------------

# NS cost of one step (multiply-adds, m = min, n = max: X X^T m*m*n, the polynomial m^3, its
# product with X m*m*n): (12, 12) -> 5184, the (8, 16) class -> 2560. Total 20608; half 10304 =
# 5184 + 2 * 2560, reached only by one (12, 12) and two of the others per rank (a rank with both
# (12, 12) has 10368 > 10304).
WORLD2_SHAPES = ((12, 12), (16, 8), (8, 16), (12, 12), (16, 8), (8, 16))


def _ns_cost(rows: int, cols: int) -> int:
    m, n = min(rows, cols), max(rows, cols)
    return m * m * n + m**3 + m * m * n


def test_world2_shapes_have_one_balanced_optimum() -> None:
    costs = [_ns_cost(*s) for s in WORLD2_SHAPES]
    best = min(
        max(sum(c for c, r in zip(costs, ranks, strict=True) if r == k) for k in (0, 1))
        for ranks in _assignments(len(costs), 2)
    )
    optimal = [
        ranks
        for ranks in _assignments(len(costs), 2)
        if max(sum(c for c, r in zip(costs, ranks, strict=True) if r == k) for k in (0, 1)) == best
    ]
    assert best == sum(costs) // 2
    for ranks in optimal:
        for k in (0, 1):
            mine = [WORLD2_SHAPES[i] for i, r in enumerate(ranks) if r == k]
            assert sorted(mine).count((12, 12)) == 1
            assert len(mine) == 3


def _assignments(jobs: int, ranks: int) -> Iterator[tuple[int, ...]]:
    if jobs == 0:
        yield ()
        return
    for rest in _assignments(jobs - 1, ranks):
        for r in range(ranks):
            yield (*rest, r)


def _world2_case(fuse: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = torch_mesh("cpu", (2,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(1)
    fulls = [torch.randn(s, generator=g) for s in WORLD2_SHAPES]
    params = [nn.Parameter(torch_distribute(f, mesh, [TorchShard(0)])) for f in fulls]
    reference = [nn.Parameter(f.clone()) for f in fulls]
    opt = Muon(params, lr=LR, fuse_shapes=fuse, ns_dtype=torch.bfloat16)
    ref_opt = torch.optim.Muon(reference, lr=LR)
    grads = [torch.randn(s, generator=g) for s in WORLD2_SHAPES]
    for p, r, grad in zip(params, reference, grads, strict=True):
        p.grad = torch_distribute(grad, mesh, [TorchShard(0)])
        r.grad = grad.clone()
    with _counting() as calls:
        opt.step()
    ref_opt.step()
    stats = opt.last_step_stats
    assert stats is not None
    worst = max(
        (p.full_tensor() - r.detach()).abs().max().item()  # type: ignore[attr-defined]
        for p, r in zip(params, reference, strict=True)
    )
    return {
        "calls": sum(calls.values()),
        "runs": stats.newton_schulz_runs,
        "total": opt.newton_schulz_runs,
        "orthogonalized": stats.orthogonalized,
        "matrices": stats.matrices,
        "sent": stats.elements_sent,
        "bytes": stats.bytes_sent,
        "worst": worst,
    }


def test_world2_each_matrix_once_and_runs_batched_by_shape() -> None:
    numel = sum(math.prod(s) for s in WORLD2_SHAPES)
    adjusted = LR * math.sqrt(2)  # the largest adjusted lr ("original": tall (16, 8))
    for fuse, runs_per_rank in ((False, 3), (True, 2)):
        results = run_on_ranks(2, _world2_case, fuse, timeout=60)
        for r in results:
            assert r["matrices"] == len(WORLD2_SHAPES)
            assert r["orthogonalized"] == 3, r  # the balanced optimum: 3 matrices a rank
            assert r["runs"] == r["calls"] == r["total"] == runs_per_rank, (fuse, r)
            # Shard(0) over 2 ranks, even rows: each matrix's owner gathers the other half
            # and sends it back, so every rank sends half of every matrix, in bf16.
            assert r["sent"] == numel // 2, r
            assert r["bytes"] == 2 * r["sent"]
            if fuse:
                assert r["worst"] <= 2**-7 * adjusted, r
            else:
                assert r["worst"] == 0.0, r
        assert sum(r["orthogonalized"] for r in results) == len(WORLD2_SHAPES)


# Gradient accumulation ------------------------------------------------------------------------

LAYERS = ((16, 12), (12, 12), (12, 16))  # Linear(in, out): weights (12, 16), (12, 12), (16, 12)
MICRO_BATCHES, STEPS = 3, 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 12, bias=False),
        nn.Tanh(),
        nn.Linear(12, 12, bias=False),
        nn.Tanh(),
        nn.Linear(12, 16, bias=False),
    )


def _accumulation_case() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = torch_mesh("cpu", (2,), mesh_dim_names=("dp",))
    model, reference = _model(), _model()
    for layer in (model[0], model[2], model[4]):
        torch_fully_shard(layer, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    opt = Muon(model.parameters(), lr=LR, ns_dtype=torch.bfloat16, fuse_shapes=False)
    ref_opt = torch.optim.Muon(reference.parameters(), lr=LR)
    g = torch.Generator().manual_seed(2)
    per_step: list[int] = []
    totals: list[int] = []
    with _counting() as calls:
        for _step in range(STEPS):
            for _micro in range(MICRO_BATCHES):
                # Every rank takes the whole micro-batch: FSDP's average of equal gradients is
                # exact, so the accumulated gradient equals the single-device one bit for bit.
                x = torch.randn(4, 16, generator=g)
                model(x).pow(2).mean().backward()
                reference(x).pow(2).mean().backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            stats = opt.last_step_stats
            assert stats is not None
            per_step.append(stats.newton_schulz_runs)
            totals.append(opt.newton_schulz_runs)
    equal = all(
        isinstance(p, TorchDTensor) and torch.equal(p.full_tensor(), r.detach())
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    assert stats is not None
    return {
        "per_step": per_step,
        "totals": totals,
        "calls": sum(calls.values()),
        "orthogonalized": stats.orthogonalized,
        "equal": equal,
    }


def test_accumulation_runs_once_per_optimizer_step() -> None:
    results = run_on_ranks(2, _accumulation_case, timeout=60)
    for r in results:
        assert r["equal"], r
        mine = r["orthogonalized"]
        # Unfused: one run per owned matrix, each optimizer step, whatever the micro-batches.
        assert r["per_step"] == [mine] * STEPS, r
        assert r["totals"] == [mine * (k + 1) for k in range(STEPS)], r
        assert r["calls"] == mine * STEPS, r
    assert sum(r["orthogonalized"] for r in results) == len(LAYERS)

"""hp-muon's numeric and policy claims, each against a reference written apart from the code.

* Newton-Schulz (README "Semantics"): the iteration written here from its definition (bf16,
  the transpose of a tall matrix, division by the clamped Frobenius norm, then per step
  ``A = X X^T``, ``X = a X + (b A + c A^2) X``) equals ``orthogonalize`` and
  ``orthogonalize_batch`` bit for bit, on tall, wide and square matrices and per-step
  schedules, through hp-kernels' op and through hp-muon's own code alike; for one triple it also
  equals ``torch.optim.Muon``'s own iteration.
* Coefficient schedules: the published tables written out here (Keller Jordan's triple, You
  Jiacheng's 5- and 6-step sets, Polar Express with its 1.01 damping); a ``Muon`` step with a
  per-step schedule (shorter than ``ns_steps``: the last triple repeats) equals
  ``torch.optim.Muon`` whose iteration is replaced by this file's, fed the schedule expanded by
  hand.
* ``adjusted_lr``: both formulas written here, tall and wide.
* Owner balancing (README "Distribution"): the planner's cost per matrix equals the
  multiply-adds ``torch.utils.flop_counter`` counts in one step of this file's iteration; the
  per-rank load of its owners, in those measured costs, is within Graham's LPT bound
  ``(4/3 - 1/(3m))`` of the optimum found by brute force over every assignment, and equal to it
  where LPT is optimal.
* Planner accounting and pieces: elements moved under ``Shard(0)`` against a formula; each
  piece's view against the same cells indexed in the whole tensor.
* The tensor helpers (``hp_muon.tensors``) and ``ParamSplit``'s lists.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.optim._muon as torch_muon
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import hp_muon.newton_schulz as ns
from hp_dtensor import annotate_layout
from hp_layout import Layout, Mesh, RaggedShard, Replicate, Shard
from hp_muon import (
    KELLER,
    PRESETS,
    MatrixTensor,
    Muon,
    adjusted_lr,
    orthogonalize,
    orthogonalize_batch,
    orthogonalize_counted,
    plan_muon_step,
    split_params,
)
from hp_muon.exchange import piece_view
from hp_muon.plan import newton_schulz_cost
from hp_muon.tensors import global_shape, is_plain, like_param, local_grad, planning_layout

EPS = 1e-7
Triple = tuple[float, float, float]


# The iteration, from its definition --------------------------------------------------------------


def _reference_ns(x: torch.Tensor, triples: Sequence[Triple], eps: float = EPS) -> torch.Tensor:
    """Newton-Schulz of one matrix or a ``[B, m, n]`` batch in bf16: a tall matrix is worked on
    as its (wide) transpose, so that ``X X^T`` is the small Gram matrix."""
    y = x.bfloat16()
    tall = y.size(-2) > y.size(-1)
    if tall:
        y = y.mT
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for a, b, c in triples:
        gram = y @ y.mT
        if y.dim() == 2:
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            y = torch.addmm(y, poly, y, beta=a)
        else:
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            y = torch.baddbmm(y, poly, y, beta=a)
    return y.mT if tall else y


def _expanded(table: Sequence[Triple], steps: int) -> list[Triple]:
    """A per-step table run for ``steps`` steps: in order, then its last triple again."""
    out = list(table[:steps])
    while len(out) < steps:
        out.append(table[-1])
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.fixture(params=["hp_kernels", "own_code"])
def ns_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each Newton-Schulz test through hp-kernels' op and through hp-muon's own code."""
    if request.param == "own_code":
        monkeypatch.setattr(ns, "_kernel", None)
    else:
        assert ns.uses_hp_kernels()
    return str(request.param)


SHAPES = [(24, 40), (40, 24), (32, 32), (1, 9), (9, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("schedule", ["keller", "you_5step", "polar_express"])
def test_orthogonalize_is_the_iteration(
    ns_path: str, shape: tuple[int, int], schedule: str
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    table = PRESETS[schedule]
    steps = _expanded(table, 7)
    got = orthogonalize(x, steps, EPS)
    assert got.shape == x.shape
    assert torch.equal(_bits(got), _bits(_reference_ns(x, steps))), ns_path
    if schedule == "keller":
        theirs = torch_muon._zeropower_via_newtonschulz(x, KELLER, 7, EPS)
        assert torch.equal(_bits(got), _bits(theirs))


@pytest.mark.parametrize("shape", [(3, 16, 40), (3, 40, 16), (2, 12, 12)], ids=str)
def test_orthogonalize_batch_is_the_iteration(ns_path: str, shape: tuple[int, int, int]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    steps = _expanded(PRESETS["you_6step"], 6)
    got = orthogonalize_batch(x, steps, EPS)
    assert got.shape == x.shape
    assert torch.equal(_bits(got), _bits(_reference_ns(x, steps))), ns_path


def test_fused_transposed_shapes_run_in_the_wide_orientation(ns_path: str) -> None:
    """A (16, 8) batched with two (8, 16): the batch is the wide orientation; the tall one's
    result is the transpose of the iteration on its transpose."""
    g = torch.Generator().manual_seed(2)
    mats = [torch.randn(s, generator=g) for s in [(8, 16), (16, 8), (8, 16)]]
    steps = _expanded((KELLER,), 5)
    fused, runs = orthogonalize_counted(mats, steps, EPS, fuse=True)
    assert runs == 1
    wide = torch.stack([mats[0], mats[1].T, mats[2]])
    want = _reference_ns(wide, steps)
    for got, m, w in zip(fused, mats, want, strict=True):
        assert got.shape == m.shape
        expected = w.T if m.size(0) > m.size(1) else w
        assert torch.equal(_bits(got), _bits(expected)), ns_path


def test_counted_runs_per_matrix_or_per_shape_class() -> None:
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(s, generator=g) for s in [(6, 4), (4, 6), (6, 4), (5, 5), (0, 3)]]
    steps = _expanded((KELLER,), 2)
    assert orthogonalize_counted(mats, steps, EPS, fuse=False)[1] == 4  # the empty one: none
    assert orthogonalize_counted(mats, steps, EPS, fuse=True)[1] == 2  # {4x6 class}, {5x5}


# Coefficient tables ----------------------------------------------------------------------------

# Keller Jordan's quintic; You Jiacheng's sets (Feb and Mar 2025); Polar Express (Amsel et al.,
# arXiv 2505.16932, degree 5), whose polynomials but the last are damped: p(x / 1.01).
PUBLISHED: dict[str, list[Triple]] = {
    "keller": [(3.4445, -4.7750, 2.0315)],
    "you_5step": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "you_6step": [
        (a / 1024, b / 1024, c / 1024)
        for a, b, c in [
            (3955, -8306, 5008),
            (3735, -6681, 3463),
            (3799, -6499, 3211),
            (4019, -6385, 2906),
            (2677, -3029, 1162),
            (2172, -1833, 682),
        ]
    ],
    "polar_express": [
        (a / 1.01, b / 1.01**3, c / 1.01**5)
        for a, b, c in [
            (8.28721201814563, -23.595886519098837, 17.300387312530933),
            (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
            (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
            (3.3184196573706015, -2.488488024314874, 0.51004894012372),
            (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
            (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
            (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        ]
    ]
    + [(1.875, -1.25, 0.375)],
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_the_published_tables(name: str) -> None:
    assert sorted(PRESETS) == sorted(PUBLISHED)
    table = PRESETS[name]
    assert len(table) == len(PUBLISHED[name])
    for got, want in zip(table, PUBLISHED[name], strict=True):
        assert got == pytest.approx(want, rel=1e-15, abs=0)


def _torch_muon_with(steps: list[Triple]) -> Any:
    """torch.optim.Muon's iteration replaced by this file's, with ``steps`` as the schedule."""

    def zeropower(grad: torch.Tensor, coefficients: Any, ns_steps: int, eps: float) -> Any:
        assert ns_steps == len(steps)
        return _reference_ns(grad, steps, eps)

    return zeropower


@pytest.mark.parametrize(
    ("spec", "ns_steps"),
    [("you_5step", 5), ("polar_express", 10), ([(3.4, -4.7, 2.0), (2.0, -1.5, 0.5)], 4)],
    ids=["you_5step", "polar_express_repeats_last", "two_triples_repeat_last"],
)
def test_muon_step_runs_the_schedule_in_order(
    spec: Any, ns_steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = PUBLISHED[spec] if isinstance(spec, str) else spec
    g = torch.Generator().manual_seed(4)
    fulls = [torch.randn(s, generator=g) for s in [(24, 12), (12, 24)]]
    ours = [nn.Parameter(f.clone()) for f in fulls]
    theirs = [nn.Parameter(f.clone()) for f in fulls]
    opt = Muon(ours, lr=0.02, ns_coefficients=spec, ns_steps=ns_steps, ns_dtype=torch.bfloat16)
    monkeypatch.setattr(
        torch_muon, "_zeropower_via_newtonschulz", _torch_muon_with(_expanded(table, ns_steps))
    )
    ref = torch.optim.Muon(theirs, lr=0.02, ns_steps=ns_steps)
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


# Learning-rate adjustment ---------------------------------------------------------------------


@pytest.mark.parametrize(("rows", "cols"), [(64, 16), (16, 64), (30, 30)])
def test_adjusted_lr_formulas(rows: int, cols: int) -> None:
    lr = 0.02
    # Keller Jordan: scale up tall matrices by sqrt(rows / cols), never down.
    assert adjusted_lr(lr, None, rows, cols) == pytest.approx(
        lr * (rows / cols) ** 0.5 if rows > cols else lr, rel=1e-15
    )
    assert adjusted_lr(lr, "original", rows, cols) == adjusted_lr(lr, None, rows, cols)
    # Moonshot: the update's RMS matched to AdamW's, 0.2 * sqrt(the larger dim).
    assert adjusted_lr(lr, "match_rms_adamw", rows, cols) == pytest.approx(
        0.2 * lr * max(rows, cols) ** 0.5, rel=1e-15
    )
    tensor = adjusted_lr(torch.tensor(lr, dtype=torch.float64), "match_rms_adamw", rows, cols)
    assert isinstance(tensor, torch.Tensor)
    assert tensor.dtype == torch.float64
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        adjusted_lr(lr, "other", rows, cols)


# Owner balancing against brute force ----------------------------------------------------------


def _measured_cost(rows: int, cols: int) -> int:
    """Multiply-adds of one step of the iteration on a ``rows x cols`` matrix, as counted by
    torch's flop counter (2 flops a multiply-add)."""
    x = torch.randn(rows, cols).bfloat16()
    with FlopCounterMode(display=False) as counter:
        _reference_ns(x, [KELLER])
    flops = int(counter.get_total_flops())
    assert flops % 2 == 0
    return flops // 2


@pytest.mark.parametrize(("rows", "cols"), [(8, 8), (16, 8), (8, 16), (24, 40), (40, 24), (1, 9)])
def test_cost_model_is_the_counted_multiply_adds(rows: int, cols: int) -> None:
    assert newton_schulz_cost(rows, cols) == _measured_cost(rows, cols)


def _mesh(world: int) -> Mesh:
    return Mesh((world,), ("dp",), tuple(range(world)))


def _loads(plan: Any, world: int, costs: Sequence[int]) -> list[int]:
    load = [0] * world
    for job in plan.jobs:
        load[job.owner] += costs[job.tensor]
    return load


def _optimum(costs: Sequence[int], world: int) -> int:
    best = sum(costs)
    for owners in itertools.product(range(world), repeat=len(costs)):
        load = [0] * world
        for c, r in zip(costs, owners, strict=True):
            load[r] += c
        best = min(best, max(load))
    return best


def _instances() -> Iterator[tuple[int, list[tuple[int, int]], str]]:
    g = torch.Generator().manual_seed(5)
    pool = [(8, 8), (16, 8), (8, 24), (16, 16), (12, 20), (24, 24), (4, 32)]
    for world in (2, 3):
        for kind in ("shard", "replicate"):
            for _ in range(3):
                count = int(torch.randint(4, 8, (1,), generator=g))
                picks = torch.randint(0, len(pool), (count,), generator=g).tolist()
                yield world, [pool[i] for i in picks], kind


@pytest.mark.parametrize(("world", "shapes", "kind"), list(_instances()))
def test_owner_balance_is_within_lpt_bound_of_brute_force(
    world: int, shapes: list[tuple[int, int]], kind: str
) -> None:
    """Every rank holds part of every matrix (rows over ``dp``, or replicas), so any rank may
    own any matrix: the optimum is over all ``world ** len(shapes)`` assignments."""
    mesh = _mesh(world)
    placement = Shard(0) if kind == "shard" else Replicate()
    tensors = [MatrixTensor(Layout(s, mesh, [placement])) for s in shapes]
    plan = plan_muon_step(tensors, bucket_numel=10**6)
    costs = [_measured_cost(*s) for s in shapes]
    makespan, best = max(_loads(plan, world, costs)), _optimum(costs, world)
    assert best * world >= sum(costs)
    assert makespan <= (4 / 3 - 1 / (3 * world)) * best, (makespan, best)
    assert plan.load() == dict(
        enumerate(_loads(plan, world, [newton_schulz_cost(*s) for s in shapes]))
    )


def test_largest_first_reaches_the_optimum_where_smallest_first_does_not() -> None:
    """Eight (8, 8) and one (16, 16), which costs as much as the eight together: the optimum
    puts the big one alone; taking the small ones first would leave 1.5x the optimum."""
    shapes = [(8, 8)] * 8 + [(16, 16)]
    costs = [_measured_cost(*s) for s in shapes]
    assert costs[-1] == sum(costs[:-1])
    plan = plan_muon_step(
        [MatrixTensor(Layout(s, _mesh(2), [Replicate()])) for s in shapes], bucket_numel=10**6
    )
    assert max(_loads(plan, 2, costs)) == _optimum(costs, 2) == costs[-1]


# Accounting and pieces -------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_rows_sharded_matrices_move_all_but_the_owners_share_each_way(world: int) -> None:
    shapes = [(8, 12), (16, 4), (4, 16)]
    plan = plan_muon_step(
        [MatrixTensor(Layout(s, _mesh(world), [Shard(0)])) for s in shapes], bucket_numel=10**6
    )
    moved = sum(math.prod(s) * (world - 1) // world for s in shapes)
    assert plan.elements_moved() == (moved, moved)
    assert plan.exchanges


def test_piece_views_are_the_pieces_cells() -> None:
    """A (3, 4) matrix flattened over two ranks, 5 and 7 elements: each rank's pieces, viewed in
    its flat local data, are the cells they name in the whole matrix."""
    full = torch.arange(12.0).reshape(3, 4)
    layout = Layout((3, 4), Mesh((2,), ("shard",), (0, 1)), [RaggedShard((5, 7))])
    plan = plan_muon_step([MatrixTensor(layout)], bucket_numel=100)
    locals_ = {0: full.reshape(-1)[:5], 1: full.reshape(-1)[5:]}
    (job,) = plan.jobs
    cells = 0
    for piece in job.targets:
        (r0, r1), (c0, c1) = piece.rows, piece.cols
        assert torch.equal(piece_view(locals_[piece.rank], piece), full[r0:r1, c0:c1])
        cells += piece.numel
    assert cells == 12


# Tensor helpers and the split ------------------------------------------------------------------


def test_tensor_helpers() -> None:
    plain = nn.Parameter(torch.randn(3, 4))
    layout = Layout((3, 4), Mesh((2,), ("shard",), (0, 1)), [RaggedShard((5, 7))])
    piece = annotate_layout(nn.Parameter(torch.randn(5)), layout, rank=0)
    assert global_shape(plain) == (3, 4)
    assert global_shape(piece) == (3, 4)
    assert is_plain(plain)
    assert not is_plain(piece)
    # Plain parameters are replicas over the replicate group when one is given (DDP).
    replicas = Mesh((2,), ("replicate",), (0, 1))
    assert planning_layout(plain, replicas) == Layout((3, 4), replicas, [Replicate()])
    assert planning_layout(piece, replicas) == layout
    state = like_param(piece, torch.zeros(5))
    assert global_shape(state) == (3, 4)
    assert not is_plain(state)
    assert like_param(plain, torch.zeros(3, 4)).shape == (3, 4)
    piece.grad = torch.ones(5)
    assert torch.equal(local_grad(piece, 0), torch.ones(5))


def test_param_split_lists() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6), nn.LayerNorm(6))
    split = split_params(model)
    assert split.muon_params == [model[1].weight]
    assert split.adamw_params == [model[0].weight, model[1].bias, model[2].weight, model[2].bias]

"""Coefficient schedules and the Newton-Schulz kernels: postconditions and agreement."""

from __future__ import annotations

import pytest
import torch

from hp_muon import KELLER, PRESETS, coefficient_schedule
from hp_muon.newton_schulz import orthogonalize, orthogonalize_batch, orthogonalize_many

EPS = 1e-7


@pytest.mark.parametrize("ns_steps", [0, 1, 5, 12])
def test_single_triple_repeats(ns_steps: int) -> None:
    assert coefficient_schedule((1, 2, 3), ns_steps) == ((1.0, 2.0, 3.0),) * ns_steps


@pytest.mark.parametrize("ns_steps", [0, 1, 2, 3, 7])
def test_sequence_runs_in_order_and_repeats_its_last(ns_steps: int) -> None:
    seq = [(1, 2, 3), (4, 5, 6), (7, 8, 9)]
    got = coefficient_schedule(seq, ns_steps)
    assert len(got) == ns_steps
    for i, triple in enumerate(got):
        assert triple == tuple(float(v) for v in seq[min(i, len(seq) - 1)])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_their_published_tables(name: str) -> None:
    table = PRESETS[name]
    assert coefficient_schedule(name, len(table)) == table
    assert coefficient_schedule(name, len(table) + 3)[-1] == table[-1]


def test_polar_express_is_damped_except_its_fixed_point() -> None:
    table = PRESETS["polar_express"]
    assert len(table) == 8
    assert table[-1] == (1.875, -1.25, 0.375)
    # The first polynomial of the paper (8.2872..., -23.5958..., 17.3003...) over 1.01^(1,3,5).
    a, b, c = table[0]
    assert a == pytest.approx(8.28721201814563 / 1.01, rel=1e-15)
    assert b == pytest.approx(-23.595886519098837 / 1.01**3, rel=1e-15)
    assert c == pytest.approx(17.300387312530933 / 1.01**5, rel=1e-15)
    assert PRESETS["keller"] == (KELLER,)


@pytest.mark.parametrize(
    ("spec", "ns_steps", "message"),
    [
        ((1, 2, 3), 100, "fewer than 100 steps"),
        ((1, 2, 3), -1, "must be >= 0"),
        ((1, 2, 3), 2.0, "must be an integer"),
        ((1, 2, 3), True, "must be an integer"),
        ("nope", 5, "unknown Newton-Schulz coefficient preset 'nope'"),
        ((), 5, "ns_coefficients must be"),
        ((1, 2), 5, "exactly 3 numbers"),
        ([(1, 2, 3), (1, 2)], 5, r"ns_coefficients\[1\] must be exactly 3 numbers"),
        ([(1, 2, 3), "abc"], 5, r"ns_coefficients\[1\] must be a sequence"),
        ((1, 2, True), 5, "exactly 3 numbers"),
    ],
)
def test_schedule_errors(spec: object, ns_steps: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        coefficient_schedule(spec, ns_steps)  # type: ignore[arg-type]


def _singular_values(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.linalg.svdvals(x.float())
    return out


@pytest.mark.parametrize(
    ("preset", "ns_steps", "low", "high"),
    [("keller", 5, 0.6, 1.25), ("you_5step", 5, 0.7, 1.25), ("polar_express", 8, 0.85, 1.1)],
)
@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (40, 40)])
def test_orthogonalize_maps_singular_values_near_one(
    preset: str, ns_steps: int, low: float, high: float, shape: tuple[int, int]
) -> None:
    """A well-conditioned input's singular values land in the band each set is tuned for."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    out = orthogonalize(x, coefficient_schedule(preset, ns_steps), EPS)
    assert out.dtype == torch.bfloat16
    assert out.shape == x.shape
    sv = _singular_values(out)
    # A square Gaussian matrix has singular values down to ~1e-2 that 5 steps cannot lift;
    # the bulk (all but the smallest few) must be in band.
    bulk = sv[: int(0.9 * len(sv))]
    assert float(bulk.min()) > low, (preset, float(bulk.min()))
    assert float(sv.max()) < high, (preset, float(sv.max()))


def test_orthogonalize_does_not_modify_its_input() -> None:
    x = torch.randn(6, 4)
    before = x.clone()
    orthogonalize(x, coefficient_schedule(KELLER, 5), EPS)
    assert torch.equal(x, before)


def test_tall_is_the_transpose_of_wide() -> None:
    """Tall matrices run in their wide orientation: the result is the transpose's, transposed."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(8, 20, generator=g)
    schedule = coefficient_schedule(KELLER, 5)
    tall_out = orthogonalize(wide.T.contiguous(), schedule, EPS)
    wide_out = orthogonalize(wide, schedule, EPS)
    torch.testing.assert_close(tall_out.float(), wide_out.T.float(), atol=2**-7, rtol=0)


@pytest.mark.parametrize("shape", [(4, 6, 10), (3, 12, 5), (2, 7, 7)])
def test_batch_agrees_with_one_by_one(shape: tuple[int, int, int]) -> None:
    """Batched bf16 matmuls may round differently; the results agree within bf16 rounding."""
    g = torch.Generator().manual_seed(2)
    batch = torch.randn(shape, generator=g)
    schedule = coefficient_schedule(KELLER, 5)
    together = orthogonalize_batch(batch, schedule, EPS)
    singles = torch.stack([orthogonalize(m, schedule, EPS) for m in batch])
    assert together.shape == batch.shape
    # Entries of an orthogonalized matrix are at most 1.2 in magnitude; bf16 keeps 8 bits.
    torch.testing.assert_close(together.float(), singles.float(), atol=2**-6, rtol=0)


def test_many_unfused_is_bit_equal_to_one_by_one() -> None:
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(s, generator=g) for s in [(6, 4), (4, 6), (6, 4), (5, 5), (0, 3)]]
    schedule = coefficient_schedule("you_5step", 5)
    got = orthogonalize_many(mats, schedule, EPS, fuse=False)
    for m, out in zip(mats, got, strict=True):
        assert out.dtype == torch.bfloat16
        if m.numel():
            assert torch.equal(out, orthogonalize(m, schedule, EPS))
        else:
            assert out.shape == m.shape


def test_many_fused_groups_transposed_shapes() -> None:
    g = torch.Generator().manual_seed(4)
    mats = [torch.randn(s, generator=g) for s in [(6, 4), (4, 6), (6, 4), (5, 5)]]
    schedule = coefficient_schedule(KELLER, 5)
    fused = orthogonalize_many(mats, schedule, EPS, fuse=True)
    for m, out in zip(mats, fused, strict=True):
        assert out.shape == m.shape
        ref = orthogonalize(m, schedule, EPS)
        torch.testing.assert_close(out.float(), ref.float(), atol=2**-6, rtol=0)


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="2-D matrix"):
        orthogonalize(torch.zeros(2, 3, 4), coefficient_schedule(KELLER, 1), EPS)
    with pytest.raises(ValueError, match=r"\[B, m, n\]"):
        orthogonalize_batch(torch.zeros(3, 4), coefficient_schedule(KELLER, 1), EPS)

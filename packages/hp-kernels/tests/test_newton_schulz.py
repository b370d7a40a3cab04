"""Newton-Schulz: the CPU extension bit-equal to the reference, the 2-D case bit-equal to
``torch.optim.Muon``; schedules, errors, fake tensors, opcheck."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.optim._muon import _zeropower_via_newtonschulz

import hp_kernels
from _util import bit_equal
from hp_kernels import precision, reference
from hp_kernels._extension import load_cpu_extension

KELLER = (3.4445, -4.7750, 2.0315)
SHAPES = [(1, 8, 8), (3, 16, 40), (2, 40, 16), (4, 1, 7), (2, 64, 64), (0, 5, 6), (1, 33, 17)]


def _ref(x: torch.Tensor, steps: int = 5, coeffs: tuple[float, ...] = KELLER) -> torch.Tensor:
    a, b, c = ([coeffs[i]] * steps for i in range(3))
    return reference.newton_schulz(x, a, b, c, 1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_batched_bit_equal_to_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = hp_kernels.newton_schulz(x, dtype=torch.bfloat16)
    want = _ref(x)
    assert got.dtype == torch.bfloat16
    assert bit_equal(got, want)
    assert got.stride() == want.stride()


@pytest.mark.parametrize("shape", [(8, 8), (16, 40), (40, 16), (1, 7), (33, 17), (128, 96)])
def test_two_d_bit_equal_to_torch_muon(shape: tuple[int, int]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got = hp_kernels.newton_schulz(x, steps=5, coefficients=KELLER, eps=1e-7, dtype=torch.bfloat16)
    assert bit_equal(got, _zeropower_via_newtonschulz(x, KELLER, 5, 1e-7))


@pytest.mark.parametrize("shape", [(4, 32, 48), (3, 48, 32)], ids=["wide", "tall"])
def test_batch_close_to_per_matrix(shape: tuple[int, int, int]) -> None:
    # Batched bf16 products may run other kernels than per-matrix ones, so the batch is not
    # promised bitwise. Measured bit-equal on the development CPU (torch 2.13, x86; this shape
    # and seven others up to [4, 256, 704]), so no tolerance can be sized from a measurement
    # here; asserted within 2**-7, one bf16 rounding of an entry below 2 (the outputs are below
    # 0.7), the bound hp-muon's fused steps use for the same kernels.
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    got = hp_kernels.newton_schulz(x, dtype=torch.bfloat16)
    assert got.shape == x.shape
    for i in range(shape[0]):
        one = _zeropower_via_newtonschulz(x[i], KELLER, 5, 1e-7)
        assert one.shape == x[i].shape
        torch.testing.assert_close(got[i].float(), one.float(), atol=2**-7, rtol=0)


def _quintic_float64(x: torch.Tensor, schedule: list[tuple[float, float, float]]) -> torch.Tensor:
    """Muon's quintic iteration written out in float64 (the oracle, apart from the package):
    normalize each matrix by its Frobenius norm, then per step ``X <- a X + (b A + c A^2) X``
    with ``A = X X^T``, on the orientation with fewer rows."""
    y = x.double()
    tall = y.size(-2) > y.size(-1)
    if tall:
        y = y.mT
    y = y / torch.linalg.matrix_norm(y, keepdim=True).clamp_min(1e-7)
    for a, b, c in schedule:
        gram = y @ y.mT
        y = a * y + (b * gram + c * gram @ gram) @ y
    out: torch.Tensor = y.mT if tall else y
    return out


# Against the quintic written out in float64, relative to the result's largest entry. Measured
# (torch 2.13, x86 CPU): fp32 at most 1.5e-6 over these shapes (fp32 rounding of 5 steps of
# three products; asserted 5e-6, as above); bf16 at most 2.5e-2 (asserted 0.08: bf16 keeps 8
# bits, and the iteration does not contract rounding errors at Keller's coefficients).
QUINTIC_SHAPES = [(24, 40), (40, 24), (17, 17), (3, 12, 30), (3, 30, 12), (2, 1, 9)]


@pytest.mark.parametrize("shape", QUINTIC_SHAPES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 5e-6), (torch.bfloat16, 0.08)])
def test_matches_the_quintic_written_out(
    shape: tuple[int, ...], dtype: torch.dtype, tol: float
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(6)) * 3.0
    first = (1.875, -1.25, 0.375)  # the classic quintic (15 s - 10 s^3 + 3 s^5) / 8
    got = hp_kernels.newton_schulz(x, steps=5, coefficients=[first, KELLER], dtype=dtype)
    want = _quintic_float64(x, [first] + [KELLER] * 4)
    assert got.dtype == dtype
    assert got.shape == x.shape
    error = (got.double() - want).abs().max().item() / want.abs().max().item()
    assert error < tol, error


def test_zero_matrices_stay_zero() -> None:
    # The norm's clamp at eps keeps an all-zero matrix (a parameter with no gradient yet)
    # from dividing 0 by 0.
    x = torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(7))
    x[1] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        got = hp_kernels.newton_schulz(x, dtype=dtype)
        assert torch.isfinite(got).all()
        assert torch.equal(got[1], torch.zeros(8, 12, dtype=dtype))
        two_d = hp_kernels.newton_schulz(torch.zeros(12, 8), dtype=dtype)
        assert torch.equal(two_d, torch.zeros(12, 8, dtype=dtype))


def test_schedule_repeats_its_last_triple() -> None:
    x = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(3))
    schedule = [(4.0, -3.0, 0.5), KELLER]
    got = hp_kernels.newton_schulz(x, steps=4, coefficients=schedule, dtype=torch.bfloat16)
    want = reference.newton_schulz(
        x, [4.0] + [KELLER[0]] * 3, [-3.0] + [KELLER[1]] * 3, [0.5] + [KELLER[2]] * 3, 1e-7
    )
    assert bit_equal(got, want)
    zero_steps = hp_kernels.newton_schulz(x, steps=0, dtype=torch.bfloat16)
    torch.testing.assert_close(
        zero_steps.float().norm(dim=(-2, -1)), torch.ones(2), atol=1e-2, rtol=0
    )


def test_input_is_not_modified() -> None:
    x = torch.randn(2, 6, 4).bfloat16()
    before = x.clone()
    hp_kernels.newton_schulz(x, dtype=torch.bfloat16)
    assert bit_equal(x, before)


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"takes \[m, n\] or \[B, m, n\], got shape \(5,\)"):
        hp_kernels.newton_schulz(torch.randn(5), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="use fewer than 100"):
        hp_kernels.newton_schulz(torch.randn(2, 3), steps=100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"one \(a, b, c\) triple or a non-empty sequence"):
        hp_kernels.newton_schulz(torch.randn(2, 3), coefficients=[(1.0, 2.0)], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        hp_kernels.newton_schulz(torch.randn(2, 3), steps=-1, dtype=torch.bfloat16)


def test_fake_tensors_keep_shape_and_strides() -> None:
    real_wide = hp_kernels.newton_schulz(torch.randn(3, 4, 6), dtype=torch.bfloat16)
    real_tall = hp_kernels.newton_schulz(torch.randn(3, 6, 4), dtype=torch.bfloat16)
    with FakeTensorMode():
        wide = hp_kernels.newton_schulz(torch.empty(3, 4, 6), dtype=torch.bfloat16)
        tall = hp_kernels.newton_schulz(torch.empty(3, 6, 4), dtype=torch.bfloat16)
    assert (wide.shape, wide.stride(), wide.dtype) == (
        real_wide.shape,
        real_wide.stride(),
        torch.bfloat16,
    )
    assert (tall.shape, tall.stride()) == (real_tall.shape, real_tall.stride())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 4, 6), (2, 6, 4), (5, 7)])
def test_opcheck(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape)
    torch.library.opcheck(
        torch.ops.hp_kernels.newton_schulz.default,
        (x, [3.0, 2.0], [-3.0, -2.0], [1.0, 0.5], 1e-7, dtype),
    )


@pytest.mark.skipif(load_cpu_extension() is not None, reason="CPU extension not loaded")
def test_extension_direct_call_matches_reference() -> None:
    x = torch.randn(3, 20, 12)
    a, b, c = [KELLER[0]] * 5, [KELLER[1]] * 5, [KELLER[2]] * 5
    got = torch.ops.hp_kernels_cpu.newton_schulz(x, a, b, c, 1e-7)
    assert bit_equal(got, reference.newton_schulz(x, a, b, c, 1e-7))


# fp32 Newton-Schulz against the same iteration in float64, relative to the result's largest
# entry. Measured on these shapes (torch 2.13 CPU): 9.1e-7, 2.0e-6, 1.2e-6, 9.8e-7 (fp32
# rounding through 5 steps of three matmuls each); asserted 5e-6. bf16, for comparison:
# 1.5e-2 to 4.1e-2, four orders of magnitude further off.
FP32_VS_FLOAT64 = 5e-6


@pytest.mark.parametrize("shape", [(16, 16), (32, 8), (8, 64), (3, 12, 20)])
def test_fp32_iteration_is_within_its_bound_of_float64(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    exact = hp_kernels.newton_schulz(x.double(), dtype=torch.float64)
    got = hp_kernels.newton_schulz(x, dtype=torch.float32)
    bf16 = hp_kernels.newton_schulz(x, dtype=torch.bfloat16)
    assert got.dtype == torch.float32
    assert bf16.dtype == torch.bfloat16
    scale = exact.abs().max().item()
    error = (got.double() - exact).abs().max().item() / scale
    assert error < FP32_VS_FLOAT64, error
    assert (bf16.double() - exact).abs().max().item() / scale > 1000 * error


def test_hardware_choice_follows_the_capability() -> None:
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(4))
    chosen = hp_kernels.newton_schulz_dtype(x.device)
    expected = torch.float32 if hp_kernels.bf16_matmul_is_slow("cpu") else torch.bfloat16
    assert chosen == expected
    assert hp_kernels.newton_schulz(x, dtype=None).dtype == chosen


@pytest.mark.parametrize(("speed", "dtype"), [("slow", torch.float32), ("fast", torch.bfloat16)])
def test_the_default_dtype_follows_the_hardware(
    speed: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(5))
    monkeypatch.setenv(precision.ENV_VARIABLE, speed)
    precision.bf16_matmul_is_slow.cache_clear()
    try:
        default = hp_kernels.newton_schulz(x)
    finally:
        monkeypatch.undo()
        precision.bf16_matmul_is_slow.cache_clear()
    assert default.dtype == dtype
    assert bit_equal(default, hp_kernels.newton_schulz(x, dtype=dtype))


def test_bad_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="not a floating-point matmul dtype"):
        hp_kernels.newton_schulz(torch.randn(4, 4), dtype=torch.int32)

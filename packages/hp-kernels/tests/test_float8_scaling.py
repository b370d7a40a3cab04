"""Scale arithmetic of ``hp_kernels.float8``: dynamic scales from amax, delayed scales from an
amax history (largest magnitude, saturation, NaN kept visible), and ``dequantize_operand``.

Expected values are written out here (``amax / 448`` for e4m3, the history's newest-first
order, products of data and tile scales by explicit loops), not taken from the package.
"""

from __future__ import annotations

import math

import pytest
import torch

from hp_kernels.float8 import (
    Float8Format,
    Float8Linear,
    Float8LinearConfig,
    ScalingType,
    delayed_scale,
    dequantize_operand,
    push_amax,
    quantize_blockwise_2d,
    quantize_tensorwise,
    scale_from_amax,
)

E4M3, E5M2 = Float8Format.E4M3, Float8Format.E5M2
TINY = torch.finfo(torch.float32).smallest_normal
DELAYED = Float8LinearConfig(
    input_scaling=ScalingType.DELAYED,
    weight_scaling=ScalingType.DELAYED,
    grad_output_scaling=ScalingType.DELAYED,
    amax_history_len=3,
)


def _f32(value: float) -> float:
    """``value`` rounded to fp32, as the package's fp32 scale arithmetic rounds it."""
    return float(torch.tensor(value, dtype=torch.float32))


def test_scale_from_amax_values() -> None:
    amax = torch.tensor([448.0, 3.0, 0.0, float("inf"), float("nan"), 2.0**-140])
    got = scale_from_amax(amax, E4M3).tolist()
    assert got[0] == 1.0
    assert got[1] == _f32(3.0 / 448.0)
    assert got[2] == 1.0  # an all-zero block keeps scale 1
    assert math.isnan(got[3])
    assert math.isnan(got[4])
    assert got[5] == TINY  # 2^-140 / 448 is below fp32's normal range: raised to it
    assert scale_from_amax(torch.tensor(57344.0), E5M2).item() == 1.0
    assert scale_from_amax(torch.tensor(7.0), E5M2).item() == _f32(7.0 / 57344.0)


def test_dynamic_scale_comes_from_the_largest_magnitude() -> None:
    # The largest magnitude is negative: it must map to -448 exactly, not saturate.
    x = torch.tensor([-6.0, 1.5, 3.0, 0.0])
    data, scale = quantize_tensorwise(x, E4M3)
    assert scale.item() == _f32(6.0 / 448.0)
    assert data.float().tolist() == [-448.0, 112.0, 224.0, 0.0]
    data, scales = quantize_blockwise_2d(torch.tensor([[1.0, -8.0], [0.5, 2.0]]), E5M2, (1, 2))
    assert scales.flatten().tolist() == [_f32(8.0 / 57344.0), _f32(2.0 / 57344.0)]
    assert data.float()[0, 1].item() == -57344.0


def test_delayed_scale_bootstrap_history_and_nan() -> None:
    amax = torch.tensor(2.0)
    # An all-zero history (first call): the tensor's own amax.
    assert delayed_scale(torch.zeros(3), amax, E4M3).item() == _f32(2.0 / 448.0)
    # Otherwise the history's maximum, whatever this call's amax.
    history = torch.tensor([0.5, 4.0, 1.0])
    assert delayed_scale(history, torch.tensor(100.0), E4M3).item() == _f32(4.0 / 448.0)
    # A NaN or inf anywhere in the history gives a NaN scale: never hidden by the bootstrap.
    for bad in (float("nan"), float("inf")):
        for where in range(3):
            history = torch.zeros(3)
            history[where] = bad
            assert math.isnan(delayed_scale(history, amax, E4M3).item()), (bad, where)


def test_push_amax_is_newest_first_and_drops_the_oldest() -> None:
    history = torch.zeros(3)
    for value in (1.0, 2.0):
        push_amax(history, torch.tensor(value))
    assert history.tolist() == [2.0, 1.0, 0.0]
    for value in (3.0, 4.0):
        push_amax(history, torch.tensor(value))
    assert history.tolist() == [4.0, 3.0, 2.0]


def test_delayed_scaling_history_holds_magnitudes() -> None:
    # The weight is -I and every input's largest magnitude is negative: the histories must hold
    # |x|, |W| and |grad_output|, and the second call saturates at the first call's magnitude.
    lin = Float8Linear(4, 4, bias=False, config=DELAYED)
    with torch.no_grad():
        lin.weight.copy_(-torch.eye(4))
    x = torch.tensor([[-3.0, 0.75, 1.5, 0.0]])
    y = lin(x)
    assert y[0].tolist() == pytest.approx([3.0, -0.75, -1.5, 0.0], rel=1e-6)
    (y * -2.0).sum().backward()
    assert lin.get_buffer("amax_history_input").tolist() == [3.0, 0.0, 0.0]
    assert lin.get_buffer("amax_history_weight").tolist() == [1.0, 0.0, 0.0]
    assert lin.get_buffer("amax_history_grad_output").tolist() == [2.0, 0.0, 0.0]
    # Scale from the history (3): -4 saturates to -3, so y = -x gives 3.
    y = lin(torch.tensor([[-4.0, 0.75, 0.0, 0.0]]))
    assert y[0].tolist() == pytest.approx([3.0, -0.75, 0.0, 0.0], rel=1e-6)
    assert lin.get_buffer("amax_history_input").tolist() == [4.0, 3.0, 0.0]


def test_delayed_scaling_keeps_a_nan_visible_for_the_history_length() -> None:
    lin = Float8Linear(4, 2, bias=False, config=DELAYED)
    finite = torch.ones(1, 4)
    poisoned = finite.clone()
    poisoned[0, 1] = float("nan")
    assert torch.isnan(lin(poisoned)).all()
    # Three more calls (history length 3) still see the NaN amax, then it drops out.
    for _ in range(3):
        assert torch.isnan(lin(finite)).all()
    assert torch.isfinite(lin(finite)).all()


def test_dequantize_operand_tensorwise_and_tiles() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g) * 10
    data, scale = quantize_tensorwise(x, E4M3)
    assert torch.equal(dequantize_operand(data, scale), data.float() * scale.item())
    # (2, 3) tiles over 5 x 7: short tiles at the bottom and right edges.
    data, scales = quantize_blockwise_2d(x, E5M2, (2, 3))
    assert scales.shape == (3, 3)
    expected = torch.empty(5, 7)
    for i in range(5):
        for j in range(7):
            expected[i, j] = data[i, j].float() * scales[i // 2, j // 3]
    assert torch.equal(dequantize_operand(data, scales, (2, 3)), expected)
    with pytest.raises(TypeError, match="fp8"):
        dequantize_operand(x, scale)
    with pytest.raises(ValueError, match="2-d"):
        dequantize_operand(data.reshape(-1), scale)
    with pytest.raises(ValueError, match="pass the block shape"):
        dequantize_operand(data, scales)

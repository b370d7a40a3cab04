"""``Float8Linear``: forward/backward against fp64 references with derived bounds, delayed
scaling, pre-quantized weights and state_dict compatibility."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_kernels.float8 import (
    Float8Format,
    Float8Linear,
    Float8LinearConfig,
    ScalingGranularity,
    ScalingType,
    expand_block_scales,
    matmul_error_bound,
    quantize_blockwise,
    quantize_blockwise_2d,
    quantize_tensorwise,
    roundtrip_error_bound,
)

TENSORWISE = Float8LinearConfig()
BLOCKWISE = Float8LinearConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=16)
E4M3_GRADS = Float8LinearConfig(grad_format=Float8Format.E4M3)
DELAYED = Float8LinearConfig(
    input_scaling=ScalingType.DELAYED,
    weight_scaling=ScalingType.DELAYED,
    grad_output_scaling=ScalingType.DELAYED,
    amax_history_len=3,
)


def _bound_of(t: torch.Tensor, fmt: Float8Format, block: tuple[int, int] | None) -> torch.Tensor:
    """Round-trip bound of ``t`` under the dynamic scaling Float8Linear applies to it."""
    if block is None:
        _, scale = quantize_tensorwise(t, fmt)
        return roundtrip_error_bound(t, scale, fmt)
    _, scales = quantize_blockwise_2d(t, fmt, block)
    return roundtrip_error_bound(t, expand_block_scales(scales, block, t.shape), fmt)


@pytest.mark.parametrize("config", [TENSORWISE, BLOCKWISE, E4M3_GRADS], ids=["tw", "bw", "e4m3g"])
def test_forward_and_backward_within_derived_bounds(config: Float8LinearConfig) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(72, 40)  # 72 and 40 are not multiples of 16: short blocks on the edges
    lin = Float8Linear.from_float(ref, config)
    x = torch.randn(3, 11, 72, requires_grad=True)
    g = torch.randn(3, 11, 40)  # loss = <y, g>, so grad_output == g exactly on both sides
    y = lin(x)
    (y * g).sum().backward()

    blockwise = config.granularity is ScalingGranularity.BLOCKWISE
    b = config.block_size
    act_block = (1, b) if blockwise else None
    w_block = (b, b) if blockwise else None
    x2, g2, w = x.detach().reshape(-1, 72), g.reshape(-1, 40), ref.weight.detach()
    ex = _bound_of(x2, config.forward_format, act_block)
    ew = _bound_of(w, config.forward_format, w_block)
    eg = _bound_of(g2, config.grad_format, act_block)

    y_ref = x2.double() @ w.double().t() + ref.bias.double()
    y_bound = matmul_error_bound(x2, ex, w.t(), ew.t())
    y_bound = y_bound + 2**-23 * (y_ref.abs() + y_bound)  # fp32 bias add
    assert ((y.detach().reshape(-1, 40).double() - y_ref).abs() <= y_bound).all()

    assert x.grad is not None
    assert ref.weight.grad is not None
    assert ref.bias.grad is not None
    gx_ref = g2.double() @ w.double()
    gx_bound = matmul_error_bound(g2, eg, w, ew)
    assert ((x.grad.reshape(-1, 72).double() - gx_ref).abs() <= gx_bound).all()
    gw_ref = g2.double().t() @ x2.double()
    gw_bound = matmul_error_bound(g2.t(), eg.t(), x2, ex)
    assert ((ref.weight.grad.double() - gw_ref).abs() <= gw_bound).all()
    # grad_bias uses the unquantized grad_output: only fp32 summation error.
    gb_ref = g2.double().sum(0)
    gb_bound = 33 * 2**-24 * g2.double().abs().sum(0)
    assert ((ref.bias.grad.double() - gb_ref).abs() <= gb_bound).all()


def _dequantized(t: torch.Tensor, fmt: Float8Format, block: tuple[int, int] | None) -> torch.Tensor:
    """fp64 value of ``t`` after the dynamic quantization Float8Linear applies to it."""
    if block is None:
        data, scale = quantize_tensorwise(t, fmt)
        return data.double() * scale.double()
    data, scales = quantize_blockwise_2d(t, fmt, block)
    return data.double() * expand_block_scales(scales, block, t.shape).double()


@pytest.mark.parametrize("config", [TENSORWISE, BLOCKWISE, E4M3_GRADS], ids=["tw", "bw", "e4m3g"])
def test_matches_explicit_quantize_dequantize_reference(config: Float8LinearConfig) -> None:
    # The worst-case bounds above are loose by design (they allow every rounding error to
    # line up); this pins the computation itself: the same quantized operands multiplied in
    # fp64 agree with Float8Linear to fp32 accumulation error. Measured (torch 2.13, x86 CPU,
    # the same on every run): at most 2.2 units of 2**-24 (|operands| + |result|) over the three
    # configs and outputs; asserted at 8 (3.6x, for another CPU's summation order).
    torch.manual_seed(1)
    ref = nn.Linear(40, 24)
    lin = Float8Linear.from_float(ref, config)
    x = torch.randn(33, 40, requires_grad=True)
    g = torch.randn(33, 24)
    y = lin(x)
    (y * g).sum().backward()
    b = config.block_size
    blockwise = config.granularity is ScalingGranularity.BLOCKWISE
    act, wb = ((1, b), (b, b)) if blockwise else (None, None)
    xq = _dequantized(x.detach(), config.forward_format, act)
    wq = _dequantized(ref.weight.detach(), config.forward_format, wb)
    gq = _dequantized(g, config.grad_format, act)
    tol = 8 * 2**-24
    expected = {
        "y": (y.detach(), xq @ wq.t() + ref.bias.double(), xq.abs() @ wq.abs().t()),
        "grad_input": (x.grad, gq @ wq, gq.abs() @ wq.abs()),
        "grad_weight": (ref.weight.grad, gq.t() @ xq, gq.abs().t() @ xq.abs()),
    }
    for name, (got, want, scale) in expected.items():
        assert got is not None
        err = (got.double() - want).abs()
        assert (err <= tol * (scale + want.abs())).all(), name


def test_bf16_master_weight_and_dtypes() -> None:
    torch.manual_seed(0)
    lin = Float8Linear(32, 16, dtype=torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16
    assert lin.weight.dtype == torch.bfloat16
    assert lin.weight.grad is not None
    assert lin.weight.grad.dtype == torch.bfloat16
    assert lin.bias is not None
    assert lin.bias.grad is not None
    assert lin.bias.grad.dtype == torch.bfloat16
    assert x.grad is not None
    assert x.grad.dtype == torch.bfloat16
    # fp32 input with a bf16 master weight: the output follows the input.
    assert lin(torch.randn(2, 32)).dtype == torch.float32


def test_gradients_flow_only_where_required() -> None:
    lin = Float8Linear(8, 4, bias=False)
    x = torch.randn(5, 8)
    lin(x).sum().backward()
    assert lin.weight.grad is not None
    lin.weight.requires_grad_(False)
    x.requires_grad_(True)
    lin(x).sum().backward()
    assert x.grad is not None
    # Empty batch: zero-size output, zero weight gradient.
    lin.weight.requires_grad_(True)
    lin.zero_grad(set_to_none=True)
    out = lin(torch.empty(0, 8))
    out.sum().backward()
    assert out.shape == (0, 4)
    grad = lin.weight.grad
    assert grad is not None
    assert torch.equal(grad, torch.zeros(4, 8))


def test_delayed_scaling_history_order() -> None:
    # Identity weight, so the output is the quantized input: saturation is visible directly.
    lin = Float8Linear(4, 4, bias=False, config=DELAYED)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(4))
    hist_x = lin.get_buffer("amax_history_input")
    hist_g = lin.get_buffer("amax_history_grad_output")

    def step(values: list[float], grad_scale: float) -> torch.Tensor:
        x = torch.tensor([values])
        y = lin(x)
        (y * grad_scale).sum().backward()
        row: torch.Tensor = y.detach()[0]
        return row

    # Step 1: empty history -> bootstrap from the input's own amax; no saturation.
    y = step([1.0, -0.5, 0.25, 0.0], 2.0)
    assert y.tolist() == pytest.approx([1.0, -0.5, 0.25, 0.0], rel=1e-6)
    assert hist_x.tolist() == [1.0, 0.0, 0.0]
    assert hist_g.tolist() == [2.0, 0.0, 0.0]  # grad_output history is pushed in backward
    # Step 2: amax 4 but the scale comes from the history (1.0): 4 saturates to 1.
    y = step([4.0, -0.5, 0.25, -3.0], 1.0)
    assert y.tolist() == pytest.approx([1.0, -0.5, 0.25, -1.0], rel=1e-6)
    assert hist_x.tolist() == [4.0, 1.0, 0.0]
    assert hist_g.tolist() == [1.0, 2.0, 0.0]
    # Steps 3-5: the 4.0 stays in the history (length 3) for three more calls, then drops out.
    for expect in ([0.5, 4.0, 1.0], [0.5, 0.5, 4.0], [0.5, 0.5, 0.5]):
        y = step([0.5, 0.0, 0.0, 0.0], 1.0)
        assert hist_x.tolist() == expect
    # Scale now from max(0.5, 0.5, 0.5): 0.75 saturates to 0.5.
    y = step([0.75, 0.0, 0.0, 0.0], 1.0)
    assert y[0] == pytest.approx(0.5, rel=1e-6)
    # The weight history saw the identity every call.
    assert lin.get_buffer("amax_history_weight").tolist() == [1.0, 1.0, 1.0]


def test_delayed_scaling_matches_dynamic_when_amax_is_steady() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    dyn = Float8Linear.from_float(ref, TENSORWISE)
    dly = Float8Linear.from_float(ref, DELAYED)
    x = torch.randn(4, 16)
    for _ in range(3):
        assert torch.equal(dyn(x), dly(x))


def test_state_dict_compatible_with_nn_linear() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(8, 4)
    for config in (TENSORWISE, DELAYED):
        lin = Float8Linear.from_float(ref, config)
        assert list(lin.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
        plain = nn.Linear(8, 4)
        plain.load_state_dict(lin.state_dict())
        assert torch.equal(plain.weight, ref.weight)
        fresh = Float8Linear(8, 4, config=config)
        fresh.load_state_dict(ref.state_dict())
        assert torch.equal(fresh.weight, ref.weight)


def test_from_float_shares_parameters() -> None:
    ref = nn.Linear(8, 4)
    lin = Float8Linear.from_float(ref)
    assert lin.weight is ref.weight
    assert lin.bias is ref.bias
    assert lin.config == Float8LinearConfig()
    nobias = Float8Linear.from_float(nn.Linear(8, 4, bias=False))
    assert "bias" not in dict(nobias.named_parameters())
    nobias(torch.randn(2, 8)).sum().backward()


def test_prequantized_weight_tensorwise_is_consumed_once() -> None:
    torch.manual_seed(0)
    lin = Float8Linear(32, 8)
    x = torch.randn(4, 32)
    expected = lin(x)
    data, scale = quantize_tensorwise(lin.weight.detach(), Float8Format.E4M3)
    # Same bytes as the module's own quantization -> bit-identical output.
    lin.set_prequantized_weight(data, scale)
    assert torch.equal(lin(x), expected)
    # A different pre-quantized weight changes the output once, then the module re-quantizes.
    zeros, one = quantize_tensorwise(torch.zeros(8, 32), Float8Format.E4M3)
    lin.set_prequantized_weight(zeros, one)
    y = lin(x)
    assert lin.bias is not None
    assert torch.equal(y, lin.bias.detach().expand(4, 8))
    y.sum().backward()
    assert lin.weight.grad is not None  # the master weight still gets its gradient
    assert torch.equal(lin(x), expected)


def test_prequantized_weight_set_before_backward_replaces_the_saved_copy() -> None:
    torch.manual_seed(0)
    lin = Float8Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    data, scale = quantize_tensorwise(lin.weight.detach(), Float8Format.E4M3)
    lin.set_prequantized_weight(data, scale)
    y = lin(x)
    # As after a reshard: the forward's bytes are gone, a re-gathered copy arrives.
    zeros, one = quantize_tensorwise(torch.zeros(8, 16), Float8Format.E4M3)
    lin.set_prequantized_weight(zeros, one)
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.zeros(4, 16))  # grad_input = gO @ (the new weight)
    assert lin._prequantized is None  # consumed by the backward
    x2 = x.detach().requires_grad_(True)
    lin(x2).sum().backward()  # the module's own quantized weight again
    assert x2.grad is not None
    assert x2.grad.abs().sum() > 0


@pytest.mark.parametrize("block_size", [8, 12])  # 8 divides in_features=32, 12 does not
def test_prequantized_weight_flat_blockwise(block_size: int) -> None:
    torch.manual_seed(0)
    lin = Float8Linear(32, 8, bias=False)
    x = torch.randn(4, 32, requires_grad=True)
    w = lin.weight.detach()
    data, scales = quantize_blockwise(w.reshape(-1), Float8Format.E4M3, block_size)
    lin.set_prequantized_weight(data, scales, block_size)
    y = lin(x)
    y.sum().backward()
    # Reference: x (tensorwise e4m3) times the dequantized flat-block weight.
    xd, xs = quantize_tensorwise(x.detach(), Float8Format.E4M3)
    wd = data.float() * scales.repeat_interleave(block_size)[: w.numel()]
    expected = (xd.float() * xs) @ wd.reshape(8, 32).t()
    assert torch.allclose(y, expected, rtol=1e-6, atol=1e-6)
    assert x.grad is not None
    assert lin.weight.grad is not None


def test_bad_prequantized_weight() -> None:
    lin = Float8Linear(8, 4)
    data, scale = quantize_tensorwise(torch.randn(4, 8), Float8Format.E4M3)
    with pytest.raises(TypeError, match="must be fp8"):
        lin.set_prequantized_weight(torch.randn(4, 8), scale)
    with pytest.raises(ValueError, match=r"expected \(4, 8\) or \(32,\)"):
        lin.set_prequantized_weight(data[:2], scale)
    with pytest.raises(ValueError, match="needs one scale"):
        lin.set_prequantized_weight(data, torch.ones(4))
    with pytest.raises(ValueError, match="need 4 scales, got 3"):
        lin.set_prequantized_weight(data.reshape(-1), torch.ones(3), 8)


def test_bad_config_and_input() -> None:
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        Float8LinearConfig(block_size=0)
    with pytest.raises(ValueError, match="amax_history_len"):
        Float8LinearConfig(amax_history_len=0)
    with pytest.raises(ValueError, match="needs granularity=TENSORWISE"):
        Float8LinearConfig(
            granularity=ScalingGranularity.BLOCKWISE, weight_scaling=ScalingType.DELAYED
        )
    with pytest.raises(TypeError, match="grad_format must be a Float8Format"):
        Float8LinearConfig(grad_format=torch.float8_e5m2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a Float8LinearConfig"):
        Float8Linear(4, 4, config="e4m3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expects input \[\.\.\., 4\]"):
        Float8Linear(4, 4)(torch.randn(2, 5))
    with pytest.raises(TypeError, match=r"needs an nn\.Linear"):
        Float8Linear.from_float(nn.Conv1d(1, 1, 1))  # type: ignore[arg-type]

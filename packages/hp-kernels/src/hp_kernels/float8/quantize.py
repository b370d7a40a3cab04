"""Tensorwise and blockwise FP8 quantization.

Convention: the stored scale multiplies, ``x ~= data.float() * scale`` (see
:mod:`hp_kernels.float8.formats`). All scale arithmetic runs in fp32; the rounding itself
is torch's cast to the fp8 dtype (round to nearest, ties to even) applied after dividing by
the scale in fp32 and clamping to ``+-fmt.max`` (the cast alone does not saturate
consistently across backends: e4m3fn has no infinity and e5m2 overflows to inf).

Dynamic scales: ``scale = amax / fmt.max`` per block (or per tensor); ``amax == 0`` gives
scale 1.0 (the block is all zeros and stays so). A scale that would underflow fp32's normal
range is raised to its smallest normal value so dividing by it never overflows.

Non-finite input: a block (or tensor) whose amax is not finite (it holds +-inf or NaN) gets
scale NaN, so the whole block dequantizes to NaN. The corruption stays visible downstream
(as an fp32 overflow would) and is never turned into finite numbers; checking for it would
need a device-to-host sync on every call, which the caller can do cheaply once, on the loss.
With a caller-supplied scale (tensorwise, e.g. delayed scaling) values are clamped to
``+-fmt.max * scale`` (so +-inf saturates) and NaN stays NaN.

Block layout: 1-d tensors use contiguous blocks of ``block_size`` elements, the last one
short when the length is not a multiple. 2-d tensors use ``(rows, cols)`` tiles, again with
short tiles at the bottom and right edges; scales have shape
``(ceil(M / rows), ceil(N / cols))``. The usual choice for ``y = x @ w.T`` is ``(1, 128)``
for activations (blocks along the contraction dim) and ``(128, 128)`` for weights (square, so
the same copy serves the forward and the transposed backward matmul).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from hp_kernels.float8.formats import Float8Format

__all__ = [
    "dequantize_blockwise",
    "dequantize_blockwise_2d",
    "dequantize_tensorwise",
    "expand_block_scales",
    "quantize_blockwise",
    "quantize_blockwise_2d",
    "quantize_tensorwise",
    "scale_from_amax",
]

_FP32_TINY = float(torch.finfo(torch.float32).tiny)


def _check_floating(x: Tensor, what: str) -> None:
    if not x.is_floating_point() or x.dtype in _FP8_DTYPES:
        raise TypeError(f"{what} must be a floating (non-fp8) tensor, got dtype {x.dtype}")


def _check_format(fmt: Float8Format) -> None:
    if not isinstance(fmt, Float8Format):
        raise TypeError(f"fmt must be a Float8Format (E4M3 or E5M2), got {fmt!r}")


def _check_fp8(data: Tensor) -> None:
    if data.dtype not in _FP8_DTYPES:
        raise TypeError(
            f"data must be float8_e4m3fn or float8_e5m2 (from a quantize_* call), got {data.dtype}"
        )


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def scale_from_amax(amax: Tensor, fmt: Float8Format) -> Tensor:
    """Dequantization scale(s) for the given absolute maxima: ``amax / fmt.max`` in fp32.

    ``amax == 0`` -> 1.0; a non-finite ``amax`` -> NaN (see the module docstring); a scale
    below fp32's smallest normal is raised to it.
    """
    amax = amax.float()
    scale = torch.clamp(amax / fmt.max, min=_FP32_TINY)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def _cast(y: Tensor, fmt: Float8Format) -> Tensor:
    """Saturate a scaled fp32 tensor to the format's range and round it into the fp8 dtype."""
    return torch.clamp(y, -fmt.max, fmt.max).to(fmt.dtype)


def quantize_tensorwise(
    x: Tensor, fmt: Float8Format, scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` (any shape) with one scale for the whole tensor.

    Returns ``(data, scale)``: ``data`` has ``x``'s shape and ``fmt.dtype``; ``scale`` is a
    0-d fp32 tensor with ``x ~= data.float() * scale``. When ``scale`` is None it comes from
    the amax of ``x`` (dynamic scaling); otherwise the given scale (a positive scalar
    tensor, e.g. from an amax history) is used and values beyond ``fmt.max * scale``
    saturate.
    """
    _check_floating(x, "x")
    _check_format(fmt)
    if scale is None:
        amax = x.detach().abs().amax() if x.numel() else x.new_zeros(())
        scale = scale_from_amax(amax, fmt)
    else:
        if scale.numel() != 1:
            raise ValueError(
                f"a tensorwise scale must hold one element, got shape {tuple(scale.shape)}"
            )
        scale = scale.detach().float().reshape(())
    data = _cast(x.detach().float() / scale, fmt)
    return data, scale


def dequantize_tensorwise(data: Tensor, scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`quantize_tensorwise`: ``(data.float() * scale).to(out_dtype)``."""
    _check_fp8(data)
    if scale.numel() != 1:
        raise ValueError(f"a tensorwise scale must hold one element, got {tuple(scale.shape)}")
    return (data.float() * scale.float().reshape(())).to(out_dtype)


def _tile(x: Tensor, block_shape: tuple[int, int]) -> Tensor:
    """View a 2-d fp32 tensor, zero-padded to whole tiles, as ``(R, rows, C, cols)``."""
    rows, cols = block_shape
    m, n = x.shape
    pad_m = _ceil_div(m, rows) * rows - m
    pad_n = _ceil_div(n, cols) * cols - n
    if pad_m or pad_n:
        # Zero padding never raises a block's amax, so scales are those of the real elements.
        x = F.pad(x, (0, pad_n, 0, pad_m))
    return x.reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols)


def _check_block_shape(block_shape: tuple[int, int]) -> tuple[int, int]:
    if (
        len(block_shape) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in block_shape)
        or min(block_shape) < 1
    ):
        raise ValueError(f"block_shape must be two positive ints, e.g. (1, 128); got {block_shape}")
    return int(block_shape[0]), int(block_shape[1])


def quantize_blockwise_2d(
    x: Tensor, fmt: Float8Format, block_shape: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Quantize a 2-d tensor with one dynamic scale per ``block_shape`` tile.

    Returns ``(data, scales)``: ``data`` has ``x``'s shape and ``fmt.dtype``; ``scales`` is
    fp32 of shape ``(ceil(M / rows), ceil(N / cols))`` and
    ``x ~= data.float() * expand_block_scales(scales, block_shape, x.shape)``.
    Edge tiles may be short.
    """
    _check_floating(x, "x")
    _check_format(fmt)
    rows, cols = _check_block_shape(block_shape)
    if x.dim() != 2:
        raise ValueError(f"quantize_blockwise_2d expects a 2-d tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    tiles = _tile(x.detach().float(), (rows, cols))
    if tiles.numel():
        amax = tiles.abs().amax(dim=(1, 3))
    else:
        amax = tiles.new_zeros((tiles.shape[0], tiles.shape[2]))
    scales = scale_from_amax(amax, fmt)
    data = _cast(tiles / scales[:, None, :, None], fmt)
    data = data.reshape(tiles.shape[0] * rows, tiles.shape[2] * cols)[:m, :n]
    return data.contiguous(), scales


def expand_block_scales(
    scales: Tensor, block_shape: tuple[int, int], shape: tuple[int, ...] | torch.Size
) -> Tensor:
    """Per-element scales (shape ``shape``) for 2-d tile ``scales`` of ``block_shape``."""
    rows, cols = _check_block_shape(block_shape)
    m, n = shape
    if tuple(scales.shape) != (_ceil_div(m, rows), _ceil_div(n, cols)):
        raise ValueError(
            f"scales of shape {tuple(scales.shape)} do not fit a {m}x{n} tensor in "
            f"{rows}x{cols} blocks; expected {(_ceil_div(m, rows), _ceil_div(n, cols))}"
        )
    full = scales.float().repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return full[:m, :n]


def dequantize_blockwise_2d(
    data: Tensor, scales: Tensor, block_shape: tuple[int, int], out_dtype: torch.dtype
) -> Tensor:
    """Inverse of :func:`quantize_blockwise_2d`."""
    _check_fp8(data)
    if data.dim() != 2:
        raise ValueError(f"expected 2-d data, got shape {tuple(data.shape)}")
    full = expand_block_scales(scales, block_shape, data.shape)
    return (data.float() * full).to(out_dtype)


def _check_block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def quantize_blockwise(x: Tensor, fmt: Float8Format, block_size: int) -> tuple[Tensor, Tensor]:
    """Quantize a 1-d tensor with one dynamic scale per ``block_size`` consecutive elements.

    ``x`` may have any length (empty allowed); the last block is short when the length is
    not a multiple of ``block_size``. Returns ``(data, scales)``: ``data`` has ``x``'s shape
    and ``fmt.dtype``; ``scales`` is fp32 of shape ``[ceil(n / block_size)]`` with
    ``x[i] ~= data[i].float() * scales[i // block_size]``. Values saturate to ``+-fmt.max``.
    """
    _check_floating(x, "x")
    block_size = _check_block_size(block_size)
    if x.dim() != 1:
        raise ValueError(
            f"quantize_blockwise expects a 1-d tensor, got shape {tuple(x.shape)}; "
            "flatten it first or use quantize_blockwise_2d"
        )
    data, scales = quantize_blockwise_2d(x.reshape(1, -1), fmt, (1, block_size))
    return data.reshape(-1), scales.reshape(-1)


def dequantize_blockwise(
    data: Tensor, scales: Tensor, block_size: int, out_dtype: torch.dtype
) -> Tensor:
    """Inverse of :func:`quantize_blockwise`: ``data[i].float() * scales[i // block_size]``."""
    _check_fp8(data)
    block_size = _check_block_size(block_size)
    if data.dim() != 1 or scales.dim() != 1:
        raise ValueError(
            f"expected 1-d data and scales, got {tuple(data.shape)} and {tuple(scales.shape)}"
        )
    if scales.numel() != _ceil_div(data.numel(), block_size):
        raise ValueError(
            f"{data.numel()} elements in blocks of {block_size} need "
            f"{_ceil_div(data.numel(), block_size)} scales, got {scales.numel()}"
        )
    out = dequantize_blockwise_2d(
        data.reshape(1, -1), scales.reshape(1, -1), (1, block_size), out_dtype
    )
    return out.reshape(-1)

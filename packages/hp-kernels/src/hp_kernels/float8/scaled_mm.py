"""Scaled FP8 matmul: ``(a_data * a_scale) @ (b_data * b_scale) + bias``.

Scales multiply (the package-wide convention). Each operand's scale is either tensorwise
(one element) or blockwise (a 2-d grid of tile scales; the tile shape must then be passed
explicitly, because ``ceil(n / block)`` does not determine ``block`` uniquely).

Backends, chosen from the operands' device:

* CUDA with FP8 tensor cores (compute capability >= 8.9) and tensorwise scales:
  ``torch._scaled_mm`` with fp32 output, then bias and the cast in high precision. It
  requires K and N to be multiples of 16 and not both operands in e5m2; other cases
  (and blockwise scales) use the emulation. **Not tested here** (CPU-only CI).
* NPU (Ascend, ``torch_npu``, imported only when an operand lives on ``npu``) with
  tensorwise scales: ``torch_npu.npu_quant_matmul`` with a per-token scale for ``a`` and a
  per-channel scale for ``b``. Chips whose kernel rejects FP8 inputs raise, and the call
  falls back to the emulation with a one-time warning. **Not tested here.**
* Everywhere else (CPU included, so CI exercises it): emulation. Both operands are
  dequantized to fp32, multiplied in fp32, the bias added in fp32, and the result cast to
  ``out_dtype``. Its error against an fp32 reference of the unquantized operands is bounded
  elementwise by ``sum_k ea_k |b_k| + |a_k| eb_k + ea_k eb_k`` (``ea``, ``eb`` the per-element
  round-trip bounds of :func:`hp_kernels.float8.roundtrip_error_bound`) plus fp32
  accumulation error; the tests assert exactly that.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hp_kernels.backends import warn_fallback
from hp_kernels.float8.quantize import expand_block_scales

__all__ = ["dequantize_operand", "scaled_mm"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_operand(
    data: Tensor, scale: Tensor, block_shape: tuple[int, int] | None = None
) -> Tensor:
    """fp32 value of a 2-d quantized operand (tensorwise or blockwise scale)."""
    if data.dtype not in _FP8_DTYPES:
        raise TypeError(f"operand data must be an fp8 tensor, got {data.dtype}")
    if data.dim() != 2:
        raise ValueError(f"operand data must be 2-d, got shape {tuple(data.shape)}")
    if block_shape is None:
        if scale.numel() != 1:
            raise ValueError(
                f"scale of shape {tuple(scale.shape)} is not tensorwise; pass the block shape "
                "it was quantized with (e.g. a_block_shape=(1, 128))"
            )
        return data.float() * scale.float().reshape(())
    return data.float() * expand_block_scales(scale, block_shape, data.shape)


def _is_tensorwise(scale: Tensor, block_shape: tuple[int, int] | None) -> bool:
    return block_shape is None and scale.numel() == 1


def _cuda_scaled_mm_ok(a: Tensor, b: Tensor) -> bool:
    if not a.is_cuda or not hasattr(torch, "_scaled_mm"):
        return False
    if torch.cuda.get_device_capability(a.device) < (8, 9):
        return False
    k, n = b.shape
    both_e5m2 = a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2
    return k % 16 == 0 and n % 16 == 0 and not both_e5m2


def _cuda_scaled_mm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor) -> Tensor:
    # cuBLASLt wants ``a`` row-major and ``b`` column-major.
    b_col = b.t().contiguous().t()
    out: Tensor = torch._scaled_mm(
        a.contiguous(),
        b_col,
        scale_a=a_scale.float().reshape(()),
        scale_b=b_scale.float().reshape(()),
        out_dtype=torch.float32,
    )
    return out


def _npu_scaled_mm(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor) -> Tensor | None:
    """Ascend quantized matmul, or None when this chip's kernel rejects FP8 operands."""
    import torch_npu  # only reached for tensors on an NPU

    try:
        out: Tensor = torch_npu.npu_quant_matmul(
            a,
            b,
            b_scale.float().reshape(1),
            pertoken_scale=a_scale.float().reshape(1).expand(a.shape[0]).contiguous(),
            output_dtype=torch.bfloat16,
        )
    except (RuntimeError, TypeError) as exc:
        # The emulation is scaled_mm's reference: reported once, like every hp-kernels fallback.
        warn_fallback(
            "float8.scaled_mm", "npu", f"torch_npu.npu_quant_matmul rejected FP8 operands ({exc})"
        )
        return None
    return out.float()


def scaled_mm(
    a_data: Tensor,
    a_scale: Tensor,
    b_data: Tensor,
    b_scale: Tensor,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
    *,
    a_block_shape: tuple[int, int] | None = None,
    b_block_shape: tuple[int, int] | None = None,
) -> Tensor:
    """``(a_data * a_scale) @ (b_data * b_scale) + bias`` cast to ``out_dtype``.

    ``a_data`` is ``[M, K]`` and ``b_data`` is ``[K, N]``, both fp8 (any mix of e4m3fn and
    e5m2). A scale with one element is tensorwise; a 2-d scale grid needs its tile shape in
    ``a_block_shape`` / ``b_block_shape`` (as given to
    :func:`hp_kernels.float8.quantize_blockwise_2d`). ``bias`` (``[N]``, any floating dtype)
    is added in fp32 before the final cast. See the module docstring for backends.
    """
    if a_data.dim() != 2 or b_data.dim() != 2 or a_data.shape[1] != b_data.shape[0]:
        raise ValueError(
            f"scaled_mm needs a [M, K] @ [K, N]; got {tuple(a_data.shape)} @ {tuple(b_data.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (b_data.shape[1],):
        raise ValueError(f"bias must have shape ({b_data.shape[1]},), got {tuple(bias.shape)}")
    out: Tensor | None = None
    tensorwise = _is_tensorwise(a_scale, a_block_shape) and _is_tensorwise(b_scale, b_block_shape)
    if tensorwise and a_data.numel() and b_data.numel():
        if _cuda_scaled_mm_ok(a_data, b_data):
            out = _cuda_scaled_mm(a_data, a_scale, b_data, b_scale)
        elif a_data.device.type == "npu":
            out = _npu_scaled_mm(a_data, a_scale, b_data, b_scale)
    if out is None:
        a = dequantize_operand(a_data, a_scale, a_block_shape)
        b = dequantize_operand(b_data, b_scale, b_block_shape)
        out = a @ b
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)

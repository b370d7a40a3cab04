"""FP8 formats and the round-trip error bound they imply.

Scale convention (used by every function in :mod:`hp_kernels.float8`): the stored scale
**multiplies**. A quantized pair ``(data, scale)`` represents ``data.float() * scale``;
quantizing divides by the scale, ``data = fp8(clamp(x / scale, -max, max))``. This is the
same convention as the ``scale_a``/``scale_b`` arguments of CUDA ``torch._scaled_mm``
(its "inverse scales"), so scales can be passed to the hardware kernel unchanged.

Error bound of one round trip (derivation)
------------------------------------------
Let ``m`` be the format's mantissa bits, ``e_min`` the exponent of its smallest normal
number (e4m3fn: m=3, e_min=-6; e5m2: m=2, e_min=-14) and ``y = x / s`` the scaled value.
Casting to the fp8 dtype rounds to nearest (ties to even), so for ``|y| <= max``:

* normal range, ``2^e <= |y| < 2^(e+1)`` with ``e >= e_min``: the spacing of representable
  values is ``2^(e-m)`` and rounding moves ``y`` by at most half of it,
  ``2^(e-m-1) <= 2^-(m+1) * |y|``;
* subnormal range, ``|y| < 2^e_min``: the spacing is the constant ``2^(e_min-m)``, so the
  error is at most the absolute floor ``2^(e_min-m-1)`` (e4m3: ``2^-10``, e5m2: ``2^-17``).
  This is half of the subnormal spacing ``2^-9`` / ``2^-16``; both cases together give
  ``|fp8(y) - y| <= max(2^-(m+1) * |y|, 2^(e_min-m-1))``.

Saturation (``y`` clamped to ``+-max``) only happens when the scale comes from the tensor's
own amax (then ``|y|`` exceeds ``max`` by fp32 rounding of ``x / s`` at most, an error of a
few fp32 ulps) or when a caller-supplied scale is too small (then the bound does not hold:
values beyond ``max * s`` are clipped to ``+-max * s`` by design).

Multiplying back by ``s`` scales the error, and the fp32 divide, the fp32 multiply and the
input's conversion to fp32 each add a relative error of at most ``u = 2^-24``. Hence, for
``|x| <= max * s``::

    |dequant(quant(x)) - x| <= max(2^-(m+1) |x|, 2^(e_min-m-1) s) (1 + 4u) + 4u |x| + 2^-149

(the last term covers an fp32 product that lands in fp32's own subnormal range). A final cast
to a narrower output dtype with unit roundoff ``u_o`` adds ``u_o * |result|``.
:func:`roundtrip_error_bound` evaluates exactly this expression elementwise.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

__all__ = ["Float8Format", "roundtrip_error_bound"]

# Unit roundoff of fp32, the precision every scale computation runs in.
_FP32_UNIT_ROUNDOFF = 2.0**-24
# Smallest positive fp32 subnormal: absolute floor of an fp32 product's rounding error.
_FP32_SUBNORMAL_FLOOR = 2.0**-149


class Float8Format(enum.Enum):
    """An FP8 storage format; the value is the name of the torch dtype."""

    E4M3 = "float8_e4m3fn"
    E5M2 = "float8_e5m2"

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype that stores this format."""
        dtype: torch.dtype = getattr(torch, self.value)
        return dtype

    @property
    def max(self) -> float:
        """Largest finite magnitude (448.0 for e4m3fn, 57344.0 for e5m2)."""
        return float(torch.finfo(self.dtype).max)

    @property
    def mantissa_bits(self) -> int:
        """Explicitly stored mantissa bits (3 for e4m3, 2 for e5m2)."""
        return 3 if self is Float8Format.E4M3 else 2

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value (2^-6 for e4m3fn, 2^-14 for e5m2)."""
        return float(torch.finfo(self.dtype).smallest_normal)

    @property
    def relative_error(self) -> float:
        """Bound on rounding error relative to ``|y|`` in the normal range: 2^-(m+1)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def absolute_error_floor(self) -> float:
        """Bound on rounding error in the subnormal range (in scaled units): half a subnormal
        step, 2^-10 for e4m3 and 2^-17 for e5m2."""
        return self.min_normal * 2.0 ** -(self.mantissa_bits + 1)


def roundtrip_error_bound(
    x: Tensor, scale: Tensor, fmt: Float8Format, out_dtype: torch.dtype = torch.float32
) -> Tensor:
    """Elementwise bound on ``|dequant(quant(x)) - x|`` (see the module docstring).

    ``scale`` must broadcast against ``x`` (expand block scales first, e.g. with
    :func:`hp_kernels.float8.expand_block_scales`). Returned in float64. Valid for elements
    with ``|x| <= fmt.max * scale``; elements beyond that saturate.
    """
    ax = x.detach().double().abs()
    s = scale.detach().double()
    u = _FP32_UNIT_ROUNDOFF
    rounding = torch.maximum(fmt.relative_error * ax, fmt.absolute_error_floor * s)
    bound = rounding * (1 + 4 * u) + 4 * u * ax + _FP32_SUBNORMAL_FLOOR
    if out_dtype != torch.float32:
        # One more rounding when the fp32 result is cast to the output dtype.
        u_out = float(torch.finfo(out_dtype).eps) / 2
        bound = bound + u_out * (ax + bound)
    return bound

"""Error bound of an emulated scaled matmul, for tests and for callers that must justify a
tolerance (e.g. a loss-curve comparison of FP8 against bf16 training)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["matmul_error_bound"]

_U32 = 2.0**-24
_U64 = 2.0**-53


def _gamma(k: int, u: float) -> float:
    # Classical bound on the relative rounding error of a length-k dot product, any order.
    return k * u / (1 - k * u)


def matmul_error_bound(
    a: Tensor, ea: Tensor, b: Tensor, eb: Tensor, out_dtype: torch.dtype = torch.float32
) -> Tensor:
    """Elementwise bound on ``|C - A @ B|`` for ``C = fl32(A' @ B')`` cast to ``out_dtype``.

    ``A`` is ``[M, K]``, ``B`` is ``[K, N]``; ``ea``/``eb`` bound ``|A' - A|``/``|B' - B|``
    elementwise (e.g. :func:`~hp_kernels.float8.roundtrip_error_bound` of each operand).
    Since ``A'B' - AB = Ea B + A Eb + Ea Eb``::

        |C - AB| <= ea|B| + |A|eb + ea eb + gamma_K(2^-24) (|A|+ea)(|B|+eb)
                    + gamma_K(2^-53) |A||B| + u_out (|A|+ea)(|B|+eb)

    where the ``gamma_K`` terms cover fp32 accumulation in ``C`` and fp64 accumulation in a
    reference ``A @ B`` computed in float64, and ``u_out`` (0 for fp32) the final cast.
    Everything is evaluated in float64.
    """
    a64, b64 = a.detach().double().abs(), b.detach().double().abs()
    ea64, eb64 = ea.detach().double(), eb.detach().double()
    k = a.shape[-1]
    hi = (a64 + ea64) @ (b64 + eb64)
    bound = ea64 @ b64 + a64 @ eb64 + ea64 @ eb64
    bound = bound + _gamma(k, _U32) * hi + _gamma(k, _U64) * (a64 @ b64)
    if out_dtype != torch.float32:
        bound = bound + float(torch.finfo(out_dtype).eps) / 2 * hi
    return bound

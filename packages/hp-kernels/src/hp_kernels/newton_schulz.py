"""Batched Newton-Schulz orthogonalization (Muon's zeroth power), ``[m, n]`` or ``[B, m, n]``.

The reference is ``torch.optim.Muon``'s op sequence (bf16, ``addmm``) for one matrix and the
same sequence with ``bmm``/``baddbmm`` for a batch. The CPU extension runs exactly that ATen op
sequence from C++ (no interpreter between ops), so on CPU it is bit-equal to the reference, and
a 2-D input is bit-equal to ``torch.optim.Muon``. bf16 in and out; the bf16 matmuls accumulate
in fp32 inside ATen's CPU and cuBLAS kernels. CUDA and NPU run the reference (no fused kernel
yet; the first call logs that once).

``dtype`` chooses the precision of the iteration: by default the hardware's choice
(``hp_kernels.precision.newton_schulz_dtype``: fp32 on CPUs without fast bf16 matmuls, where
bf16 runs tens of times slower; bf16 elsewhere), bf16 explicitly (``torch.optim.Muon``'s on
every machine), or fp32 explicitly: the same
op sequence in fp32, closer to the exact iteration (``tests/test_newton_schulz.py`` bounds it
against float64).

Registered as ``torch.ops.hp_kernels.newton_schulz`` with a fake implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import hp_kernels.reference as reference
from hp_kernels.backends import Native, cpu_extension_missing, pick
from hp_kernels.precision import newton_schulz_dtype

__all__ = ["MAX_STEPS", "newton_schulz"]

MAX_STEPS = 100
"""``torch.optim.Muon`` refuses this many steps or more; so does this op."""


def _cpu(
    x: torch.Tensor, a: list[float], b: list[float], c: list[float], eps: float
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.hp_kernels_cpu.newton_schulz(x, a, b, c, eps)
    return out


_NATIVE = {"cpu": Native("cpp-extension", cpu_extension_missing, _cpu)}


_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check(
    x: torch.Tensor, a: list[float], b: list[float], c: list[float], dtype: torch.dtype
) -> None:
    if dtype not in _DTYPES:
        raise ValueError(
            f"hp_kernels.newton_schulz: dtype {dtype} is not a floating-point matmul dtype; "
            f"use one of {_DTYPES}"
        )
    if x.dim() not in (2, 3):
        raise ValueError(
            f"hp_kernels.newton_schulz takes [m, n] or [B, m, n], got shape {tuple(x.shape)}"
        )
    if not (len(a) == len(b) == len(c)):
        raise ValueError(
            f"hp_kernels.newton_schulz: coefficient lists of lengths {len(a)}, {len(b)}, "
            f"{len(c)}; give one (a, b, c) per step"
        )
    if len(a) >= MAX_STEPS:
        raise ValueError(f"hp_kernels.newton_schulz: {len(a)} steps; use fewer than {MAX_STEPS}")


@torch.library.custom_op("hp_kernels::newton_schulz", mutates_args=())
def _newton_schulz_op(
    x: torch.Tensor,
    a: list[float],
    b: list[float],
    c: list[float],
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    _check(x, a, b, c, dtype)
    # Never an alias of x: the normalization's div always makes a new tensor.
    if dtype != torch.bfloat16:
        # The native kernels are bf16 ones; other dtypes run the reference sequence.
        return reference.newton_schulz(x, a, b, c, eps, dtype)
    kernel = pick("newton_schulz", x.device.type, _NATIVE)
    out: torch.Tensor = (kernel or reference.newton_schulz)(x, a, b, c, eps)
    return out


@_newton_schulz_op.register_fake
def _newton_schulz_fake(
    x: torch.Tensor,
    a: list[float],
    b: list[float],
    c: list[float],
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    _check(x, a, b, c, dtype)
    # The result keeps the input's orientation; a tall input's result is a transposed view.
    out = x.new_empty(x.shape, dtype=dtype)
    if x.size(-2) > x.size(-1):
        out = x.new_empty((*x.shape[:-2], x.size(-1), x.size(-2)), dtype=dtype).mT
    return out


def _schedule(
    steps: int, coefficients: Sequence[float] | Sequence[Sequence[float]]
) -> tuple[list[float], list[float], list[float]]:
    if steps < 0:
        raise ValueError(f"hp_kernels.newton_schulz: steps must be >= 0, got {steps}")
    items = list(coefficients)
    triples: list[tuple[float, ...]] = []
    if len(items) == 3 and all(isinstance(v, (int, float)) for v in items):
        triples = [tuple(float(v) for v in items if isinstance(v, (int, float)))] * steps
    elif items and all(isinstance(t, Sequence) and len(t) == 3 for t in items):
        given = [tuple(float(v) for v in t) for t in items if isinstance(t, Sequence)]
        # Steps beyond a schedule's end repeat its last triple (its fixed point).
        triples = [given[min(i, len(given) - 1)] for i in range(steps)]
    elif steps:
        raise ValueError(
            "hp_kernels.newton_schulz: coefficients must be one (a, b, c) triple or a "
            f"non-empty sequence of triples, got {coefficients!r}"
        )
    return [t[0] for t in triples], [t[1] for t in triples], [t[2] for t in triples]


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: Sequence[float] | Sequence[Sequence[float]] = (3.4445, -4.7750, 2.0315),
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Orthogonalize ``x`` (``[m, n]`` or a batch ``[B, m, n]``) by ``steps`` Newton-Schulz steps.

    Args:
        x: any float dtype; it is cast to ``dtype`` first and is not modified.
        steps: number of iterations (``0 <= steps < 100``).
        coefficients: one ``(a, b, c)`` for every step (default: ``torch.optim.Muon``'s), or a
            per-step schedule whose last triple repeats beyond its end.
        eps: lower clamp of each matrix's Frobenius norm before the iteration.
        dtype: the iteration's precision: None (the default) for
            ``hp_kernels.precision.newton_schulz_dtype`` of ``x``'s device (bf16, or fp32 on a
            CPU without fast bf16 matmuls), ``torch.bfloat16`` (on every machine; bit-equal to
            ``torch.optim.Muon`` for a 2-D input), or another float dtype.

    Returns:
        A tensor of ``dtype`` and ``x``'s shape. For a tall matrix it is a transposed view (the
        iteration runs on the wide orientation), as in ``torch.optim.Muon``.
    """
    a, b, c = _schedule(steps, coefficients)
    chosen = newton_schulz_dtype(x.device) if dtype is None else dtype
    out: torch.Tensor = torch.ops.hp_kernels.newton_schulz(x, a, b, c, float(eps), chosen)
    return out

"""Newton-Schulz orthogonalization, one matrix or a batch of same-shape matrices, in bf16 (the
default, ``torch.optim.Muon``'s) or another ``dtype`` (``Muon(ns_dtype=None)`` picks fp32 on
CPUs without fast bf16 matmuls, see :func:`default_dtype`).

For one matrix the op sequence is ``torch.optim.Muon``'s, so results are bit-equal to it: cast
to bf16, work on the transpose of a tall matrix (a view), divide by the Frobenius norm clamped
below by ``eps``, then per step ``A = X X^T``, ``B = b A + c A A`` and ``X = a X + B X`` with
``addmm``. A batch runs the same sequence with ``bmm``/``baddbmm`` over ``[B, m, n]``; batched
bf16 products run other kernels than per-matrix ones, so on CPU they agree with
``torch.optim.Muon`` to bf16 rounding, not always bit for bit (measured: a last-bit difference
in some steps of ``[2, 32, 16]`` and ``[2, 2048, 256]`` batches).

When hp-kernels is installed (``pip install hp-muon[kernels]``), both run through its
``newton_schulz`` op, which has a native kernel per backend and on CPU calls exactly this
ATen op sequence (its C++ kernel and its reference alike), so results stay bit-equal to the
code below and, for one matrix, to ``torch.optim.Muon``. Without hp-kernels the code below runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hp_muon.coefficients import Coefficients

_kernel: Callable[..., torch.Tensor] | None
_dtype_for: Callable[[torch.device], torch.dtype] | None
try:  # optional: per-backend kernels, same results on CPU
    from hp_kernels import newton_schulz as _kernel_op
    from hp_kernels import newton_schulz_dtype as _dtype_op
except ImportError:  # pragma: no cover - depends on what is installed
    _kernel, _dtype_for = None, None
else:
    _kernel, _dtype_for = _kernel_op, _dtype_op

__all__ = [
    "default_dtype",
    "orthogonalize",
    "orthogonalize_batch",
    "orthogonalize_counted",
    "orthogonalize_many",
    "uses_hp_kernels",
]


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype ``Muon(ns_dtype=None)`` runs Newton-Schulz in on ``device``: with hp-kernels,
    fp32 on a CPU without fast bf16 matmuls and bf16 elsewhere
    (``hp_kernels.newton_schulz_dtype``); without hp-kernels, bf16 (``torch.optim.Muon``'s)."""
    return _dtype_for(device) if _dtype_for is not None else torch.bfloat16


def uses_hp_kernels() -> bool:
    """Whether :func:`orthogonalize` and :func:`orthogonalize_batch` run hp-kernels' op."""
    return _kernel is not None


def orthogonalize(
    matrix: torch.Tensor,
    schedule: Sequence[Coefficients],
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The Newton-Schulz orthogonalization of a 2-D ``matrix`` in ``dtype`` (same shape).

    The input is not modified.
    """
    if matrix.dim() != 2:
        raise ValueError(f"orthogonalize takes a 2-D matrix, got shape {tuple(matrix.shape)}")
    if _kernel is not None:
        return _kernel(matrix, len(schedule), list(schedule), eps, dtype=dtype)
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for a, b, c in schedule:
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x


def orthogonalize_batch(
    batch: torch.Tensor,
    schedule: Sequence[Coefficients],
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """:func:`orthogonalize` of every matrix of a ``[B, m, n]`` batch, as one batched run."""
    if batch.dim() != 3:
        raise ValueError(f"orthogonalize_batch takes [B, m, n], got shape {tuple(batch.shape)}")
    if _kernel is not None:
        return _kernel(batch, len(schedule), list(schedule), eps, dtype=dtype)
    x = batch.to(dtype)
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.mT
    x = x.div(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    for a, b, c in schedule:
        gram = x @ x.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def orthogonalize_many(
    matrices: Sequence[torch.Tensor],
    schedule: Sequence[Coefficients],
    eps: float,
    *,
    fuse: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> list[torch.Tensor]:
    """Orthogonalize each of ``matrices`` (2-D) in ``dtype``; returns the results (of
    ``dtype``) in the same order.

    With ``fuse``, matrices of the same shape, or of transposed shapes, run as one batch
    (tall ones in their wide orientation); a matrix alone in its shape class runs through
    :func:`orthogonalize`. Empty matrices are returned as they are (bf16).
    """
    return orthogonalize_counted(matrices, schedule, eps, fuse=fuse, dtype=dtype)[0]


def orthogonalize_counted(
    matrices: Sequence[torch.Tensor],
    schedule: Sequence[Coefficients],
    eps: float,
    *,
    fuse: bool = True,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[list[torch.Tensor], int]:
    """:func:`orthogonalize_many`, and the number of Newton-Schulz runs it issued: calls of
    :func:`orthogonalize` (one matrix) and :func:`orthogonalize_batch` (one batch of a shape
    class). Unfused: one per non-empty matrix; fused: one per shape class (a shape and its
    transpose); empty matrices take none."""
    runs = 0
    out: list[torch.Tensor | None] = [None] * len(matrices)
    classes: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(matrices):
        if m.numel() == 0:
            out[i] = m.to(dtype)
        elif not fuse:
            out[i] = orthogonalize(m, schedule, eps, dtype)
            runs += 1
        else:
            rows, cols = m.shape
            classes.setdefault((min(rows, cols), max(rows, cols)), []).append(i)
    for members in classes.values():
        runs += 1
        if len(members) == 1:
            out[members[0]] = orthogonalize(matrices[members[0]], schedule, eps, dtype)
            continue
        shapes = {tuple(matrices[i].shape) for i in members}
        if len(shapes) == 1:
            # One orientation: stack as they are (orthogonalize_batch views tall ones as wide,
            # like the single-matrix path does).
            results = orthogonalize_batch(
                torch.stack([matrices[i].to(dtype) for i in members]), schedule, eps, dtype
            )
            for i, r in zip(members, results, strict=True):
                out[i] = r
            continue
        wide = [
            matrices[i] if matrices[i].size(0) <= matrices[i].size(1) else matrices[i].T
            for i in members
        ]
        stacked = torch.stack([w.to(dtype) for w in wide])
        results = orthogonalize_batch(stacked, schedule, eps, dtype)
        for i, r in zip(members, results, strict=True):
            out[i] = r if matrices[i].size(0) <= matrices[i].size(1) else r.T
    done = [o for o in out if o is not None]
    assert len(done) == len(out), "every matrix belongs to exactly one shape class"
    return done, runs

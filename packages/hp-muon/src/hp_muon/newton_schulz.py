"""Newton-Schulz orthogonalization in bf16, one matrix or a batch of same-shape matrices.

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
try:  # optional: per-backend kernels, same results on CPU
    from hp_kernels import newton_schulz as _kernel_op
except ImportError:  # pragma: no cover - depends on what is installed
    _kernel = None
else:
    _kernel = _kernel_op

__all__ = ["orthogonalize", "orthogonalize_batch", "orthogonalize_many", "uses_hp_kernels"]


def uses_hp_kernels() -> bool:
    """Whether :func:`orthogonalize` and :func:`orthogonalize_batch` run hp-kernels' op."""
    return _kernel is not None


def orthogonalize(
    matrix: torch.Tensor, schedule: Sequence[Coefficients], eps: float
) -> torch.Tensor:
    """The bf16 Newton-Schulz orthogonalization of a 2-D ``matrix`` (same shape, bf16).

    The input is not modified.
    """
    if matrix.dim() != 2:
        raise ValueError(f"orthogonalize takes a 2-D matrix, got shape {tuple(matrix.shape)}")
    if _kernel is not None:
        return _kernel(matrix, len(schedule), list(schedule), eps)
    x = matrix.bfloat16()
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
    batch: torch.Tensor, schedule: Sequence[Coefficients], eps: float
) -> torch.Tensor:
    """:func:`orthogonalize` of every matrix of a ``[B, m, n]`` batch, as one batched run."""
    if batch.dim() != 3:
        raise ValueError(f"orthogonalize_batch takes [B, m, n], got shape {tuple(batch.shape)}")
    if _kernel is not None:
        return _kernel(batch, len(schedule), list(schedule), eps)
    x = batch.bfloat16()
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
) -> list[torch.Tensor]:
    """Orthogonalize each of ``matrices`` (2-D); returns bf16 results in the same order.

    With ``fuse``, matrices of the same shape, or of transposed shapes, run as one batch
    (tall ones in their wide orientation); a matrix alone in its shape class runs through
    :func:`orthogonalize`. Empty matrices are returned as they are (bf16).
    """
    out: list[torch.Tensor | None] = [None] * len(matrices)
    classes: dict[tuple[int, int], list[int]] = {}
    for i, m in enumerate(matrices):
        if m.numel() == 0:
            out[i] = m.bfloat16()
        elif not fuse:
            out[i] = orthogonalize(m, schedule, eps)
        else:
            rows, cols = m.shape
            classes.setdefault((min(rows, cols), max(rows, cols)), []).append(i)
    for members in classes.values():
        if len(members) == 1:
            out[members[0]] = orthogonalize(matrices[members[0]], schedule, eps)
            continue
        shapes = {tuple(matrices[i].shape) for i in members}
        if len(shapes) == 1:
            # One orientation: stack as they are (orthogonalize_batch views tall ones as wide,
            # like the single-matrix path does).
            results = orthogonalize_batch(
                torch.stack([matrices[i].bfloat16() for i in members]), schedule, eps
            )
            for i, r in zip(members, results, strict=True):
                out[i] = r
            continue
        wide = [
            matrices[i] if matrices[i].size(0) <= matrices[i].size(1) else matrices[i].T
            for i in members
        ]
        results = orthogonalize_batch(torch.stack([w.bfloat16() for w in wide]), schedule, eps)
        for i, r in zip(members, results, strict=True):
            out[i] = r if matrices[i].size(0) <= matrices[i].size(1) else r.T
    done = [o for o in out if o is not None]
    assert len(done) == len(out), "every matrix belongs to exactly one shape class"
    return done

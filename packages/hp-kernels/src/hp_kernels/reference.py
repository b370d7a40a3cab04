"""Pure-PyTorch reference implementations: always available, the definition of every op.

Native kernels are tested against these (bit-equal for pack/unpack and for Newton-Schulz on
CPU) and are what an op runs when no native kernel is available or
``HP_KERNELS_FORCE_REFERENCE=1`` is set. Inputs are assumed already checked
(:mod:`hp_kernels._checks`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "newton_schulz",
    "pack",
    "unpack",
]


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    """``out[o:o + t.numel()] = t.flatten()`` for each tensor, cast with ``copy_``."""
    for t, offset in zip(tensors, offsets, strict=True):
        # A view of the destination in the source's shape: copy_ reads a non-contiguous
        # source as it is, with no intermediate contiguous copy.
        out.narrow(0, offset, t.numel()).view(t.shape).copy_(t)


def unpack(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """``t.copy_(flat[o:o + t.numel()].view(t.shape))`` for each output tensor."""
    for t, offset in zip(outs, offsets, strict=True):
        t.copy_(flat.narrow(0, offset, t.numel()).view(t.shape))


def newton_schulz(
    x: torch.Tensor,
    a: Sequence[float],
    b: Sequence[float],
    c: Sequence[float],
    eps: float,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Newton-Schulz orthogonalization in ``dtype`` (bf16 by default) of ``[m, n]`` or
    ``[B, m, n]``, one step per ``(a[i], b[i], c[i])``.

    A 2-D input runs ``torch.optim.Muon``'s op sequence (``addmm``), so it is bit-equal to it;
    a batch runs the same sequence with ``baddbmm``. Tall matrices work on their transpose.
    """
    y = x.to(dtype)
    tall = y.size(-2) > y.size(-1)
    if tall:
        y = y.mT
    if y.dim() == 2:
        y = y.div(y.norm().clamp(min=eps))
    else:
        y = y.div(y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
    for ai, bi, ci in zip(a, b, c, strict=True):
        gram = y @ y.mT
        if y.dim() == 2:
            update = torch.addmm(gram, gram, gram, beta=bi, alpha=ci)
            y = torch.addmm(y, update, y, beta=ai)
        else:
            update = torch.baddbmm(gram, gram, gram, beta=bi, alpha=ci)
            y = torch.baddbmm(y, update, y, beta=ai)
    return y.mT if tall else y


def all_gather_matmul(
    a_shard: torch.Tensor, b: torch.Tensor, gather_dim: int, group_name: str
) -> torch.Tensor:
    """``all_gather(a_shard, dim=gather_dim) @ b``: the gather, then one matmul."""
    full = funcol.all_gather_single(a_shard.contiguous(), gather_dim, GroupName(group_name))
    return torch.matmul(funcol.wait_tensor(full), b)


def matmul_reduce_scatter(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, reduce_op: str, group_name: str
) -> torch.Tensor:
    """``reduce_scatter(a @ b, reduce_op, dim=scatter_dim)``: one matmul, then the collective."""
    partial = torch.matmul(a, b)
    out = funcol.reduce_scatter_single(partial, reduce_op, scatter_dim, GroupName(group_name))
    done: torch.Tensor = funcol.wait_tensor(out)
    return done

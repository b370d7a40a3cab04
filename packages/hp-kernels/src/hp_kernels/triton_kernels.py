"""Triton kernels for CUDA tensors (imported only when a CUDA pack/unpack runs with Triton).

``copy_pairs`` copies many (source, destination) pairs with casts in one launch per dtype pair:
a table of source/destination addresses and lengths drives a grid of fixed-size blocks, so a
bucket of dozens of tensors costs a few launches instead of one ``copy_`` each. Triton's casts
round to nearest even, like ``copy_``.

NOT TESTED: the machines this package was developed on have no GPU and no Triton. The CPU
tests cover the reference these kernels must equal; run ``tests/test_pack.py`` on a CUDA
machine with Triton before relying on it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton  # type: ignore[import-not-found,unused-ignore]
import triton.language as tl  # type: ignore[import-not-found,unused-ignore]

__all__ = ["copy_pairs"]

_BLOCK = 4096

_TL_DTYPES: dict[torch.dtype, Any] = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _copy_blocks(
    src_addr: Any,
    dst_addr: Any,
    start_of_block: Any,
    len_of_block: Any,
    src_type: tl.constexpr,
    dst_type: tl.constexpr,
    block: tl.constexpr,
) -> None:
    pid = tl.program_id(0)
    src = tl.load(src_addr + pid).to(tl.pointer_type(src_type))
    dst = tl.load(dst_addr + pid).to(tl.pointer_type(dst_type))
    start = tl.load(start_of_block + pid)
    n = tl.load(len_of_block + pid)
    idx = tl.arange(0, block)
    mask = idx < n
    values = tl.load(src + start + idx, mask=mask)
    tl.store(dst + start + idx, values.to(dst_type), mask=mask)


def copy_pairs(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair; contiguous fp32/bf16/fp16 pairs in fused launches."""
    groups: dict[tuple[torch.dtype, torch.dtype], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for s, d in zip(srcs, dsts, strict=True):
        if s.numel() == 0:
            continue
        fits = s.dtype in _TL_DTYPES and d.dtype in _TL_DTYPES
        if fits and s.is_contiguous() and d.is_contiguous():
            groups.setdefault((s.dtype, d.dtype), []).append((s, d))
        else:
            d.copy_(s)
    for (sd, dd), pairs in groups.items():
        src_a: list[int] = []
        dst_a: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        for s, d in pairs:
            for start in range(0, s.numel(), _BLOCK):
                src_a.append(s.data_ptr())
                dst_a.append(d.data_ptr())
                starts.append(start)
                lens.append(min(_BLOCK, s.numel() - start))
        device = pairs[0][0].device
        table = torch.tensor([src_a, dst_a, starts, lens], dtype=torch.int64).to(device)
        _copy_blocks[(len(lens),)](
            table[0], table[1], table[2], table[3], _TL_DTYPES[sd], _TL_DTYPES[dd], block=_BLOCK
        )

"""Input checks of pack/unpack, shared by the real and the fake (meta) implementations.

Every error says what was wrong and what would be right; nothing is clipped or skipped.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = ["check_flat_layout"]


def check_flat_layout(
    op: str,
    flat: torch.Tensor,
    offsets: Sequence[int],
    tensors: Sequence[torch.Tensor],
    flat_name: str,
    tensors_name: str,
) -> None:
    """Check that ``tensors`` fit into the 1-D ``flat`` buffer at ``offsets`` without overlap.

    Raises ValueError naming the first offending tensor and the valid range.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"hp_kernels.{op}: {flat_name} must be a contiguous 1-D buffer, got shape "
            f"{tuple(flat.shape)} with strides {flat.stride()} (use buffer.view(-1) of a "
            "contiguous tensor)"
        )
    if len(offsets) != len(tensors):
        raise ValueError(
            f"hp_kernels.{op}: {len(tensors)} {tensors_name} but {len(offsets)} offsets; give "
            f"one offset per tensor"
        )
    size = flat.numel()
    spans: list[tuple[int, int, int]] = []
    for i, (t, offset) in enumerate(zip(tensors, offsets, strict=True)):
        if t.device != flat.device:
            raise ValueError(
                f"hp_kernels.{op}: {tensors_name}[{i}] is on {t.device} but {flat_name} is on "
                f"{flat.device}; all tensors must be on the buffer's device"
            )
        n = t.numel()
        if offset < 0 or offset + n > size:
            raise ValueError(
                f"hp_kernels.{op}: {tensors_name}[{i}] ({n} elements) at offset {offset} does "
                f"not fit in {flat_name} of {size} elements; its offset must be in "
                f"[0, {size - n}]"
                if n <= size
                else f"hp_kernels.{op}: {tensors_name}[{i}] has {n} elements, more than "
                f"{flat_name} ({size} elements); the buffer must hold every tensor"
            )
        if n:
            spans.append((offset, offset + n, i))
    spans.sort()
    for (_, end, i), (start, _, j) in itertools.pairwise(spans):
        if start < end:
            first, second = sorted((i, j))
            raise ValueError(
                f"hp_kernels.{op}: {tensors_name}[{first}] and {tensors_name}[{second}] overlap "
                f"in {flat_name} (elements [{start}, {end}) are claimed twice); each tensor "
                "needs its own range, e.g. offsets as the running sum of numels"
            )

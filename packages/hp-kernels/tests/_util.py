"""Helpers shared by the hp-kernels tests."""

from __future__ import annotations

import torch

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern as an integer tensor (compares -0.0/+0.0 and NaNs exactly)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def bit_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same dtype, shape and bits."""
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))

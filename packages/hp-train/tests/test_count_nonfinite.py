"""``count_nonfinite``: how many tensors hold a NaN or inf, screened by a fused 2-norm.

The oracle is ``isfinite().all()`` on each tensor, written here. Inputs where the screen could
go wrong: finite tensors whose 2-norm overflows (values of 1e20 in fp32: the norm is inf, the
tensor is finite), bf16 beside fp32 (two fused calls), empty tensors, None, integer tensors,
and NaN or inf alone in a large tensor.
"""

from __future__ import annotations

import pytest
import torch

from hp_train.observe.nonfinite import count_nonfinite


def _oracle(tensors: list[torch.Tensor | None]) -> int:
    return sum(1 for t in tensors if t is not None and not bool(torch.isfinite(t).all()))


def _with(value: float, dtype: torch.dtype, n: int = 1000) -> torch.Tensor:
    t = torch.randn(n).to(dtype)
    t[n // 3] = value
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_counts_what_elementwise_checks_count(dtype: torch.dtype) -> None:
    tensors: list[torch.Tensor | None] = [
        torch.randn(10).to(dtype),
        _with(float("nan"), dtype),
        None,
        torch.empty(0, dtype=dtype),
        _with(float("inf"), dtype),
        torch.full((64,), 1e20, dtype=dtype),  # finite; its 2-norm overflows
        _with(float("-inf"), torch.float32),
        torch.arange(5),  # integers: always finite
        torch.randn(3, 4, dtype=torch.float64),
    ]
    assert count_nonfinite(tensors) == _oracle(tensors) == 3
    assert count_nonfinite([t for t in tensors if t is None or bool(torch.isfinite(t).all())]) == 0
    assert count_nonfinite([]) == 0

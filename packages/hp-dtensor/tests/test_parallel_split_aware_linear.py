"""A linear that computes its own local product (``SplitAwareLinear``, e.g. an FP8 linear) under
column- and row-parallel plans in production mode: it is told its split before any forward
(the bounds of every rank's piece), the row-parallel forward calls its product with the bias on
tp coordinate 0 only, and the result is the unsplit model's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hp_dtensor.parallel.local_forwards import SplitAwareLinear
from hp_dtensor.parallel.plan import PlanError
from hp_layout import Mesh
from hp_testing import run_on_ranks


class _Recording(nn.Linear):
    """Records its split and how often its own product ran (the product is ``F.linear``)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.split: tuple[int, tuple[tuple[int, int], ...], int, int] | None = None
        self.reduced: float | None = None
        self.products = 0
        self.bias_given: list[bool] = []

    def set_tensor_parallel(
        self,
        group: Any,
        dim: int,
        bounds: Sequence[tuple[int, int]],
        index: int,
        reduce_max: Callable[[torch.Tensor], None],
    ) -> None:
        self.split = (dim, tuple(bounds), index, dist.get_world_size(group))
        # The reduction the module is handed is a max over the group.
        t = torch.tensor([float(dist.get_rank())])
        reduce_max(t)
        self.reduced = float(t)

    def linear_with_bias(self, input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.products += 1
        self.bias_given.append(bias is not None and bool(bias.detach().abs().sum() > 0))
        return F.linear(input, self.weight, bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.linear_with_bias(input, self.bias)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Recording(6, 10), _Recording(10, 5))


def _case() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    reference, model = _model(), _model()
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    parallelize_module(model, mesh, plan, mode="production", tp_axis="tp")
    col, row = model[0], model[1]
    assert isinstance(col, _Recording)
    assert isinstance(row, _Recording)
    splits = (col.split, row.split)  # told before any forward
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    y = model(x)
    want = reference(x)
    return {
        "reduced": (col.reduced, row.reduced),
        "splits": splits,
        "products": (col.products, row.products),
        "row_bias": row.bias_given,
        "error": float((y - want).abs().max()),
        "protocol": isinstance(row, SplitAwareLinear),
    }


def test_split_aware_linear_is_told_its_split_and_computes_its_product() -> None:
    results = run_on_ranks(2, _case, timeout=60)
    for rank, result in enumerate(results):
        assert result["protocol"]
        # 10 output features split in two (column-parallel), 10 input features (row-parallel).
        assert result["splits"] == (
            (0, ((0, 5), (5, 10)), rank, 2),
            (1, ((0, 5), (5, 10)), rank, 2),
        )
        assert result["products"] == (1, 1)
        assert result["reduced"] == (1.0, 1.0)  # the max of the ranks 0 and 1 each sent
        assert result["row_bias"] == [rank == 0]
        assert result["error"] < 1e-6


def _validation_case() -> str:
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    with pytest.raises(PlanError, match="validation mode") as raised:
        parallelize_module(_model(), mesh, plan, mode="validation", tp_axis="tp")
    return str(raised.value)


def test_validation_mode_refuses_a_split_aware_linear() -> None:
    """Validation mode would run the module's own product on DTensors: refused when planned."""
    for message in run_on_ranks(2, _validation_case, timeout=60):
        assert "ColwiseParallel cannot run _Recording" in message

"""A row-parallel Linear with a bias, whose input needs no gradient: every tensor-parallel rank
must take part in the bias gradient's reduction (only coordinate 0 adds the bias in forward),
or the backward's collectives do not match across ranks."""

from __future__ import annotations

import torch
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hp_dtensor.parallel.equivalence import full_value
from hp_layout import Mesh
from hp_testing import run_on_ranks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 5))


def _case() -> float:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    reference, model = _model(), _model()
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    parallelize_module(model, mesh, plan, mode="production", tp_axis="tp")
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))  # no gradient needed
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        assert q.grad is not None
        grad = full_value(p.grad, mesh, like=p).reshape(q.shape)
        worst = max(worst, float((grad - q.grad).abs().max() / q.grad.abs().max()))
    return worst


def test_rowwise_bias_gradient_without_input_gradient() -> None:
    for worst in run_on_ranks(2, _case, timeout=60):
        assert worst < 1e-6, worst

"""``assert_equivalent`` is itself an oracle (many tests trust it): it must see a difference.

A correct column-parallel plan passes; the same plan with a parallel loss that is off in value
only (a constant added), or in gradient only (``2 * loss - loss.detach()``: the same value,
twice the gradient), must raise, each naming the right error; the reported errors are the
differences computed here by hand.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel
from hp_dtensor.parallel.equivalence import assert_equivalent
from hp_layout import Mesh
from hp_testing import run_on_ranks


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 6, bias=False)
        self.down = nn.Linear(6, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.tanh(self.up(x)))
        return out


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


def _shifted(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return _loss(out, target) + 0.25


def _doubled_gradient(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = _loss(out, target)
    return 2 * loss - loss.detach()


def _check(which: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(3, 4, generator=g), torch.randint(0, 5, (3,), generator=g))]
    parallel_loss = {"same": _loss, "shifted": _shifted, "doubled": _doubled_gradient}[which]
    try:
        report = assert_equivalent(
            _Net,
            {"up": ColwiseParallel(), "down": RowwiseParallel()},
            mesh,
            batches,
            mode="production",
            tp_axis="tp",
            dp_axes=(),
            loss_fn=_loss,
            parallel_loss_fn=parallel_loss,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        )
    except AssertionError as exc:
        found = {k: re.search(rf"{k}_error=([-+.e0-9]+)", str(exc)) for k in ("loss", "grad")}
        return {"raised": True, **{k: float(m.group(1)) for k, m in found.items() if m}}
    return {"raised": False, "loss": report.loss_error, "grad": report.grad_error}


@pytest.mark.multiprocess
def test_assert_equivalent_passes_a_right_plan_and_names_a_wrong_one() -> None:
    same = run_on_ranks(2, _check, "same", timeout=120)[0]
    assert not same["raised"], same
    assert same["loss"] < 1e-6, same
    assert same["grad"] < 1e-5, same
    # A constant added to the loss: loss_error is 0.25 / max(|loss|, 1), the gradients equal.
    shifted = run_on_ranks(2, _check, "shifted", timeout=120)[0]
    assert shifted["raised"], shifted
    assert 0.25 / 3 < shifted["loss"] <= 0.25, shifted
    assert shifted["grad"] < 1e-5, shifted
    # Twice the gradient, the same loss: the difference is the gradient itself, 1.0 relative.
    doubled = run_on_ranks(2, _check, "doubled", timeout=120)[0]
    assert doubled["raised"], doubled
    assert doubled["loss"] < 1e-6, doubled
    assert abs(doubled["grad"] - 1.0) < 1e-5, doubled

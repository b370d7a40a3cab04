"""``run_plan`` (one step of a plan with a fresh schedule) and ``all_reduce_gradients`` in both
modes, at world 2, against a single-device step and sums written out here."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_mpmd import PipelineStage, StepResult, all_reduce_gradients, run_plan
from hp_mpmd.schedules import gpipe
from hp_testing import run_on_ranks

# Microbatching changes only the summation order (fp32); measured at most 6e-8 here.
TOL = 1e-6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)


def _on_rank() -> dict[str, object]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    x, y = _data()
    model = _model()
    stages = [nn.Sequential(model[0], model[1]), model[2]]
    result = run_plan(gpipe(2, 4), [PipelineStage(stages[rank], rank, 2)], x, y, F.mse_loss)
    grads = {n: p.grad.clone() for n, p in stages[rank].named_parameters() if p.grad is not None}
    out: dict[str, object] = {
        "losses": [float(v) for v in result.losses],
        "loss": None if result.loss is None else float(result.loss),
        "grads": grads,
    }
    # all_reduce_gradients over two replicas of the same stage: the weight's gradient is
    # rank + 1 everywhere; the bias has none (taken as zeros).
    for average in (False, True):
        replica = nn.Linear(2, 2)
        replica.weight.grad = torch.full((2, 2), float(rank + 1))
        world = dist.group.WORLD
        assert world is not None
        all_reduce_gradients([PipelineStage(replica, 0, 1)], world, average=average)
        assert replica.bias.grad is not None
        out[f"average={average}"] = (replica.weight.grad.clone(), replica.bias.grad.clone())
    return out


@pytest.mark.multiprocess
def test_run_plan_and_gradient_all_reduce() -> None:
    first, last = run_on_ranks(2, _on_rank, timeout=60)
    x, y = _data()
    ref = _model()
    with torch.no_grad():
        losses = [F.mse_loss(ref(xm), ym) for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True)]
    F.mse_loss(ref(x), y).backward()
    assert first["losses"] == []
    assert first["loss"] is None
    assert last["losses"] == pytest.approx([float(v) for v in losses], abs=TOL)
    assert last["loss"] == pytest.approx(sum(float(v) for v in losses) / 4, abs=TOL)
    names = {"0.weight": ref[0].weight, "0.bias": ref[0].bias}
    names_last = {"weight": ref[2].weight, "bias": ref[2].bias}
    for grads, expected in ((first["grads"], names), (last["grads"], names_last)):
        assert isinstance(grads, dict)
        assert set(grads) == set(expected)
        for name, param in expected.items():
            assert param.grad is not None
            torch.testing.assert_close(grads[name], param.grad, atol=TOL, rtol=0)
    for result in (first, last):
        for key, total in (("average=False", 3.0), ("average=True", 1.5)):  # 1 + 2, its mean
            reduced = result[key]
            assert isinstance(reduced, tuple)
            assert torch.equal(reduced[0], torch.full((2, 2), total))
            assert torch.equal(reduced[1], torch.zeros(2))
    assert StepResult().loss is None

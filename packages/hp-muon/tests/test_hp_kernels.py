"""hp-muon with hp-kernels installed: its Newton-Schulz runs hp-kernels' op, bit for bit the
same as hp-muon's own code (and, for one matrix, as ``torch.optim.Muon``)."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from hp_muon import KELLER, PRESETS, Muon
from hp_muon import newton_schulz as ns

hp_kernels = pytest.importorskip("hp_kernels")

EPS = 1e-7


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ns, "_kernel", None)


def test_hp_kernels_is_used() -> None:
    assert ns.uses_hp_kernels()


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (64, 64), (1, 9)])
@pytest.mark.parametrize("schedule", [(KELLER,) * 5, PRESETS["polar_express"], ()])
def test_matrix_bit_equal_to_own_code_and_torch(
    shape: tuple[int, int],
    schedule: tuple[tuple[float, float, float], ...],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    via_kernels = ns.orthogonalize(x, schedule, EPS)
    _own_code(monkeypatch)
    own = ns.orthogonalize(x, schedule, EPS)
    assert torch.equal(_bits(via_kernels), _bits(own))
    assert via_kernels.stride() == own.stride()
    if schedule and len(set(schedule)) == 1:
        torch_muon = _zeropower_via_newtonschulz(x, schedule[0], len(schedule), EPS)
        assert torch.equal(_bits(via_kernels), _bits(torch_muon))


@pytest.mark.parametrize("shape", [(3, 16, 40), (2, 40, 16), (4, 32, 32)])
def test_batch_bit_equal_to_own_code(
    shape: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    schedule = PRESETS["polar_express"]
    via_kernels = ns.orthogonalize_batch(x, schedule, EPS)
    _own_code(monkeypatch)
    own = ns.orthogonalize_batch(x, schedule, EPS)
    assert torch.equal(_bits(via_kernels), _bits(own))


def test_fused_many_bit_equal_to_own_code(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(2)
    matrices = [torch.randn(s, generator=g) for s in [(8, 24), (24, 8), (8, 24), (5, 5)]]
    schedule = (KELLER,) * 5
    via_kernels = ns.orthogonalize_many(matrices, schedule, EPS)
    _own_code(monkeypatch)
    own = ns.orthogonalize_many(matrices, schedule, EPS)
    for a, b in zip(via_kernels, own, strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_muon_step_bit_equal_to_torch_muon() -> None:
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(32, 16), (16, 48)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = Muon(params, lr=0.02, momentum=0.95, ns_dtype=torch.bfloat16)
    theirs = torch.optim.Muon(twins, lr=0.02, momentum=0.95)
    for _ in range(3):
        for p, q in zip(params, twins, strict=True):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    for p, q in zip(params, twins, strict=True):
        assert torch.equal(p.detach().view(torch.int32), q.detach().view(torch.int32))

"""``Muon(ns_dtype=...)``: the Newton-Schulz precision. bf16 is torch's; fp32 equals
``torch.optim.Muon`` with its Newton-Schulz iteration run in fp32 between bf16 input and output
(hp-muon moves Newton-Schulz inputs and results in bf16, the dtype torch's have; the rest of the
step unchanged), bit for bit; ``None`` (the default) follows ``hp_kernels.newton_schulz_dtype``:
fp32 where bf16 matmuls are slow, bf16 elsewhere."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.optim._muon as torch_muon

import hp_kernels.precision as precision
import hp_muon
from hp_muon.newton_schulz import default_dtype


def _fp32_zeropower(grad: torch.Tensor, ns_coefficients: Any, ns_steps: int, eps: float) -> Any:
    a, b, c = ns_coefficients
    x = grad.bfloat16().float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).bfloat16()


def _steps(make: Any, shape: tuple[int, int]) -> torch.Tensor:
    param = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    optimizer = make([param])
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        param.grad = torch.randn(shape, generator=g)
        optimizer.step()
    return param.detach().clone()


@pytest.mark.parametrize("shape", [(16, 24), (40, 8)])
def test_fp32_equals_torch_muon_with_fp32_newton_schulz(
    shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = _steps(lambda p: hp_muon.Muon(p, lr=0.02, ns_dtype=torch.float32), shape)
    bf16 = _steps(lambda p: hp_muon.Muon(p, lr=0.02, ns_dtype=torch.bfloat16), shape)
    torch_bf16 = _steps(lambda p: torch.optim.Muon(p, lr=0.02), shape)
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _fp32_zeropower)
    theirs = _steps(lambda p: torch.optim.Muon(p, lr=0.02), shape)
    assert torch.equal(ours, theirs)
    assert torch.equal(bf16, torch_bf16)  # an explicit bf16 is torch's on every machine
    assert not torch.equal(ours, bf16)


def test_none_follows_the_hardware() -> None:
    expected = default_dtype(torch.device("cpu"))
    chosen = _steps(lambda p: hp_muon.Muon(p, lr=0.02, ns_dtype=None), (16, 24))
    explicit = _steps(lambda p: hp_muon.Muon(p, lr=0.02, ns_dtype=expected), (16, 24))
    assert torch.equal(chosen, explicit)


@pytest.mark.parametrize(("speed", "dtype"), [("slow", torch.float32), ("fast", torch.bfloat16)])
def test_the_default_follows_the_hardware(
    speed: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(precision.ENV_VARIABLE, speed)
    precision.bf16_matmul_is_slow.cache_clear()
    try:
        default = _steps(lambda p: hp_muon.Muon(p, lr=0.02), (16, 24))
        explicit = _steps(lambda p: hp_muon.Muon(p, lr=0.02, ns_dtype=dtype), (16, 24))
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        differs = _steps(lambda p: hp_muon.Muon(p, lr=0.02, ns_dtype=other), (16, 24))
    finally:
        monkeypatch.undo()
        precision.bf16_matmul_is_slow.cache_clear()
    assert torch.equal(default, explicit)
    assert not torch.equal(default, differs)

"""OffloadedOptimizer: bit-equality with the unwrapped optimizer, pipeline order, state dicts."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from hp_offload import OffloadedOptimizer
from hp_offload.buckets import plan_buckets
from hp_offload.optimizer import MASTER_PARAMS_KEY

OptFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16, bias=False), nn.Tanh()]
    return nn.Sequential(*layers).to(dtype)


def _batches(n: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g).to(dtype) for _ in range(n)]


def _adamw(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


def _muon(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Muon(ps, lr=2e-2, momentum=0.9)


def _train(model: nn.Module, opt: torch.optim.Optimizer | OffloadedOptimizer, steps: int) -> None:
    for x in _batches(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


FACTORIES = [pytest.param(_adamw, id="adamw"), pytest.param(_muon, id="muon")]


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("stream", [False, True])
def test_bit_equal_to_unwrapped(factory: OptFactory, stream: bool) -> None:
    ref, off = _model(), _model()
    _train(ref, factory(list(ref.parameters())), 4)
    wrapped = OffloadedOptimizer(
        factory(list(off.parameters())), bucket_bytes=2 * 16 * 16 * 4, stream_parameters=stream
    )
    _train(off, wrapped, 4)
    for a, b in zip(ref.parameters(), off.parameters(), strict=True):
        assert torch.equal(a, b)
    stats = wrapped.last_step_stats
    assert stats is not None
    assert stats.buckets >= 2
    grads = 4 * 16 * 16 * 4 if stream else 0  # streamed gradients are not written back
    assert stats.h2d_bytes - grads == stats.d2h_bytes > 0
    per_param = 2 if factory is _adamw else 1  # exp_avg, exp_avg_sq / momentum_buffer
    assert stats.h2d_copies == 4 * per_param + (8 if stream else 0)  # + parameter and grad


def test_state_lives_on_host_buffers_and_moves() -> None:
    model = _model()
    opt = OffloadedOptimizer(_adamw(list(model.parameters())), bucket_bytes=1)
    _train(model, opt, 1)
    first = {id(p): opt.state[p]["exp_avg"] for p in model.parameters()}
    _train(model, opt, 1)
    for p in model.parameters():
        state = opt.state[p]
        assert state["exp_avg"] is first[id(p)]  # host buffers are reused in place
        assert state["step"].dim() == 0  # 0-dim tensors stay where the optimizer put them
        assert state["step"].item() == 2.0
    stats = opt.last_step_stats
    assert stats is not None
    assert stats.buckets == 4
    assert stats.h2d_bytes == 4 * 2 * 16 * 16 * 4  # exp_avg + exp_avg_sq of 4 matrices


def test_pipeline_order() -> None:
    model = _model()
    opt = OffloadedOptimizer(_muon(list(model.parameters())), bucket_bytes=1)
    _train(model, opt, 2)
    log = opt.event_log
    assert log[:3] == [("prefetch", 0), ("prefetch", 1), ("update", 0)]
    for n in range(4):
        assert log.index(("update", n)) < log.index(("writeback", n))
        if n + 1 < 4:  # n+1 is on its way before n updates
            assert log.index(("prefetch", n + 1)) < log.index(("update", n))
        if n + 2 < 4:  # at most three buckets on the device: n+2 comes after n-? releases
            assert log.index(("prefetch", n + 2)) > log.index(("update", n))
        if n > 0:  # n-1 is released after n updated
            assert log.index(("update", n)) < log.index(("release", n - 1))
    assert log[-1] == ("release", 3)


@pytest.mark.parametrize("factory", FACTORIES)
def test_state_dict_round_trip(factory: OptFactory) -> None:
    a, b = _model(), _model()
    opt_a = OffloadedOptimizer(factory(list(a.parameters())), bucket_bytes=1)
    _train(a, opt_a, 2)
    sd = opt_a.state_dict()
    plain = factory(list(_model().parameters()))
    assert set(sd) == set(plain.state_dict())  # the wrapped optimizer's own format
    b.load_state_dict(a.state_dict())
    opt_b = OffloadedOptimizer(factory(list(b.parameters())), bucket_bytes=10**6)
    opt_b.load_state_dict(copy.deepcopy(sd))
    _train(a, opt_a, 2)
    _train(b, opt_b, 2)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    # an unwrapped optimizer loads the wrapper's state dict
    c = _model()
    c.load_state_dict(b.state_dict())
    opt_c = factory(list(c.parameters()))
    opt_c.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    _train(b, opt_b, 1)
    _train(c, opt_c, 1)
    for pb, pc in zip(b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pb, pc)


def _reference_mixed(model: nn.Module, steps: int) -> None:
    """fp32 masters stepped by a plain AdamW, bf16 model receives the masters' cast."""
    masters = [nn.Parameter(p.detach().float()) for p in model.parameters()]
    opt = _adamw(masters)
    for x in _batches(steps, torch.bfloat16):
        model.zero_grad()
        model(x).float().square().mean().backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            assert p.grad is not None
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)


def test_master_params_bf16() -> None:
    ref, off = _model(dtype=torch.bfloat16), _model(dtype=torch.bfloat16)
    _reference_mixed(ref, 3)
    opt = OffloadedOptimizer(_adamw(list(off.parameters())), bucket_bytes=1, master_params=True)
    for x in _batches(3, torch.bfloat16):
        opt.zero_grad()
        off(x).float().square().mean().backward()
        opt.step()
    for a, b in zip(ref.parameters(), off.parameters(), strict=True):
        assert b.dtype == torch.bfloat16
        assert torch.equal(a, b)
        assert opt.master(b).dtype == torch.float32
        assert opt.state[b]["exp_avg"].dtype == torch.float32
    sd = opt.state_dict()
    assert len(sd[MASTER_PARAMS_KEY]) == 4
    other = _model(seed=5, dtype=torch.bfloat16)
    opt2 = OffloadedOptimizer(_adamw(list(other.parameters())), master_params=True)
    opt2.load_state_dict(sd)
    for a, b in zip(off.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.master(a), opt2.master(b))
        assert opt2.state[b]["exp_avg_sq"].dtype == torch.float32
    with pytest.raises(ValueError, match="no 'offload_master_params'"):
        opt2.load_state_dict(_adamw(list(other.parameters())).state_dict())


def test_clear_errors() -> None:
    model = _model()
    ps = list(model.parameters())
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        OffloadedOptimizer(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LBFGS"):
        OffloadedOptimizer(torch.optim.LBFGS(ps))
    with pytest.raises(ValueError, match="bucket_bytes"):
        OffloadedOptimizer(_adamw(ps), bucket_bytes=0)
    meta = nn.Parameter(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        OffloadedOptimizer(_adamw([*ps, meta]))
    with pytest.raises(ValueError, match="master_params needs floating"):
        OffloadedOptimizer(
            torch.optim.SGD([nn.Parameter(torch.zeros(3, dtype=torch.int64), False)]),
            master_params=True,
        )
    opt = OffloadedOptimizer(_adamw(ps))
    with pytest.raises(TypeError, match="closure"):
        opt.step(lambda: None)  # type: ignore[arg-type]
    _train(model, opt, 1)
    opt.state[ps[0]]["exp_avg"] = torch.zeros(16, 16, device="meta")
    with pytest.raises(ValueError, match="expected the host"):
        opt.step()
    with pytest.raises(ValueError, match="master_params=False"):
        opt.load_state_dict({**opt.state_dict(), MASTER_PARAMS_KEY: {}})


def test_plan_buckets() -> None:
    assert plan_buckets([("a", 3), ("b", 3), ("c", 10), ("d", 1)], 6) == [
        ["a", "b"],
        ["c"],
        ["d"],
    ]
    assert plan_buckets([], 1) == []
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([("a", 1)], 0)

"""offload_parameters: bit-equality with the resident model, prefetch order, movement, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_offload import OffloadedOptimizer, offload_parameters
from hp_testing.llama import Block, Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=16)
UNITS = 6  # embeddings, 3 blocks, norm, output


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(
        0, CONFIG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(step)
    )


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    ids = _ids(step)
    logits = model(ids)
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def _optimizers(model: nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-2)]
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [torch.optim.Muon(mats, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)]


def _train(model: nn.Module, opts: list[torch.optim.Optimizer], steps: int) -> None:
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        _loss(model, step).backward()
        for opt in opts:
            opt.step()


@pytest.mark.parametrize("kind", ["adamw", "muon"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_bit_equal_to_resident(kind: str, prefetch: int) -> None:
    ref, off = _llama(), _llama()
    _train(ref, _optimizers(ref, kind), 3)
    handle = offload_parameters(off, prefetch=prefetch)
    assert len(handle.units) == UNITS
    _train(off, _optimizers(off, kind), 3)
    for (name, a), b in zip(ref.named_parameters(), off.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert b.data_ptr() == handle.host_tensor(b).data_ptr()  # at rest on the host
    handle.remove()


def test_composes_with_offloaded_optimizer() -> None:
    ref, off = _llama(), _llama()
    _train(ref, _optimizers(ref, "adamw"), 3)
    offload_parameters(off, prefetch=1)
    opt = OffloadedOptimizer(
        torch.optim.AdamW(off.parameters(), lr=1e-2), bucket_bytes=8192, stream_parameters=True
    )
    for step in range(3):
        opt.zero_grad()
        _loss(off, step).backward()
        opt.step()
    for a, b in zip(ref.parameters(), off.parameters(), strict=True):
        assert torch.equal(a, b)


def test_gradient_accumulation() -> None:
    ref, off = _llama(), _llama()
    handle = offload_parameters(off, prefetch=1)
    for model in (ref, off):
        _loss(model, 0).backward()
        _loss(model, 1).backward()
    for a, b in zip(ref.parameters(), off.parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        assert torch.equal(a.grad, b.grad)
        assert b.grad.data_ptr() == handle._of_param[b].grad_buffers[b].data_ptr()


def _pos(log: list[tuple[str, int]], event: str, unit: int, start: int = 0) -> int:
    return log.index((event, unit), start)


def test_prefetch_order_and_movement() -> None:
    model = _llama()
    handle = offload_parameters(model, prefetch=1)
    seen: list[bool] = []
    block = model.layers[1]
    assert isinstance(block, Block)
    q_proj = block.attn.q_proj
    weight = q_proj.weight
    assert isinstance(weight, nn.Parameter)
    q_proj.register_forward_pre_hook(  # runs inside the unit's forward
        lambda m, a: seen.append(weight.data_ptr() != handle.host_tensor(weight).data_ptr())
    )
    handle.clear_log()
    handle.stats.reset()
    _loss(model, 0).backward()
    log = handle.event_log
    assert seen == [True]  # a separate device copy during its forward
    assert not [e for e in log if e[0] == "fetch"]  # no prefetch misses
    mid = _pos(log, "keep", UNITS - 1)  # end of forward
    for i in range(UNITS):  # forward: i+1 on its way before i computes; i released after
        if i + 1 < UNITS:
            assert _pos(log, "prefetch", i + 1) < _pos(log, "forward", i)
        if i + 1 < UNITS:
            assert _pos(log, "forward", i) < _pos(log, "release", i) < mid
    assert _pos(log, "forward", UNITS - 1) < mid
    for i in reversed(range(UNITS)):  # backward: i-1 on its way before i computes
        if i > 0:
            assert _pos(log, "backward", i) > _pos(log, "prefetch", i - 1, mid)
            assert _pos(log, "prefetch", i - 1, mid) < _pos(log, "backward", i - 1)
        assert _pos(log, "backward", i) < _pos(log, "offload_grads", i)
    nparams = len(list(model.parameters()))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kept = model.output.weight  # the last unit stays on the device into the backward
    # in for forward and again for backward, the last unit once
    assert handle.stats.h2d_copies == 2 * nparams - 1
    assert handle.stats.h2d_bytes == 2 * nbytes - kept.numel() * kept.element_size()
    assert handle.stats.d2h_copies == nparams  # gradients out
    # second pass without zero_grad: accumulated host gradients travel in for backward too
    handle.stats.reset()
    _loss(model, 1).backward()
    assert handle.stats.h2d_copies == 3 * nparams - 1


def test_on_demand_without_prefetch() -> None:
    model = _llama()
    handle = offload_parameters(model, prefetch=0)
    handle.clear_log()
    with torch.no_grad():
        model(_ids(0))
    log = handle.event_log
    assert [e for e in log if e[0] in ("fetch", "prefetch")] == [("fetch", i) for i in range(UNITS)]
    assert all(e[0] != "backward" for e in log)


def test_clear_errors() -> None:
    model = _llama()
    with pytest.raises(ValueError, match="prefetch"):
        offload_parameters(model, prefetch=-1)
    with pytest.raises(ValueError, match="must not share"):
        offload_parameters(model, units=[model.layers[0], *model.layers[0].children()])
    with pytest.raises(ValueError, match="belong to no unit"):
        offload_parameters(_llama(), units=list(_llama().layers))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    offload_parameters(tied)
    with pytest.raises(RuntimeError, match="ran twice"):
        tied[0](tied[0](torch.randn(2, 4)))

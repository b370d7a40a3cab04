"""swap_wrapper and save/swap/recompute combinations: bit-equal gradients, prefetch order,
buffer reuse, and what is (not) swapped. On the CPU the swap is a copy into pooled host
buffers, so every path but the streams runs here."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from hp_offload.checkpoint import checkpoint_wrapper
from hp_offload.memory import ActivationMeter
from hp_offload.policy import ATTENTION_OPS, MATMUL_OPS, ActivationPolicy
from hp_offload.swap import HostBufferPool, SwapGroup, SwappedTensor, Swapper, swap_wrapper
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=16, dropout=0.1
)

Result = tuple[list[torch.Tensor], list[torch.Tensor], ActivationMeter]


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


def _steps(model: nn.Module, steps: int = 2) -> Result:
    ids = torch.randint(
        0, CONFIG.vocab_size, (2, CONFIG.max_seq_len), generator=torch.Generator().manual_seed(3)
    )
    losses: list[torch.Tensor] = []
    meters: list[ActivationMeter] = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        with ActivationMeter(exclude=[*model.parameters(), *model.buffers()]) as meter:
            loss = model(ids).pow(2).mean()
            meter.reset_peak()  # peaks from here on include backward; forward peak is live now
            fwd = (meter.live, meter.live_host)
            loss.backward()
        assert meter.live == 0
        assert meter.live_host == 0
        meter.peak, meter.peak_host = fwd  # held across the forward/backward boundary
        losses.append(loss.detach())
        meters.append(meter)
    return losses, [p.grad.clone() for p in model.parameters() if p.grad is not None], meters[-1]


def _wrapped(wrap: Callable[[nn.Module], object]) -> Llama:
    model = _model()
    for layer in model.layers:
        wrap(layer)
    return model


def _assert_equal(a: Result, b: Result) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    assert len(a[1]) == len(b[1]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


@pytest.fixture(scope="module")
def plain() -> Result:
    return _steps(_model())


def test_swap_wrapper_bit_equal_and_moves_bytes_to_host(plain: Result) -> None:
    sw = Swapper(min_bytes=0)
    ours = _steps(_wrapped(lambda m: swap_wrapper(m, sw)))
    _assert_equal(ours, plain)
    # the layers' saved bytes moved to host; what stays is saved outside the layers
    assert ours[2].peak_host > 0
    assert ours[2].peak + ours[2].peak_host == plain[2].peak
    assert ours[2].peak < plain[2].peak / 5


def test_pool_reuses_buffers_across_steps() -> None:
    sw = Swapper(min_bytes=0)
    model = _wrapped(lambda m: swap_wrapper(m, sw))
    _steps(model, steps=1)
    allocations = sw.pool.allocations
    _steps(model, steps=2)
    assert sw.pool.allocations == allocations
    assert sw.pool.reuses >= 2 * allocations


def test_pool_keys_by_size_and_dtype() -> None:
    pool = HostBufferPool(pin_memory=False)
    a = pool.acquire(8, torch.uint8)
    pool.release(a)
    assert pool.acquire(8, torch.float32) is not a
    assert pool.acquire(8, torch.uint8) is a
    assert pool.allocations == 2
    assert pool.reuses == 1


def test_threshold_and_parameters_not_swapped(plain: Result) -> None:
    offloaded: list[torch.Tensor] = []

    class Spy(Swapper):
        def offload(self, t: torch.Tensor, group: SwapGroup) -> SwappedTensor:
            offloaded.append(t)
            return super().offload(t, group)

    sw = Spy(min_bytes=4096)
    model = _wrapped(lambda m: swap_wrapper(m, sw))
    _assert_equal(_steps(model), plain)
    params = {p.untyped_storage().data_ptr() for p in (*model.parameters(), *model.buffers())}
    assert offloaded
    assert all(t.numel() * t.element_size() >= 4096 for t in offloaded)
    assert not any(t.untyped_storage().data_ptr() in params for t in offloaded)
    nothing = Swapper(min_bytes=1 << 30)
    _assert_equal(_steps(_wrapped(lambda m: swap_wrapper(m, nothing))), plain)
    assert nothing.swapped_bytes == 0


def test_prefetch_runs_one_layer_ahead() -> None:
    events: list[tuple[str, int]] = []
    ids: dict[int, int] = {}

    class Spy(Swapper):
        def begin_group(self, module: nn.Module | None = None, inputs: object = ()) -> SwapGroup:
            group = super().begin_group(module, inputs)
            ids[id(group)] = len(ids)
            return group

        def fetch(self, group: SwapGroup) -> None:
            if not group.fetch_started:
                events.append(("fetch", ids[id(group)]))
            super().fetch(group)

        def get(self, packed: SwappedTensor) -> torch.Tensor:
            tag = ("get", ids[id(packed.record.group)])
            if not events or events[-1] != tag:
                events.append(tag)
            return super().get(packed)

    sw = Spy(min_bytes=0)
    _steps(_wrapped(lambda m: swap_wrapper(m, sw)), steps=1)
    first = {e: events.index(e) for e in reversed(events)}
    for i in range(CONFIG.n_layers):
        assert first[("fetch", i)] < first[("get", i)]
    for i in range(1, CONFIG.n_layers):  # layer i-1 is fetched before layer i's tensors are used
        assert first[("fetch", i - 1)] < first[("get", i)]


class _TorchSAC(nn.Module):
    def __init__(self, block: nn.Module, save_ops: list[torch._ops.OpOverload]) -> None:
        super().__init__()
        self.block = block
        self.context = functools.partial(create_selective_checkpoint_contexts, save_ops)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(
            self.block, *args, use_reentrant=False, context_fn=self.context
        )
        return out


@pytest.mark.parametrize(
    "policy",
    [
        ActivationPolicy.build(save=["attention"], swap=["matmul"]),
        ActivationPolicy.build(
            swap=["matmul", "attention"], save=["pointwise"], default="recompute"
        ),
        ActivationPolicy(default="swap"),
    ],
    ids=["save-attn-swap-mm", "swap-mm-attn-save-pointwise", "swap-all"],
)
def test_combination_bit_equal(plain: Result, policy: ActivationPolicy) -> None:
    sw = Swapper(min_bytes=0)
    ours = _steps(_wrapped(lambda m: checkpoint_wrapper(m, policy, swapper=sw)))
    _assert_equal(ours, plain)
    assert ours[2].peak_host > 0
    assert sw.swapped_bytes > 0


def test_combination_vs_torch_sac(plain: Result) -> None:
    """Swapping the matmuls torch's SAC saves: same gradients, fewer device bytes."""
    save_ops = sorted(MATMUL_OPS | ATTENTION_OPS, key=str)
    model = _model()
    model.layers = nn.ModuleList(_TorchSAC(b, save_ops) for b in model.layers)
    torch_sac = _steps(model)
    ours_save = _steps(
        _wrapped(
            lambda m: checkpoint_wrapper(m, ActivationPolicy.build(save=["matmul", "attention"]))
        )
    )
    sw = Swapper(min_bytes=0)
    policy = ActivationPolicy.build(save=["attention"], swap=["matmul"])
    ours_swap = _steps(_wrapped(lambda m: checkpoint_wrapper(m, policy, swapper=sw)))
    _assert_equal(torch_sac, plain)
    _assert_equal(ours_swap, torch_sac)
    assert ours_swap[2].peak < ours_save[2].peak
    assert ours_swap[2].peak + ours_swap[2].peak_host == ours_save[2].peak


def test_swap_min_bytes_in_policy_saves_small_outputs(plain: Result) -> None:
    sw = Swapper(min_bytes=0)
    policy = ActivationPolicy.build(swap=["matmul"], swap_min_bytes=1 << 30)
    ours = _steps(_wrapped(lambda m: checkpoint_wrapper(m, policy, swapper=sw)))
    _assert_equal(ours, plain)
    assert sw.swapped_bytes == 0
    assert ours[2].peak_host == 0


def test_errors() -> None:
    with pytest.raises(ValueError, match="min_bytes"):
        Swapper(min_bytes=-1)
    layer = swap_wrapper(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already wrapped"):
        swap_wrapper(layer)


class _SplitRows(nn.Module):
    """Rows split into uneven pieces, each through its own linear (an MoE layer's experts on
    their tokens): the pieces autograd saves are contiguous views of one larger storage."""

    def __init__(self, sizes: list[int], dim: int = 16) -> None:
        super().__init__()
        self.sizes = sizes
        self.experts = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = (x * 2).reshape(-1, x.shape[-1])
        pieces = rows.split(self.sizes, dim=0)
        return torch.cat([e(p) for e, p in zip(self.experts, pieces, strict=True)]).view_as(x)


def _split_run(sw: Swapper | None) -> tuple[torch.Tensor, list[torch.Tensor], ActivationMeter]:
    torch.manual_seed(0)
    layer = _SplitRows([3, 20, 9])  # 3 of 32 rows: a view of a storage 10x its size
    if sw is not None:
        swap_wrapper(layer, sw)
    x = torch.randn(2, 16, 16, requires_grad=True)
    with ActivationMeter(exclude=[*layer.parameters()]) as meter:
        loss = (layer(x) * 3).sum()
        held = (meter.live, meter.live_host)
        loss.backward()
    meter.peak, meter.peak_host = held
    assert x.grad is not None
    grads = [x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]
    return loss.detach(), grads, meter


def test_contiguous_pieces_of_a_larger_storage_are_swapped_alone() -> None:
    """Every piece goes to host memory by its own bytes, the small one too (together they
    are the split storage, copied once), and the gradients are bit-equal to the unwrapped
    layer's."""
    plain_loss, plain_grads, plain_meter = _split_run(None)
    sw = Swapper(min_bytes=0)
    loss, grads, meter = _split_run(sw)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert meter.peak == 0
    assert meter.peak_host == sw.swapped_bytes == 32 * 16 * 4
    assert plain_meter.peak == 32 * 16 * 4

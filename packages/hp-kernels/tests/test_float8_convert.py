"""``convert_to_float8``: module filter by fqn, parameter identity, and a short training run
of an FP8 MLP against fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_kernels.float8 import (
    Float8Linear,
    Float8LinearConfig,
    ScalingGranularity,
    ScalingType,
    convert_to_float8,
)


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(self.norm(x))))
        return out


class _Model(nn.Module):
    def __init__(self, dim: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.blocks = nn.Sequential(*[_Block(dim) for _ in range(depth)])
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        out: torch.Tensor = self.head(h)
        return out


def _float8_fqns(model: nn.Module) -> set[str]:
    return {fqn for fqn, mod in model.named_modules() if isinstance(mod, Float8Linear)}


def test_filter_swaps_exactly_the_selected_linears() -> None:
    model = _Model()
    params_before = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[str] = []

    def only_block_ups(mod: nn.Module, fqn: str) -> bool:
        seen.append(fqn)
        return fqn.endswith(".up") or fqn == "head"

    out = convert_to_float8(model, module_filter_fn=only_block_ups)
    assert out is model
    assert _float8_fqns(model) == {"blocks.0.up", "blocks.1.up", "head"}
    # The filter saw every plain nn.Linear, and nothing else (not attention's out_proj,
    # an nn.Linear subclass whose weight the attention module reads directly).
    assert sorted(seen) == sorted(
        ["embed", "blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "head"]
    )
    assert dict(model.named_parameters()) == params_before  # same Parameter objects
    # The optimizer built before conversion still updates the swapped modules' weights.
    before = model.head.weight.detach().clone()
    model(torch.randn(2, 3, 8)).sum().backward()
    optimizer.step()
    assert not torch.equal(model.head.weight, before)


def test_convert_all_and_config_is_applied() -> None:
    model = _Model()
    config = Float8LinearConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=8)
    convert_to_float8(model, config=config)
    swapped = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert len(swapped) == 6
    assert all(m.config is config for m in swapped)
    assert model(torch.randn(2, 3, 8)).shape == (2, 3, 1)
    # Converting twice is a no-op: Float8Linear is not a plain nn.Linear.
    assert len([m for m in convert_to_float8(model).modules() if isinstance(m, Float8Linear)]) == 6


def test_convert_root_linear_returns_the_new_module() -> None:
    lin = nn.Linear(4, 4)
    new = convert_to_float8(lin)
    assert isinstance(new, Float8Linear)
    assert new.weight is lin.weight
    assert convert_to_float8(nn.Linear(4, 4), module_filter_fn=lambda m, fqn: False).__class__ is (
        nn.Linear
    )


def test_convert_keeps_state_dict_keys() -> None:
    model = _Model()
    keys = list(model.state_dict())
    convert_to_float8(
        model,
        config=Float8LinearConfig(
            input_scaling=ScalingType.DELAYED, grad_output_scaling=ScalingType.DELAYED
        ),
    )
    assert list(model.state_dict()) == keys


def _train(model: nn.Module, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(8, 1, generator=g)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 4, 8, generator=g)
        target = torch.tanh(x @ w_true)
        loss = nn.functional.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# (config, bound on every 10-step window, bound on the last window). Measured (torch 2.13, x86
# CPU, the same on every run), worst window / last window: tensorwise 3.9% / 1.4%, blockwise
# 3.2% / 3.2%, delayed 8.8% / 3.3%. Asserted: 15% for every window (1.7-4.7x), and the last
# window at 5% (3.6x) tensorwise, 10% (3x) otherwise.
@pytest.mark.parametrize(
    ("config", "window_bound", "last_bound"),
    [
        (Float8LinearConfig(), 0.15, 0.05),
        (Float8LinearConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=16), 0.15, 0.10),
        (
            Float8LinearConfig(
                input_scaling=ScalingType.DELAYED,
                weight_scaling=ScalingType.DELAYED,
                grad_output_scaling=ScalingType.DELAYED,
            ),
            0.15,
            0.10,
        ),
    ],
    ids=["tensorwise", "blockwise", "delayed"],
)
def test_fp8_training_tracks_fp32(
    config: Float8LinearConfig, window_bound: float, last_bound: float
) -> None:
    # 60 AdamW steps, same data and init: the mean loss over each window of 10 steps stays
    # within window_bound (relative) of fp32's, the last window within last_bound, and both
    # runs make the same progress (last loss < 40% of the first). Single-step losses are
    # noisier (up to ~20% apart on this easy target), so they are not compared.
    torch.manual_seed(0)
    ref = _Model()
    fp8 = _Model()
    fp8.load_state_dict(ref.state_dict())
    convert_to_float8(fp8, config=config)
    ref_losses = _train(ref, 60, seed=1)
    fp8_losses = _train(fp8, 60, seed=1)
    rel = [
        abs(sum(fp8_losses[i : i + 10]) - sum(ref_losses[i : i + 10])) / sum(ref_losses[i : i + 10])
        for i in range(0, 60, 10)
    ]
    print([f"{r:.4f}" for r in rel])
    assert max(rel) < window_bound, rel
    assert rel[-1] < last_bound, rel
    assert fp8_losses[-1] < 0.4 * fp8_losses[0]
    assert ref_losses[-1] < 0.4 * ref_losses[0]

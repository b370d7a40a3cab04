"""hp-train's AdamW runs torch's multi-tensor (``foreach``) implementation on plain parameters,
and it trains exactly as torch's per-parameter loop does.

The reference is ``torch.optim.AdamW(foreach=False)`` with the trainer's settings (betas
(0.9, 0.95), weight decay), built here on a copy of the same model: after 5 steps on the same
gradients every parameter must be equal bit for bit (not within a tolerance: ``foreach`` runs
the same operations, only batched over the list). Both optimizer modes are checked (AdamW on
everything, and the AdamW half of Muon + AdamW), and a DTensor parameter keeps the loop
(hp-dtensor has no sharding rule for ``_foreach_*`` operations): any tensor subclass does.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hp_muon import ChainedOptimizer
from hp_train.config.schema import ModelConfig, TrainConfig
from hp_train.model.llama import Transformer
from hp_train.optim import adamw_foreach, build_optimizer

MODEL = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def _adamw_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, object]]:
    if isinstance(optimizer, ChainedOptimizer):
        return [
            g
            for o in optimizer.optimizers
            if isinstance(o, torch.optim.AdamW)
            for g in o.param_groups
        ]
    assert isinstance(optimizer, torch.optim.AdamW)
    return list(optimizer.param_groups)


@pytest.mark.parametrize("mode", ["adamw", "muon"])
def test_foreach_adamw_equals_the_per_parameter_loop(mode: str) -> None:
    torch.manual_seed(0)
    model = Transformer(MODEL)
    reference = copy.deepcopy(model)
    config = TrainConfig(steps=5, optimizer=mode, lr=1e-2, weight_decay=0.1, warmup_steps=0)
    optimizer = build_optimizer(model, config)
    groups = _adamw_groups(optimizer)
    assert groups
    assert all(g["foreach"] is True for g in groups), [g["foreach"] for g in groups]
    adamw_ids = {id(p) for g in groups for p in g["params"]}  # type: ignore[attr-defined]
    names = [n for n, p in model.named_parameters() if id(p) in adamw_ids]
    by_name = dict(reference.named_parameters())
    loop = torch.optim.AdamW(
        [by_name[n] for n in names],
        lr=1e-2,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        foreach=False,
    )
    g = torch.Generator().manual_seed(1)
    for _ in range(config.steps):
        for name, p in model.named_parameters():
            grad = torch.randn(p.shape, generator=g) * 1e-2
            p.grad = grad
            by_name[name].grad = grad.clone()
        optimizer.step()
        loop.step()
    for name in names:
        assert torch.equal(dict(model.named_parameters())[name], by_name[name]), name


class _Subclass(torch.Tensor):
    """A tensor subclass, as DTensors are: foreach ops would dispatch to it."""


def test_foreach_only_for_plain_tensors() -> None:
    plain = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2, 2))]
    assert adamw_foreach(plain)
    assert not adamw_foreach([])
    wrapped = nn.Parameter(torch.ones(3).as_subclass(_Subclass))
    assert not adamw_foreach([*plain, wrapped])

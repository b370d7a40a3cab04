"""A chain stepped in parts (an offload wrapper's buckets): a member whose groups a part left
empty is not stepped, and Muon declares that its step must see all its parameters at once."""

from __future__ import annotations

import copy

import torch
from torch import nn

from hp_muon import ChainedOptimizer, Muon
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=48, dim=16, n_layers=1, n_heads=2, ffn_dim=24, max_seq_len=8)


def _loss(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len + 1), generator=g)
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def test_member_with_empty_groups_is_not_stepped() -> None:
    """With Muon's groups emptied, the chain steps only AdamW: Muon's parameters, momentum and
    statistics stay as they were, and AdamW's parameters take torch's AdamW update (the oracle:
    torch.optim.AdamW stepped alone on a copy with the same gradients)."""
    torch.manual_seed(0)
    model = Llama(CONFIG)
    matrices = [p for p in model.parameters() if p.dim() == 2 and p.shape[0] != CONFIG.vocab_size]
    others = [p for p in model.parameters() if all(p is not m for m in matrices)]
    muon, adamw = Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=0.01)
    chain = ChainedOptimizer([muon, adamw])
    _loss(model).backward()
    chain.step()
    stats, runs = muon.last_step_stats, muon.newton_schulz_runs
    momentum = {id(p): muon.state[p]["momentum_buffer"].clone() for p in matrices}
    twin = copy.deepcopy(model)
    twin_others = [p for p in twin.parameters() if p.dim() != 2 or p.shape[0] == CONFIG.vocab_size]
    for p, q in zip(others, twin_others, strict=True):
        assert p.grad is not None
        q.grad = p.grad.clone()  # deepcopy leaves a leaf's gradient behind
    twin_adamw = torch.optim.AdamW(twin_others, lr=0.01)
    twin_adamw.load_state_dict(copy.deepcopy(adamw.state_dict()))
    before = [p.detach().clone() for p in matrices]
    adamw_before = [p.detach().clone() for p in others]
    full = [g["params"] for g in muon.param_groups]
    for g in muon.param_groups:
        g["params"] = []  # what an offload wrapper does in a bucket without Muon's parameters
    try:
        chain.step()
    finally:
        for g, ps in zip(muon.param_groups, full, strict=True):
            g["params"] = ps
    twin_adamw.step()
    assert muon.last_step_stats is stats
    assert muon.newton_schulz_runs == runs
    for p, b in zip(matrices, before, strict=True):
        assert torch.equal(p, b)
        assert torch.equal(muon.state[p]["momentum_buffer"], momentum[id(p)])
    for p, q in zip(others, twin_others, strict=True):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, b) for p, b in zip(others, adamw_before, strict=True))


def test_muon_declares_a_joint_step() -> None:
    """The contract hp-offload's OffloadedOptimizer reads (its ``JOINT_STEP_ATTRIBUTE``)."""
    assert Muon.steps_jointly is True
    assert getattr(torch.optim.AdamW, "steps_jointly", False) is False

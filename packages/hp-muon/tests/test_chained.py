"""Muon + AdamW chaining: the split rule, one optimizer object, one state dict."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from hp_muon import ChainedOptimizer, Muon, muon_with_adamw, split_params
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=48, dim=16, n_layers=2, n_heads=2, ffn_dim=24, max_seq_len=8)


def _model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(CONFIG)


def _weight(model: nn.Module, name: str) -> nn.Parameter:
    return dict(model.named_parameters())[name]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    inputs, targets = _batch(step)
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_default_split_rule_on_llama() -> None:
    split = split_params(_model())
    muon_names = {n for n, _ in split.muon}
    adamw_names = {n for n, _ in split.adamw}
    matrices = {
        f"layers.{i}.{m}.weight"
        for i in range(CONFIG.n_layers)
        for m in (
            "attn.q_proj",
            "attn.k_proj",
            "attn.v_proj",
            "attn.o_proj",
            "ffn.w1",
            "ffn.w2",
            "ffn.w3",
        )
    }
    assert muon_names == matrices
    assert "tok_embeddings.weight" in adamw_names
    assert "output.weight" in adamw_names
    assert "norm.weight" in adamw_names
    assert "layers.0.attn_norm.weight" in adamw_names
    assert muon_names | adamw_names == {n for n, _ in _model().named_parameters()}
    assert not muon_names & adamw_names


def test_split_overrides_head_and_patterns() -> None:
    model = _model()
    with_head = split_params(model, head_with_muon=True)
    assert "output.weight" in {n for n, _ in with_head.muon}
    moved = split_params(model, adamw_patterns=["layers.0.*"], muon_patterns=["tok_embeddings.*"])
    muon_names = {n for n, _ in moved.muon}
    assert not any(n.startswith("layers.0.") for n in muon_names)
    assert "tok_embeddings.weight" in muon_names
    assert "layers.1.ffn.w2.weight" in muon_names


def test_split_skips_frozen_and_lists_tied_once() -> None:
    model = _model()
    model.output.weight = model.tok_embeddings.weight  # tied embedding and head
    _weight(model, "layers.0.ffn.w1.weight").requires_grad_(False)
    split = split_params(model)
    names = [n for n, _ in (*split.muon, *split.adamw)]
    assert "layers.0.ffn.w1.weight" not in names
    assert names.count("tok_embeddings.weight") == 1
    assert "output.weight" not in names
    assert "tok_embeddings.weight" in {n for n, _ in split.adamw}


def test_split_errors() -> None:
    model = _model()
    with pytest.raises(ValueError, match="matches both muon_patterns and adamw_patterns"):
        split_params(model, muon_patterns=["*.w1.*"], adamw_patterns=["layers.0.*"])
    with pytest.raises(ValueError, match="Muon needs at least 2 dims"):
        split_params(model, muon_patterns=["norm.weight"])


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        opt.zero_grad()
        loss = _loss(model, step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_chain_equals_torch_muon_and_adamw_side_by_side() -> None:
    ours_model, ref_model = _model(), _model()
    ours = muon_with_adamw(
        ours_model,
        muon={"lr": 0.02, "weight_decay": 0.01, "ns_dtype": torch.bfloat16},
        adamw={"lr": 3e-3, "weight_decay": 0.01},
    )
    split = split_params(ref_model)
    ref_muon = torch.optim.Muon(split.muon_params, lr=0.02, weight_decay=0.01)
    ref_adamw = torch.optim.AdamW(split.adamw_params, lr=3e-3, weight_decay=0.01)
    for step in range(4):
        for m in (ours_model, ref_model):
            m.zero_grad()
            _loss(m, step).backward()
        ours.step()
        ref_muon.step()
        ref_adamw.step()
    for (name, a), (_, b) in zip(
        ours_model.named_parameters(), ref_model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_one_state_dict_round_trip_and_resume() -> None:
    model = _model()
    opt = muon_with_adamw(model, muon={"lr": 0.02}, adamw={"lr": 3e-3})
    _train(model, opt, range(2))
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    n_groups = len(opt.optimizers[0].param_groups) + len(opt.optimizers[1].param_groups)
    assert len(saved_opt["param_groups"]) == n_groups
    assert len(saved_opt["state"]) == sum(1 for _ in model.parameters())

    resumed = _model(seed=7)
    resumed.load_state_dict(saved_model)
    resumed_opt = muon_with_adamw(resumed, muon={"lr": 0.5}, adamw={"lr": 0.5})
    resumed_opt.load_state_dict(saved_opt)
    assert [g["lr"] for g in resumed_opt.param_groups] == [0.02, 3e-3]
    assert _train(resumed, resumed_opt, range(2, 4)) == _train(model, opt, range(2, 4))
    for a, b in zip(resumed.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_scheduler_drives_every_chained_optimizer() -> None:
    model = _model()
    opt = muon_with_adamw(model, muon={"lr": 0.02}, adamw={"lr": 3e-3})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    _train(model, opt, range(1))
    sched.step()
    sched.step()
    assert opt.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02 / 3)
    assert opt.optimizers[1].param_groups[0]["lr"] == pytest.approx(3e-3 / 3)


def test_state_view_zero_grad_and_closure() -> None:
    model = _model()
    opt = muon_with_adamw(model, muon={"lr": 0.02}, adamw={"lr": 3e-3})
    _train(model, opt, range(1))
    q = _weight(model, "layers.0.attn.q_proj.weight")
    emb = model.tok_embeddings.weight
    assert set(opt.state[q]) == {"momentum_buffer"}
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(opt.state[emb])
    assert len(opt.state) == sum(1 for _ in model.parameters())
    assert q in opt.state
    with pytest.raises(KeyError, match="not a parameter of any chained optimizer"):
        opt.state[torch.zeros(1)]
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())

    def closure() -> float:
        opt.zero_grad()
        loss = _loss(model, 9)
        loss.backward()
        return loss.item()

    with torch.no_grad():
        before = _loss(model, 9).item()
    assert opt.step(closure) == before
    with torch.no_grad():
        assert _loss(model, 9).item() != before


def test_chain_errors() -> None:
    model = _model()
    with pytest.raises(ValueError, match="at least one optimizer"):
        ChainedOptimizer([])
    a = Muon([_weight(model, "layers.0.ffn.w1.weight")], ns_dtype=torch.bfloat16)
    b = torch.optim.AdamW([_weight(model, "layers.0.ffn.w1.weight")])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        ChainedOptimizer([a, b])
    chain = muon_with_adamw(model)
    with pytest.raises(RuntimeError, match="build a new ChainedOptimizer"):
        chain.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})
    state = chain.state_dict()
    state["param_groups"] = state["param_groups"][:1]
    with pytest.raises(ValueError, match="the state dict has 1 parameter groups"):
        chain.load_state_dict(state)


def test_split_counts_a_sharded_piece_by_its_whole_shape() -> None:
    """hp-fsdp hands optimizers 1-d flat pieces annotated with 2-d layouts: still matrices."""
    from hp_dtensor import annotate_layout
    from hp_layout import Layout, Mesh, RaggedShard

    mesh = Mesh((2,), ("shard",), (0, 1))
    model = nn.Module()
    model.proj = nn.Linear(4, 3, bias=False)
    model.proj.weight = annotate_layout(
        nn.Parameter(torch.zeros(5)), Layout((3, 4), mesh, [RaggedShard((5, 7))])
    )
    split = split_params(model)
    assert [n for n, _ in split.muon] == ["proj.weight"]

"""A Llama-style transformer block written directly with DTensors (tensor parallel, world 2)
gives the loss and every gradient of the single-device run, within fp32 rounding."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _harness import as_dtensor
from hp_dtensor import DeviceMesh, DTensor, distribute_tensor
from hp_layout import Mesh, Placement, Replicate, Shard
from hp_testing import run_on_ranks

B, S, H, HEADS, FFN, VOCAB = 2, 6, 16, 4, 24, 11
EPS = 1e-6


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    return {
        "embed": rand(VOCAB, H, scale=1.0),
        "norm1": 1.0 + rand(H),
        "wq": rand(H, H),
        "wk": rand(H, H),
        "wv": rand(H, H),
        "wo": rand(H, H),
        "norm2": 1.0 + rand(H),
        "w_gate": rand(FFN, H),
        "w_up": rand(FFN, H),
        "w_down": rand(H, FFN),
        "norm_out": 1.0 + rand(H),
        "lm_head": rand(VOCAB, H),
    }


# Column-parallel projections shard their output features, row-parallel ones their input
# features; norms and the embedding stay replicated; the LM head is column-parallel (vocab).
PLACEMENTS: dict[str, Placement] = {
    "embed": Replicate(),
    "norm1": Replicate(),
    "wq": Shard(0),
    "wk": Shard(0),
    "wv": Shard(0),
    "wo": Shard(1),
    "norm2": Replicate(),
    "w_gate": Shard(0),
    "w_up": Shard(0),
    "w_down": Shard(1),
    "norm_out": Replicate(),
    "lm_head": Shard(0),
}


def _rms_norm(x: Any, weight: Any) -> Any:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def _rotate_half(x: Any) -> Any:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_tables() -> tuple[torch.Tensor, torch.Tensor]:
    dim = H // HEADS
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(S, dtype=torch.float32), inv)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _forward(p: dict[str, Any], ids: Any, targets: Any, cos: Any, sin: Any) -> Any:
    x = F.embedding(ids, p["embed"])
    h = _rms_norm(x, p["norm1"])
    dim = H // HEADS

    def heads(t: Any) -> Any:
        return t.view(B, S, HEADS, dim).transpose(1, 2)

    q, k, v = (heads(F.linear(h, p[w])) for w in ("wq", "wk", "wv"))
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    attn = attn.transpose(1, 2).reshape(B, S, H)
    x = x + F.linear(attn, p["wo"])
    h = _rms_norm(x, p["norm2"])
    x = x + F.linear(F.silu(F.linear(h, p["w_gate"])) * F.linear(h, p["w_up"]), p["w_down"])
    logits = F.linear(_rms_norm(x, p["norm_out"]), p["lm_head"])
    return F.cross_entropy(logits.reshape(B * S, VOCAB), targets.reshape(B * S))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (
        torch.randint(0, VOCAB, (B, S), generator=g),
        torch.randint(0, VOCAB, (B, S), generator=g),
    )


def _run_block() -> dict[str, float]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    ids, targets = _data()
    cos, sin = _rope_tables()
    ref = {k: v.clone().requires_grad_() for k, v in _params().items()}
    ref_loss = _forward(ref, ids, targets, cos, sin)
    ref_loss.backward()

    dist_params = {
        k: distribute_tensor(v, mesh, [PLACEMENTS[k]]).requires_grad_()
        for k, v in _params().items()
    }

    def rep(t: torch.Tensor) -> DTensor:
        return distribute_tensor(t, mesh, [Replicate()])

    loss = _forward(dist_params, rep(ids), rep(targets), rep(cos), rep(sin))
    loss.backward()
    errors = {"loss": abs(loss.full_tensor().item() - ref_loss.item())}
    for name, param in dist_params.items():
        grad = as_dtensor(param.grad).full_tensor()
        reference = ref[name].grad
        assert reference is not None
        errors[name] = ((grad - reference).abs().max() / reference.abs().max()).item()
    return errors


@pytest.mark.multiprocess
def test_tp_block_matches_single_device() -> None:
    for errors in run_on_ranks(2, _run_block, timeout=300):
        # fp32: the loss to 1e-6 absolute, each gradient to 1e-5 of its largest entry.
        assert errors["loss"] < 1e-6, errors
        worst = max((v, k) for k, v in errors.items() if k != "loss")
        assert worst[0] < 1e-5, errors

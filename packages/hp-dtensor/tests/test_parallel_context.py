"""Context parallelism against one device: causal attention (ring and Ulysses) at CP=2 and
CP=4, on the attention alone and on a small rotary transformer in production and validation
mode (outputs, loss and gradients over two SGD steps), plus the clear errors.

The hp_testing Llama slices its rotary tables by ``[:seq]`` and calls SDPA inline, so it cannot
take the per-rank positions of a sharded sequence; the model here is the same block with its
attention going through :class:`CausalAttention` and its rotary tables looked up by position.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh, DTensor
from hp_dtensor.collectives import ring_shift
from hp_dtensor.parallel import (
    Boundary,
    CausalAttention,
    ContextParallel,
    ContextParallelError,
    PlanMismatchError,
    ShardingPlan,
    check_gradients,
    context_parallel_cross_entropy,
    gather_sequence,
    local_positions,
    parallelize_module,
    shard_sequence,
)
from hp_dtensor.parallel.context_attention import ring_attention, ulysses_attention
from hp_layout import Mesh, Shard
from hp_testing import run_on_ranks

VOCAB, DIM, HEADS, SEQ, BATCH = 24, 16, 4, 16, 2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.abs().max().item(), 1e-12)
    return (got.double() - want.double()).abs().max().item() / scale


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.core = CausalAttention()
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        h = self.norm(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, HEADS, -1).transpose(1, 2)

        def rotary(t: torch.Tensor) -> torch.Tensor:
            half = t.shape[-1] // 2
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))
        a = self.core(rotary(q), rotary(k), v)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        out: torch.Tensor = x + self.w2(F.silu(self.w1(x)))
        return out


class _Model(nn.Module):
    """Token ids ``[batch, seq]`` and positions ``[seq]`` to logits ``[batch, seq, vocab]``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        hd = DIM // HEADS
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(64, dtype=torch.float32), inv).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    cos: torch.Tensor
    sin: torch.Tensor

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        cos, sin = F.embedding(positions, self.cos), F.embedding(positions, self.sin)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.out(self.norm(x))
        return logits


def _cp_plan(variant: str) -> dict[str, Any]:
    return {
        # ids [batch, seq], positions [seq] and logits are sequence-sharded on the cp axis
        "": ShardingPlan(
            inputs=(Boundary(Shard(1)), Boundary(Shard(0))), outputs=Boundary(Shard(1))
        ),
        "layers.*.core": ContextParallel(variant=variant),
    }


def _model_case(mesh: DeviceMesh, variant: str, mode: str) -> dict[str, float]:
    """Two SGD steps whole and under CP; the worst relative errors."""
    torch.manual_seed(0)
    reference = _Model()
    torch.manual_seed(0)
    model = parallelize_module(_Model(), mesh, _cp_plan(variant), mode=mode, tp_axis="cp")  # type: ignore[arg-type]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    errors = {"out": 0.0, "loss": 0.0, "grad": 0.0}
    positions = local_positions(SEQ, mesh, "cp")
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        ref_opt.zero_grad()
        ref_logits = reference(ids, torch.arange(SEQ))
        ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), targets.reshape(-1))
        ref_loss.backward()
        opt.zero_grad()
        local_targets = shard_sequence(targets, 1, mesh, "cp")
        logits = model(shard_sequence(ids, 1, mesh, "cp"), positions)
        if mode == "validation":
            assert isinstance(logits, DTensor)
            assert logits.placements == (Shard(1),)
            dtargets = DTensor.from_local(local_targets, mesh, [Shard(1)])
            loss = F.cross_entropy(logits.permute(0, 2, 1), dtargets)
            loss.backward()
            check_gradients(model)
            assert isinstance(loss, DTensor)
            loss_value = loss.full_tensor()
            local_logits = logits.to_local()
        else:
            loss = context_parallel_cross_entropy(logits, local_targets, mesh, "cp")
            loss.backward()
            loss_value, local_logits = loss, logits
        whole = gather_sequence(local_logits.detach(), 1, mesh, "cp")
        errors["out"] = max(errors["out"], _rel(whole, ref_logits.detach()))
        errors["loss"] = max(errors["loss"], abs(loss_value.item() - ref_loss.item()))
        for (name, p), (_, ref_p) in zip(
            model.named_parameters(), reference.named_parameters(), strict=True
        ):
            assert p.grad is not None, name
            assert ref_p.grad is not None, name
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            errors["grad"] = max(errors["grad"], _rel(grad, ref_p.grad))
        ref_opt.step()
        opt.step()
    return errors


def _attention_case(mesh: DeviceMesh, variant: str, balanced: bool) -> dict[str, float]:
    """The attention alone: output and query/key/value gradients against SDPA."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(BATCH, HEADS, SEQ, 8, generator=g, requires_grad=True) for _ in "qkv")
    weight = torch.randn(BATCH, HEADS, SEQ, 8, generator=g)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (ref * weight).sum().backward()

    def local(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t.detach(), 2, mesh, "cp", balanced=balanced).requires_grad_()

    lq, lk, lv = local(q), local(k), local(v)
    fn = ring_attention if variant == "ring" else ulysses_attention
    out = fn(lq, lk, lv, mesh, "cp", balanced=balanced)
    (out * shard_sequence(weight, 2, mesh, "cp", balanced=balanced)).sum().backward()
    errors = {
        "out": _rel(out.detach(), shard_sequence(ref.detach(), 2, mesh, "cp", balanced=balanced))
    }
    grad = 0.0
    for mine, whole in ((lq, q), (lk, k), (lv, v)):
        assert mine.grad is not None
        assert whole.grad is not None
        grad = max(
            grad, _rel(mine.grad, shard_sequence(whole.grad, 2, mesh, "cp", balanced=balanced))
        )
    errors["grad"] = grad
    return errors


def _all_cases(world: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((world,), ("cp",)))
    out: dict[str, dict[str, float]] = {}
    for variant in ("ring", "ulysses"):
        for balanced in (True, False):
            out[f"attention {variant} balanced={balanced}"] = _attention_case(
                mesh, variant, balanced
            )
        for mode in ("production", "validation"):
            out[f"model {variant} {mode}"] = _model_case(mesh, variant, mode)
    return out


# fp32: outputs and gradients relative to each tensor's largest entry, the loss (about 3.2)
# absolutely. Largest measured over CP=2 and 4, both variants, both modes and every rank
# (torch 2.13, x86 CPU, one thread; the same on every run): outputs 2.8e-7, gradients 8.1e-7,
# losses 7.2e-7 (three fp32 ulps of the loss; its bound was already 2.8x that). Asserted with
# 3-4x headroom for another CPU's summation order; the README quotes both.
BOUNDS = {"out": 1e-6, "grad": 3e-6, "loss": 2e-6}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_equals_single_device(world: int) -> None:
    results = run_on_ranks(world, _all_cases, world, timeout=300)
    for case in results[0]:
        worst = {k: max(r[case][k] for r in results) for k in results[0][case]}
        print(world, case, {k: f"{v:.2e}" for k, v in worst.items()})
    for rank_results in results:
        for case, errors in rank_results.items():
            for key, value in errors.items():
                assert value < BOUNDS[key], (world, case, key, errors)
            if case.startswith("attention ulysses"):
                # Ulysses moves whole heads; each head's attention is the same SDPA call on
                # the same full sequence as on one device, so nothing may differ at all.
                assert errors == {"out": 0.0, "grad": 0.0}, (world, case, errors)


def _errors(world: int) -> list[str]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((world,), ("cp",)))
    found: list[str] = []
    x = torch.randn(1, 3, 8, 4)  # 3 heads do not split over 2 ranks
    try:
        ulysses_attention(x, x, x, mesh, "cp")
    except ContextParallelError as exc:
        found.append(str(exc))
    try:
        ring_attention(
            torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), mesh, "cp"
        )
    except ContextParallelError as exc:
        found.append(str(exc))
    # Validation mode names a core whose input arrives with another layout than Shard(2).
    model = parallelize_module(
        nn.Sequential(CausalAttention()), mesh, {"0": ContextParallel()}, mode="validation"
    )
    q = DTensor.from_local(torch.randn(1, 2, 4, 4), mesh, [Shard(1)])
    core = model.get_submodule("0")
    try:
        core(q, q, q)
    except PlanMismatchError as exc:
        found.append(str(exc))
    # The ring rotation's adjoint is the reverse rotation.
    t = torch.full((2,), float(mesh.get_rank()), requires_grad=True)
    shifted = ring_shift(t, mesh, "cp")
    assert shifted[0].item() == (mesh.get_rank() - 1) % world
    (shifted * (mesh.get_rank() + 1)).sum().backward()
    assert t.grad is not None
    assert t.grad[0].item() == (mesh.get_rank() + 1) % world + 1
    return found


@pytest.mark.multiprocess
def test_clear_errors() -> None:
    found = run_on_ranks(2, _errors, 2, timeout=120)[0]
    assert len(found) == 3, found
    assert "head count must divide by 2" in found[0]
    assert "pad it to a multiple of 4" in found[1]
    assert "'0'" in found[2]
    assert "Shard(2)" in found[2]

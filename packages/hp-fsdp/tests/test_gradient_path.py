"""The path of a gradient through hp-fsdp, checked against a sum the test computes itself.

Each rank runs the same model on its own batch twice: once unsharded on its own (the plain
module, one device), and once under ``fully_shard`` (blocks, then the root). The oracle for the
sharded gradients is written here: every rank's single-device gradients, all-gathered, added in
rank order ``((g0 + g1) + g2) + ...`` in the reduce dtype, then multiplied by ``1 / world``.
hp-fsdp's reduce-scatter on gloo is an all-to-all and a sum in exactly that order
(``hp_fsdp._collectives``), so the sharded gradients must equal the oracle bit for bit, at
world 2 and 4, in fp32 and with a bf16 reduce dtype (where ``torch.sum`` over the rows would
accumulate in fp32 and differ). Equality, not a tolerance, is what makes the result
reproducible from run to run and independent of the order peers' chunks arrive in.

Autograd accumulates each parameter's gradient as usual and hp-fsdp moves it into the flat
gradient buffer, a copy the first time and an add after; the buffer is never zero-filled, so:

* a parameter that gets no gradient in a backward (unused in the forward) must reduce to zero,
  checked with torch's ``fill_uninitialized_memory`` (every ``torch.empty`` filled with NaN);
* a gradient arriving in several parts (a weight used in two reentrant-checkpointed segments:
  autograd accumulates into it once per segment) must be their sum, bit for bit the sum the
  same checkpointed model accumulates on one device.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=64, max_seq_len=16)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    # Rank-dependent scales spread the gradients' magnitudes, so that the order of the
    # additions shows in their rounding.
    return ids, torch.randint(0, vocab, (2, 12), generator=g)


def _loss(model: nn.Module, scale: float) -> torch.Tensor:
    ids, targets = _batch(CONFIG.vocab_size)
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) * scale


def _rank_order_mean(local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The oracle: every rank's ``local``, added in rank order in ``dtype``, times 1/world."""
    world = dist.get_world_size()
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    total = parts[0].to(dtype)
    for part in parts[1:]:
        total = total + part.to(dtype)
    return total.mul_(1.0 / world).to(local.dtype)


def _sharded_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient of the sharded ``model``, whole, by parameter name."""
    from hp_dtensor import DeviceMesh
    from hp_dtensor.parallel.equivalence import full_value
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("shard",)))
    return {
        name: full_value(p.grad, mesh, like=p)
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _oracle(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The rank-order mean of every gradient of the single-device ``model``, by name."""
    return {
        name: _rank_order_mean(p.grad, dtype)
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def _shard(model: nn.Module, **kwargs: Any) -> nn.Module:
    from hp_dtensor import DeviceMesh
    from hp_fsdp import fully_shard
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("shard",)))
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _reduced_like_the_oracle(reduce_dtype: str) -> list[str]:
    from hp_fsdp import MixedPrecisionPolicy

    torch.set_num_threads(1)
    dtype = getattr(torch, reduce_dtype)
    scale = 10.0 ** (2 * dist.get_rank())
    torch.manual_seed(0)
    local = Llama(CONFIG)
    _loss(local, scale).backward()
    want = _oracle(local, dtype)
    torch.manual_seed(0)
    sharded = _shard(Llama(CONFIG), mp_policy=MixedPrecisionPolicy(reduce_dtype=dtype))
    for _ in range(2):  # the second backward runs on the buffers of the first
        sharded.zero_grad(set_to_none=True)
        _loss(sharded, scale).backward()
    got = _sharded_grads(sharded)
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    return sorted(name for name, w in want.items() if not torch.equal(got[name], w))


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16"])
def test_reduced_gradients_are_the_rank_order_sum(world: int, reduce_dtype: str) -> None:
    for rank, differing in enumerate(run_on_ranks(world, _reduced_like_the_oracle, reduce_dtype)):
        assert differing == [], (rank, differing)


class _Block(nn.Module):
    """Two linears; ``spare`` is never used in forward; ``frozen`` is used and frozen; with
    ``reentrant``, ``shared`` is used in two reentrant-checkpointed segments (autograd then
    accumulates its gradient twice)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.shared = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(x))

    def _second(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.frozen(self.shared(x))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant:
            x = checkpoint(self._first, x, use_reentrant=True)
            return checkpoint(self._second, x, use_reentrant=True)  # type: ignore[no-any-return]
        return self._second(self._first(x))


class _Net(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(reentrant) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _unwritten_slots(reentrant: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    try:
        g = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(4, 8, generator=g, requires_grad=reentrant)

        def build() -> nn.Module:
            torch.manual_seed(0)
            return _Net(reentrant)

        local = build()
        local(x).square().sum().backward()
        want = _oracle(local, torch.float32)
        sharded = _shard(build())
        for _ in range(2):
            sharded.zero_grad(set_to_none=True)
            sharded(x).square().sum().backward()
        got = _sharded_grads(sharded)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    return {
        "spare": {n: g.abs().max().item() for n, g in got.items() if ".spare." in n},
        "differing": sorted(n for n, w in want.items() if not torch.equal(got[n], w)),
        "compared": sorted(want),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("reentrant", [False, True])
def test_unused_parameters_reduce_to_zero_and_parts_add_up(reentrant: bool) -> None:
    for out in run_on_ranks(2, _unwritten_slots, reentrant):
        # Unused: zero (not the NaN an unfilled buffer holds under fill_uninitialized_memory).
        assert len(out["spare"]) == 4, out["spare"]
        assert set(out["spare"].values()) == {0.0}, out["spare"]
        assert len(out["compared"]) == 6, out["compared"]  # shared (2 blocks) and head: w, b
        assert out["differing"] == [], out

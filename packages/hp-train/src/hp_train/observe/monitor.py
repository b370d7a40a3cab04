"""Precision monitoring: norms per layer, the global gradient norm and per-rank losses.

Local norms are this rank's pieces only (what it holds under FSDP/TP): cheap, no
communication, and they show a rank whose numbers drift. The global gradient norm counts each
element once over all ranks (``hp_fsdp.total_grad_norm``). Per-rank losses are all-gathered;
a rank whose loss differs from the mean over ranks by more than a threshold (relative) is
reported, because data-parallel ranks see different data but tensor-parallel ranks of one
data-parallel rank must agree.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DTensor
from hp_dtensor.watchdog import watch
from hp_fsdp import total_grad_norm

__all__ = [
    "Divergence",
    "LayerNorms",
    "clip_grads_to_norm_",
    "divergent_ranks",
    "global_grad_norm",
    "layer_of",
    "local_norms",
    "rank_losses",
    "snapshot",
]


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: ``layers.<i>`` for blocks, else its first name."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


@dataclass(frozen=True)
class LayerNorms:
    """Local L2 norms of one layer's pieces on this rank."""

    param: float
    grad: float
    update: float | None


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP hands out plain 1-d pieces; a DTensor (validation mode) has its local shard.
    data = t.to_local() if isinstance(t, DTensor) else t
    return data.detach().float()


def local_norms(
    model: nn.Module, before: dict[str, torch.Tensor] | None = None
) -> dict[str, LayerNorms]:
    """Per layer: norms of this rank's parameter pieces, gradients and (given the pieces
    ``before`` the optimizer step, by name) updates."""
    squares: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for name, p in model.named_parameters():
        layer = squares[layer_of(name)]
        data = _local(p)
        layer[0] += float(data.pow(2).sum())
        if p.grad is not None:
            layer[1] += float(_local(p.grad).pow(2).sum())
        if before is not None and name in before:
            layer[2] += float((data - before[name]).pow(2).sum())
    return {
        k: LayerNorms(math.sqrt(v[0]), math.sqrt(v[1]), math.sqrt(v[2]) if before else None)
        for k, v in squares.items()
    }


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of this rank's parameter pieces (to measure the next update)."""
    return {name: _local(p).clone() for name, p in model.named_parameters()}


def global_grad_norm(model: nn.Module) -> float:
    """The gradient norm over all ranks, each element once (collective)."""
    return float(total_grad_norm(model))


def clip_grads_to_norm_(parameters: Iterable[torch.Tensor], norm: float, max_norm: float) -> float:
    """Scale the gradients of ``parameters`` in place so that their global norm, ``norm``
    before, is at most ``max_norm``: by ``max_norm / (norm + 1e-6)`` where that is below 1,
    the factor ``torch.nn.utils.clip_grad_norm_`` applies. Returns the factor applied (1.0:
    left as they are)."""
    factor = max_norm / (norm + 1e-6)
    if factor >= 1.0:
        return 1.0
    with torch.no_grad():
        for param in parameters:
            if param.grad is not None:
                param.grad.mul_(factor)
    return factor


def rank_losses(local_loss: float) -> list[float]:
    """Every rank's local loss, in rank order (collective)."""
    gathered: list[object] = [None] * dist.get_world_size()
    with watch("all_gather_object (per-rank losses)"):
        dist.all_gather_object(gathered, local_loss)
    return [float(v) for v in gathered]  # type: ignore[arg-type]


@dataclass(frozen=True)
class Divergence:
    """A rank whose local loss is far from the mean over ranks."""

    rank: int
    loss: float
    mean: float

    def message(self) -> str:
        """A one-line warning."""
        return (
            f"rank {self.rank} diverges: local loss {self.loss:.6g} vs mean over ranks "
            f"{self.mean:.6g}"
        )


def divergent_ranks(
    losses: list[float], threshold: float, ranks: Sequence[int] | None = None
) -> list[Divergence]:
    """Ranks whose loss is non-finite or differs from the mean of the finite ones by more
    than ``threshold`` times that mean's magnitude. ``ranks`` restricts the comparison to
    the ranks that compute a loss (under pipelining, the last stage's); default all."""
    considered = list(range(len(losses))) if ranks is None else list(ranks)
    finite = [losses[r] for r in considered if math.isfinite(losses[r])]
    mean = sum(finite) / len(finite) if finite else float("nan")
    out = []
    for rank in considered:
        loss = losses[rank]
        if not math.isfinite(loss) or abs(loss - mean) > threshold * max(abs(mean), 1e-12):
            out.append(Divergence(rank, loss, mean))
    return out

"""Precision monitoring: norms per layer, the global gradient norm and the divergence check.

Local norms are this rank's pieces only (what it holds under FSDP/TP): cheap, no
communication, and they show a rank whose numbers drift. The global gradient norm counts each
element once over all ranks (``hp_fsdp.total_grad_norm``).

The divergence check compares like with like. Per-rank training losses are recorded, never
compared: data-parallel ranks see different documents, and their losses legitimately differ
(by 60% early in a run on ordinary JSON Lines data). Instead, every monitored step each rank
evaluates one shared probe batch, forward only and without dropout: the same token ids on every
rank (:func:`probe_batch`, drawn from the run's seed and the step, independent of the data).
The parameters are synchronized, so every healthy rank computes the same probe loss up to
rounding, whatever its data. The rule (:func:`divergent_ranks`, pure): among the ranks that
evaluate the same tokens (every rank; under context parallelism those with the same
context-parallel coordinate, which see the same columns), the consensus is the median of the
finite probe losses, and a rank is divergent when its probe loss is non-finite or off the
consensus by more than ``divergence_threshold`` times the consensus's magnitude. A rank whose
computation or weights went wrong (a replica whose parameters were corrupted, a device that
computes wrongly) is named; where the ranks split evenly the median is between the halves and
every rank is named, as no majority says which is right.

What it cannot see: a corrupted FSDP or tensor-parallel shard reaches every rank through the
all-gather or the tensor-parallel collectives, so every rank computes the same wrong loss (the
global loss and the non-finite checks see that); and a rank whose own data is wrong computes the
probe correctly. Under pipeline parallelism the probe runs through the forward-only schedule
and only the last stage's ranks have a loss to compare (the others report None).
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
    "gather_probes",
    "global_grad_norm",
    "layer_of",
    "local_norms",
    "probe_batch",
    "probe_divergences",
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


@dataclass(frozen=True)
class Divergence:
    """A rank whose probe loss is off the consensus of the ranks that evaluated the same
    tokens."""

    rank: int
    loss: float
    consensus: float
    peers: tuple[int, ...]

    def message(self) -> str:
        """A one-line warning."""
        return (
            f"rank {self.rank} diverges: its loss on the shared probe batch is {self.loss:.6g}, "
            f"the consensus (median) of ranks {list(self.peers)} is {self.consensus:.6g}; the "
            "ranks hold the same parameters and evaluated the same tokens, so this rank's "
            "weights or computation differ from the others'"
        )


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def divergent_ranks(
    losses: Sequence[float], threshold: float, ranks: Sequence[int] | None = None
) -> list[Divergence]:
    """The ranks among ``ranks`` (default: all) whose loss in ``losses`` (indexed by rank,
    each the loss of the same computation) is non-finite or differs from the median of the
    finite ones by more than ``threshold`` times that median's magnitude; in rank order.
    Ranks of ``losses`` outside ``ranks`` are ignored; with no finite loss among ``ranks``
    there is no consensus and none is named."""
    considered = tuple(range(len(losses))) if ranks is None else tuple(ranks)
    finite = [losses[r] for r in considered if math.isfinite(losses[r])]
    if not finite:  # no consensus to be off: the non-finite checks report such a step
        return []
    consensus = _median(finite)
    tolerance = threshold * max(abs(consensus), 1e-12)
    return [
        Divergence(rank, losses[rank], consensus, considered)
        for rank in considered
        if not math.isfinite(losses[rank]) or abs(losses[rank] - consensus) > tolerance
    ]


def probe_divergences(
    probes: Sequence[float | None], keys: Sequence[int], threshold: float
) -> list[Divergence]:
    """:func:`divergent_ranks` within each set of ranks with the same key in ``keys`` (the
    ranks that evaluated the same tokens), over the ranks with a probe loss (None: none, e.g.
    a rank outside the check); in rank order."""
    groups: dict[int, list[int]] = defaultdict(list)
    for rank, (probe, key) in enumerate(zip(probes, keys, strict=True)):
        if probe is not None:
            groups[key].append(rank)
    values = [math.nan if p is None else p for p in probes]
    found = [d for ranks in groups.values() for d in divergent_ranks(values, threshold, ranks)]
    return sorted(found, key=lambda d: d.rank)


def probe_batch(
    vocab_size: int, rows: int, seq_len: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared probe batch of ``step``: inputs and next-token targets, ``rows x seq_len``
    token ids below ``vocab_size`` (int64, on the CPU), the same on every rank and for every
    call with these arguments; drawn from a generator of its own (no global random state is
    used or changed)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(vocab_size, (rows, seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def gather_probes(
    local_loss: float, probe: float | None, key: int
) -> tuple[list[float], list[float | None], list[int]]:
    """Every rank's local training loss, probe loss (None where it evaluated none) and probe
    key (which tokens it evaluated), each in rank order (collective: one all-gather)."""
    gathered: list[object] = [None] * dist.get_world_size()
    with watch("all_gather_object (per-rank and probe losses)"):
        dist.all_gather_object(gathered, (local_loss, probe, key))
    rows = [t for t in gathered if isinstance(t, tuple)]
    return (
        [float(t[0]) for t in rows],
        [None if t[1] is None else float(t[1]) for t in rows],
        [int(t[2]) for t in rows],
    )

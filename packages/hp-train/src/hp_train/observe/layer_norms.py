"""Per-layer norms of the whole parameters, gradients and updates, over all ranks.

Under FSDP, tensor and expert parallelism each rank holds pieces of a parameter. Each
parameter's layout (``hp_dtensor.layout_of``) says which ranks hold which piece and which
hold replicas: a rank adds its piece's squares only where it is the first replica
(coordinate 0 on every replicated axis of the layout), and one all-reduce per mesh sums
them over the mesh, so every element of the full tensor counts once -- the rule of
``hp_fsdp.total_grad_norm``, applied per layer and to three quantities at once.

What this cannot see: a ``Partial`` gradient (one not reduced yet; only validation mode has
them) is counted as the piece the rank holds, so its gradient norm there is not the full
tensor's. Under pipeline parallelism a rank sees its own stage's layers; the trainer merges
the stages' results.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh, DTensor, layout_of
from hp_dtensor.watchdog import watch
from hp_layout import Layout, Mesh, Replicate
from hp_train.observe.monitor import LayerNorms, layer_of

__all__ = ["global_layer_norms"]


def _local(t: torch.Tensor) -> torch.Tensor:
    data = t.to_local() if isinstance(t, DTensor) else t
    return data.detach().double()


def _first_replica(layout: Layout, rank: int) -> bool:
    coordinate = layout.mesh.coordinate(rank)
    return all(
        c == 0
        for c, p in zip(coordinate, layout.placements, strict=True)
        if isinstance(p, Replicate)
    )


def _squares(
    model: nn.Module, before: dict[str, torch.Tensor] | None, rank: int
) -> dict[Mesh, dict[str, list[float]]]:
    """Per mesh, per layer: this rank's counted sums of squares of parameter, gradient and
    update pieces."""
    out: dict[Mesh, dict[str, list[float]]] = {}
    for name, p in model.named_parameters():
        layout = layout_of(p)
        layers = out.setdefault(layout.mesh, defaultdict(lambda: [0.0, 0.0, 0.0]))
        sums = layers[layer_of(name)]  # present even when not counted: the same rows
        if not _first_replica(layout, rank):
            continue
        data = _local(p)
        sums[0] += float(data.pow(2).sum())
        if p.grad is not None:
            sums[1] += float(_local(p.grad).pow(2).sum())
        if before is not None and name in before:
            sums[2] += float((data - before[name].double()).pow(2).sum())
    return out


def global_layer_norms(
    model: nn.Module, before: dict[str, torch.Tensor] | None = None
) -> dict[str, LayerNorms]:
    """Per layer (``hp_train.observe.monitor.layer_of``): the L2 norms of the full
    parameters, gradients and -- given this rank's pieces ``before`` the optimizer step
    (``monitor.snapshot``) -- updates, each element counted once over the ranks (collective
    over every mesh the model's parameters live on; every rank of a mesh must call it).
    ``update`` is None without ``before``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    per_mesh = _squares(model, before, rank)
    device = next(model.parameters()).device
    total: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    # The same order on every rank: each mesh's all-reduce meets its peers'.
    for mesh in sorted(per_mesh, key=repr):
        layers = sorted(per_mesh[mesh])
        rows = [per_mesh[mesh][k] for k in layers]
        sums = torch.tensor(rows, dtype=torch.float64, device=device)
        if mesh.size > 1:
            group = DeviceMesh.lookup(device.type, mesh).get_mesh_group()
            with watch("all_reduce (per-layer norms)", group):
                dist.all_reduce(sums, group=group)
        for k, row in zip(layers, sums.cpu().tolist(), strict=True):
            total[k] = [a + b for a, b in zip(total[k], row, strict=True)]
    return {
        k: LayerNorms(math.sqrt(v[0]), math.sqrt(v[1]), math.sqrt(v[2]) if before else None)
        for k, v in total.items()
    }

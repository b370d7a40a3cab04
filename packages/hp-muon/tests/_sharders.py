"""Test helpers: the same full parameters, laid out by each sharder Muon must work with.

Every rank builds the same full tensors (same seed); a *sharder* turns each into the parameter
object that sharder would give the optimizer, sets gradients from full gradients, and reads the
full value back. Rank functions only (called inside ``hp_testing.run_on_ranks``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh as torch_mesh
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor as torch_distribute

import hp_dtensor
from hp_dtensor import annotate_layout, layout_of
from hp_layout import Layout, Mesh, Shard, plan_flat_buffer


@dataclass(frozen=True)
class Sharder:
    """How one sharder lays out parameters.

    Attributes:
        name: the case name.
        make: full tensors -> parameters (this rank's objects).
        grad: (parameter, full gradient) -> the gradient to assign to ``parameter.grad``.
        full: parameter -> its full value (a collective for distributed kinds).
        muon_kwargs: extra ``Muon`` arguments the case needs (e.g. ``replicate_group``).
    """

    name: str
    make: Callable[[Sequence[torch.Tensor]], list[nn.Parameter]]
    grad: Callable[[nn.Parameter, torch.Tensor], torch.Tensor]
    full: Callable[[nn.Parameter], torch.Tensor]
    muon_kwargs: Callable[[], dict[str, object]]


def _local_piece(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    region = layout.local_region(rank)
    box = full[tuple(slice(a, b) for a, b in region.box)]
    if region.flat is None:
        return box.clone()
    return box.reshape(-1)[region.flat[0] : region.flat[1]].clone()


def _full_from_pieces(local: torch.Tensor, layout: Layout) -> torch.Tensor:
    """All-reduce of each rank's pieces written into zeros (one replica contributes)."""
    rank = dist.get_rank()
    out = torch.zeros(layout.global_shape, dtype=local.dtype)
    coordinate = layout.mesh.coordinate(rank)
    replica_zero = all(coordinate[layout.mesh.axis_index(a)] == 0 for a in layout.replicated_axes)
    if replica_zero:
        region = layout.local_region(rank)
        box = out[tuple(slice(a, b) for a, b in region.box)]
        if region.flat is None:
            box.copy_(local)
        else:
            flat = box.reshape(-1).clone()
            flat[region.flat[0] : region.flat[1]] = local
            box.copy_(flat.view(box.shape))
    dist.all_reduce(out)
    return out


def _torch(
    placements_for: Callable[[int, torch.Tensor], list[object]],
    mesh_shape: tuple[int, ...],
    names: tuple[str, ...],
) -> tuple[Callable[..., list[nn.Parameter]], Callable[..., torch.Tensor]]:
    def make(fulls: Sequence[torch.Tensor]) -> list[nn.Parameter]:
        mesh = torch_mesh("cpu", mesh_shape, mesh_dim_names=names)
        return [
            nn.Parameter(torch_distribute(f.clone(), mesh, placements_for(i, f)))  # type: ignore[arg-type]
            for i, f in enumerate(fulls)
        ]

    def grad(p: nn.Parameter, g: torch.Tensor) -> torch.Tensor:
        assert isinstance(p, TorchDTensor)
        return torch_distribute(g.clone(), p.device_mesh, p.placements)

    return make, grad


def _torch_full(p: nn.Parameter) -> torch.Tensor:
    assert isinstance(p, TorchDTensor)
    return p.full_tensor()


def _annotated(
    layout_for: Callable[[Sequence[torch.Tensor]], list[Layout]],
) -> tuple[
    Callable[..., list[nn.Parameter]], Callable[..., torch.Tensor], Callable[..., torch.Tensor]
]:
    def make(fulls: Sequence[torch.Tensor]) -> list[nn.Parameter]:
        rank = dist.get_rank()
        out = []
        for f, layout in zip(fulls, layout_for(fulls), strict=True):
            p = nn.Parameter(_local_piece(f, layout, rank))
            out.append(annotate_layout(p, layout))
        return out

    def grad(p: nn.Parameter, g: torch.Tensor) -> torch.Tensor:
        return _local_piece(g, layout_of(p), dist.get_rank())

    def full(p: nn.Parameter) -> torch.Tensor:
        return _full_from_pieces(p.detach(), layout_of(p))

    return make, grad, full


def _world_mesh(name: str = "dp") -> Mesh:
    world = dist.get_world_size()
    return Mesh((world,), (name,), tuple(range(world)))


def _flat_layouts(fulls: Sequence[torch.Tensor]) -> list[Layout]:
    """hp-fsdp's layout: all tensors packed in one flat buffer, cut into equal chunks."""
    mesh = _world_mesh("shard")
    flat = plan_flat_buffer([tuple(f.shape) for f in fulls], mesh.size)
    return [flat.layout(i, mesh, "shard") for i in range(len(fulls))]


def _row_col_layouts(fulls: Sequence[torch.Tensor]) -> list[Layout]:
    """Our TP in production mode: alternately row- and column-sharded boxes."""
    mesh = _world_mesh("tp")
    return [
        Layout(tuple(f.shape), mesh, [Shard(f.dim() - 2 + (i % 2))]) for i, f in enumerate(fulls)
    ]


def _expert_layouts(fulls: Sequence[torch.Tensor]) -> list[Layout]:
    """hp-dtensor's expert parallelism: expert stacks ``[E, out, in]`` sharded on the expert
    dim (uneven: 3 experts over 2 or 4 ranks), matrices on their rows."""
    mesh = _world_mesh("ep")
    return [Layout(tuple(f.shape), mesh, [Shard(0)]) for f in fulls]


def _hp_dtensor_make(fulls: Sequence[torch.Tensor]) -> list[nn.Parameter]:
    mesh = hp_dtensor.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return [
        nn.Parameter(hp_dtensor.distribute_tensor(f.clone(), mesh, [Shard(f.dim() - 2 + i % 2)]))
        for i, f in enumerate(fulls)
    ]


def _hp_dtensor_grad(p: nn.Parameter, g: torch.Tensor) -> torch.Tensor:
    assert isinstance(p, hp_dtensor.DTensor)
    return hp_dtensor.distribute_tensor(g.clone(), p.device_mesh, p.placements, src_data_rank=None)


def _hp_dtensor_full(p: nn.Parameter) -> torch.Tensor:
    assert isinstance(p, hp_dtensor.DTensor)
    return p.full_tensor()


def _plain_make(fulls: Sequence[torch.Tensor]) -> list[nn.Parameter]:
    return [nn.Parameter(f.clone()) for f in fulls]


def _no_kwargs() -> dict[str, object]:
    return {}


def _ddp_kwargs() -> dict[str, object]:
    return {"replicate_group": dist.group.WORLD}


def sharders(world: int) -> list[Sharder]:
    """Every sharder case for a world of ``world`` ranks (HSDP and 2-d cases need 4)."""
    fsdp2_make, fsdp2_grad = _torch(lambda i, f: [TorchShard(f.dim() - 2)], (world,), ("dp",))
    tp_make, tp_grad = _torch(lambda i, f: [TorchShard(f.dim() - 2 + i % 2)], (world,), ("tp",))
    flat_make, flat_grad, flat_full = _annotated(_flat_layouts)
    prod_make, prod_grad, prod_full = _annotated(_row_col_layouts)
    ep_make, ep_grad, ep_full = _annotated(_expert_layouts)
    out = [
        Sharder(
            "plain", _plain_make, lambda p, g: g.clone(), lambda p: p.detach().clone(), _no_kwargs
        ),
        Sharder(
            "ddp", _plain_make, lambda p, g: g.clone(), lambda p: p.detach().clone(), _ddp_kwargs
        ),
        Sharder("torch_fsdp2", fsdp2_make, fsdp2_grad, _torch_full, _no_kwargs),
        Sharder("torch_tp", tp_make, tp_grad, _torch_full, _no_kwargs),
        Sharder("hp_fsdp_flat", flat_make, flat_grad, flat_full, _no_kwargs),
        Sharder("hp_tp_production", prod_make, prod_grad, prod_full, _no_kwargs),
        Sharder("hp_expert_parallel", ep_make, ep_grad, ep_full, _no_kwargs),
        Sharder("hp_dtensor", _hp_dtensor_make, _hp_dtensor_grad, _hp_dtensor_full, _no_kwargs),
    ]
    if world == 4:
        hsdp_make, hsdp_grad = _torch(
            lambda i, f: [TorchReplicate(), TorchShard(f.dim() - 2)], (2, 2), ("replicate", "shard")
        )
        fsdp_tp_make, fsdp_tp_grad = _torch(
            lambda i, f: [TorchShard(f.dim() - 2), TorchShard(f.dim() - 1)], (2, 2), ("dp", "tp")
        )
        out += [
            Sharder("torch_hsdp", hsdp_make, hsdp_grad, _torch_full, _no_kwargs),
            Sharder("torch_fsdp_x_tp", fsdp_tp_make, fsdp_tp_grad, _torch_full, _no_kwargs),
        ]
    return out


def matrices_in(shapes: Sequence[tuple[int, ...]]) -> int:
    """Matrices in parameters of ``shapes`` (one per leading index)."""
    return sum(math.prod(s[:-2]) for s in shapes)

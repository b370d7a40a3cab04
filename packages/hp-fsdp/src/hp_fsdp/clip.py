"""Gradient-norm clipping over sharded gradients: ``torch.nn.utils.clip_grad_norm_`` for
fully_shard'ed (and tensor-parallel) models.

Each parameter's layout (``hp_dtensor.layout_of``) says which mesh axes split it and which
hold replicas. The norm counts every element of the true gradient exactly once: a rank adds
its local contribution ``sum |g|^p`` only where it is the first replica (coordinate 0 on every
replicated axis), and one all-reduce per mesh sums the contributions over the whole mesh, i.e.
over the shard and tensor-parallel axes (replicas hold identical gradients and count once).
The inf-norm takes the maximum over the mesh (replicas change nothing). ``Partial`` gradients
(not reduced yet) are reduced first. The result is the same on every rank; the gradients are
scaled in place exactly as torch does.

Every rank must call it with the same parameters (it is collective over their meshes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh, DTensor, layout_of, redistribute_local
from hp_dtensor.interop import is_torch_dtensor
from hp_dtensor.watchdog import watch
from hp_fsdp.state_dict import fsdp_params
from hp_layout import Layout, Mesh, Partial, Replicate

__all__ = ["clip_grad_norm_", "total_grad_norm"]


@dataclass
class _Grad:
    """One parameter's gradient as this rank holds it."""

    local: torch.Tensor | None
    """This rank's piece of the gradient (reduced where it was Partial)."""
    target: torch.Tensor | None
    """The tensor to scale in place (the piece as stored)."""
    layout: Layout
    counted: bool
    """This rank's piece counts for sum-based norms (first replica on every replicated axis)."""


Parameters = nn.Module | torch.Tensor | Iterable[torch.Tensor]
"""What clip_grad_norm_ takes: a module, one tensor or tensors."""


def _parameters(parameters: Parameters) -> list[torch.Tensor]:
    """The tensors whose gradients count: for a module, the sharded pieces of every parameter
    fully_shard manages (whatever the module holds right now) and its other parameters."""
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    if not isinstance(parameters, nn.Module):
        return list(parameters)
    managed = fsdp_params(parameters).values()
    out: list[torch.Tensor] = [fp.sharded for fp in managed]
    skip = {id(t) for fp in managed for t in (fp.sharded, fp.unsharded) if t is not None}
    out += [p for p in parameters.parameters() if id(p) not in skip]
    return out


def _first_replica(layout: Layout, rank: int) -> bool:
    coordinate = layout.mesh.coordinate(rank)
    return all(
        c == 0
        for c, p in zip(coordinate, layout.placements, strict=True)
        if isinstance(p, Replicate)
    )


def _reduced(local: torch.Tensor, layout: Layout, device_type: str) -> tuple[torch.Tensor, Layout]:
    """A ``Partial`` gradient all-reduced to ``Replicate`` on its partial axes."""
    if not layout.has_partial:
        return local, layout
    whole = layout.with_placements(
        [Replicate() if isinstance(p, Partial) else p for p in layout.placements],
        layout.shard_order,
    )
    mesh = DeviceMesh.lookup(device_type, layout.mesh)
    return redistribute_local(local, layout, whole, mesh), whole


def _gradient(p: torch.Tensor, rank: int) -> _Grad:
    grad = p.grad
    if isinstance(grad, DTensor) or is_torch_dtensor(grad):
        assert grad is not None
        layout = layout_of(grad)
        local: torch.Tensor | None = grad.to_local()  # type: ignore[attr-defined]
    else:
        layout = layout_of(p) if not isinstance(p, DTensor) else p.dist_layout
        local = grad
    target = local
    if local is not None:
        local, layout = _reduced(local, layout, local.device.type)
    if rank not in layout.mesh:
        raise ValueError(f"rank {rank} holds a gradient of {layout!r}, whose mesh lacks it")
    if local is not None and tuple(local.shape) != layout.local_shape(rank):
        raise ValueError(
            f"a gradient of local shape {tuple(local.shape)} does not fit {layout!r}, which "
            f"gives rank {rank} shape {layout.local_shape(rank)}; gradients must have their "
            "parameter's layout (call clip_grad_norm_ after backward has finished)"
        )
    return _Grad(local, target, layout, _first_replica(layout, rank))


def _local_power(local: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum |g|^p`` (``max |g|`` for inf) of a local piece, in float64."""
    if local.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=local.device)
    norm: torch.Tensor = torch.linalg.vector_norm(local.detach(), norm_type, dtype=torch.float64)
    return norm if math.isinf(norm_type) else norm.pow(norm_type)


def _current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _norm_of(grads: list[_Grad], norm_type: float) -> torch.Tensor:
    """The global norm (float64 scalar on the gradients' device), identical on every rank."""
    infinite = math.isinf(norm_type)
    devices = [g.local.device for g in grads if g.local is not None]
    device = devices[0] if devices else torch.device("cpu")
    per_mesh: dict[Mesh, torch.Tensor] = {}
    for g in grads:
        mesh = g.layout.mesh
        acc = per_mesh.setdefault(mesh, torch.zeros((), dtype=torch.float64, device=device))
        if g.local is None or not (infinite or g.counted):
            continue
        value = _local_power(g.local, norm_type).to(device)
        per_mesh[mesh] = torch.maximum(acc, value) if infinite else acc + value
    total = torch.zeros((), dtype=torch.float64, device=device)
    for mesh, value in per_mesh.items():
        if mesh.size > 1:
            group = DeviceMesh.lookup(device.type, mesh).get_mesh_group()
            op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
            with watch("all_reduce (gradient norm for clipping)", group):
                dist.all_reduce(value, op=op, group=group)
        total = torch.maximum(total, value) if infinite else total + value
    return total if infinite else total.pow(1.0 / norm_type)


def _collect(parameters: Parameters, norm_type: float) -> tuple[list[_Grad], torch.dtype]:
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    rank = _current_rank()
    grads = [_gradient(p, rank) for p in _parameters(parameters)]
    dtypes = [g.local.dtype for g in grads if g.local is not None]
    return grads, dtypes[0] if dtypes else torch.float32


def total_grad_norm(parameters: Parameters, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients together, each element counted once (collective)."""
    grads, dtype = _collect(parameters, float(norm_type))
    return _norm_of(grads, float(norm_type)).to(dtype)


def clip_grad_norm_(
    parameters: Parameters,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale the gradients in place so that their global norm is at most ``max_norm``.

    Like ``torch.nn.utils.clip_grad_norm_``: the norm (``norm_type`` 2, 1, any positive
    ``p`` or ``inf``) is taken over all gradients together, as if they were concatenated into
    one vector of the true (unsharded) gradient; gradients are multiplied by
    ``min(1, max_norm / (norm + 1e-6))``. Returns the global norm, the same on every rank.
    Collective: every rank passes the same parameters (a module: its sharded parameters).

    Raises:
        RuntimeError: ``error_if_nonfinite`` and the norm is nan or inf.
    """
    norm_type = float(norm_type)
    grads, dtype = _collect(parameters, norm_type)
    total = _norm_of(grads, norm_type).to(dtype)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            if g.target is not None:
                g.target.mul_(coefficient.to(g.target.device, g.target.dtype))
    return total

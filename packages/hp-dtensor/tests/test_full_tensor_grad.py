"""The gradient through ``DTensor.full_tensor()``, side by side with ``torch.distributed.tensor``.

``full_tensor()``'s result is the same tensor on every rank, so a loss computed from it on
every rank is one loss: the gradient flowing back is ``Replicate`` (torch's default), mapped
back to the source layout. For each source layout -- Replicate, Shard (even and uneven),
Partial(sum), Partial(avg), and 2-D mixes, on meshes (2,), (4,) and (2, 2) -- both libraries
get the same local data, run ``full_tensor()`` then a loss (``sum``, and a sum weighted by a
fixed random fp32 tensor, the same on every rank), and backward; the leaf's whole gradient
(``x.grad.full_tensor()``) must equal torch's exactly (fp32, tolerance 0: the adjoint only
copies, chunks, and adds zeros), except Partial(avg) sources on 4 ranks, where our gradient
is four pieces ``g/4`` whose sum is rounded (relative 1e-6). Where both libraries hold the
gradient in the same layout (Shard and Partial(sum) axes only), the local gradients must be
identical too.

``full_tensor(grad_placements=[Partial()] * ndim)`` is the opt-in to the dual convention
(each rank's loss is a term of a total loss): it must give exactly what ``redistribute`` to
Replicate followed by ``to_local()`` gives, and the same whole gradient as torch's
``full_tensor(grad_placements=[Partial()] * ndim)`` (up to the order of the sum over ranks).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Placement as TorchPlacement

from _harness import as_dtensor
from hp_dtensor import DeviceMesh, DTensor
from hp_dtensor.interop import torch_device_mesh
from hp_layout import Layout, Mesh, Partial, Placement, Replicate, Shard
from hp_layout.reference import scatter
from hp_testing import run_on_ranks
from test_redistribute_vs_torch import _ours, _theirs

# (5, 3): uneven on 2 and 4 ranks along both dims; (4, 6): even along dim 0, and along dim 1
# on 2 ranks (uneven on 4).
SHAPES = ((5, 3), (4, 6))
LOSSES = ("sum", "weighted")


@dataclass
class Record:
    """One rank's view of one case."""

    label: str
    value_ok: bool
    global_ok: bool
    local_ok: bool | None
    error: float


def _mesh(mesh_shape: tuple[int, ...]) -> DeviceMesh:
    return DeviceMesh("cpu", Mesh(mesh_shape, ("a", "b")[: len(mesh_shape)]))


def _local(mesh: DeviceMesh, shape: tuple[int, ...], src: Sequence[str], seed: int) -> torch.Tensor:
    """This rank's piece of a fixed integer-valued fp32 tensor laid out as ``src``."""
    g = torch.Generator().manual_seed(seed)
    value = torch.randint(-9, 10, shape, generator=g).to(torch.float32)
    layout = Layout(shape, mesh.mesh, [_ours(c) for c in src])
    pieces = scatter(value.numpy(), layout, rng=np.random.default_rng(seed))
    return torch.from_numpy(np.ascontiguousarray(pieces[dist.get_rank()]))


def _weight(shape: tuple[int, ...], loss: str, seed: int) -> torch.Tensor:
    """The loss weight: ones (``sum``) or a fixed random fp32 tensor (``weighted``)."""
    if loss == "sum":
        return torch.ones(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))


def _ours_grad(
    mesh: DeviceMesh,
    local: torch.Tensor,
    src: Sequence[str],
    shape: tuple[int, ...],
    weight: torch.Tensor,
    grad_placements: Sequence[Placement] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(forward value, whole gradient, local gradient) through our full_tensor."""
    leaf = local.clone().requires_grad_()
    x = DTensor.from_local(leaf, mesh, [_ours(c) for c in src], shape=shape)
    full = x.full_tensor(grad_placements=grad_placements)
    (full * weight).sum().backward()
    assert leaf.grad is not None
    with torch.no_grad():
        whole = as_dtensor(x.grad).full_tensor()
    return full.detach(), whole, leaf.grad


def _theirs_grad(
    mesh: DeviceMesh,
    local: torch.Tensor,
    src: Sequence[str],
    shape: tuple[int, ...],
    weight: torch.Tensor,
    grad_placements: Sequence[TorchPlacement] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(forward value, whole gradient, local gradient) through torch's full_tensor."""
    t = TorchDTensor.from_local(
        local.clone(),
        torch_device_mesh(mesh),
        [_theirs(c) for c in src],
        run_check=False,
        shape=torch.Size(shape),
        stride=tuple(torch.empty(shape).stride()),
    )
    t.requires_grad_()
    full = t.full_tensor(grad_placements=grad_placements)
    (full * weight).sum().backward()
    grad = t.grad
    assert isinstance(grad, TorchDTensor)
    with torch.no_grad():
        whole = grad.full_tensor()
    return full.detach(), whole, grad.to_local()


def _default_cases(mesh_shape: tuple[int, ...]) -> list[tuple[str, ...]]:
    codes = ("R", "S0", "S1", "P")
    if len(mesh_shape) == 1:
        return [(c,) for c in (*codes, "Pa")]
    return [*itertools.product(codes, repeat=2), ("Pa", "S0"), ("S1", "Pa")]


def _default_body(mesh_shape: tuple[int, ...]) -> list[Record]:
    torch.set_num_threads(1)
    mesh = _mesh(mesh_shape)
    world = mesh.size()
    records: list[Record] = []
    for shape, src, loss in itertools.product(SHAPES, _default_cases(mesh_shape), LOSSES):
        label = f"{shape} {list(src)} {loss}"
        seed = zlib.crc32(label.encode())
        local = _local(mesh, shape, src, seed)
        weight = _weight(shape, loss, seed)
        value, ours, ours_local = _ours_grad(mesh, local, src, shape, weight, None)
        value_t, theirs, theirs_local = _theirs_grad(mesh, local, src, shape, weight, None)
        if "Pa" in src and world > 2:
            global_ok = torch.allclose(ours, theirs, rtol=1e-6, atol=0.0)
        else:
            global_ok = torch.equal(ours, theirs)
        same_layout = all(c in ("S0", "S1", "P") for c in src)
        records.append(
            Record(
                label,
                value_ok=torch.allclose(value, value_t, rtol=1e-6, atol=1e-6),
                global_ok=global_ok,
                local_ok=torch.equal(ours_local, theirs_local) if same_layout else None,
                error=float((ours - theirs).abs().max()),
            )
        )
    return records


def _check(results: list[list[Record]], expected: int) -> None:
    assert all(len(r) == expected for r in results)
    for rank, records in enumerate(results):
        for record in records:
            where = f"rank {rank}, {record.label}"
            assert record.value_ok, f"{where}: forward value differs from torch"
            assert record.global_ok, f"{where}: gradient differs from torch by {record.error}"
            assert record.local_ok in (None, True), f"{where}: local gradient differs from torch"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_full_tensor_gradient_matches_torch(mesh_shape: tuple[int, ...]) -> None:
    world = int(np.prod(mesh_shape))
    results = run_on_ranks(world, _default_body, mesh_shape, timeout=300)
    _check(results, len(SHAPES) * len(LOSSES) * len(_default_cases(mesh_shape)))


def _dual_cases(mesh_shape: tuple[int, ...]) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(source, grad_placements) pairs; grad placements are "R" or "P" per axis."""
    if len(mesh_shape) == 1:
        return [((c,), ("P",)) for c in ("R", "S0", "S1", "P")]
    sources: list[tuple[str, ...]] = [
        ("R", "R"),
        ("S0", "R"),
        ("R", "S1"),
        ("S0", "S1"),
        ("P", "R"),
        ("S1", "P"),
    ]
    grads: list[tuple[str, ...]] = [("P", "P"), ("R", "P")]
    return [(s, g) for g in grads for s in sources]


def _dual_body(mesh_shape: tuple[int, ...]) -> list[Record]:
    """Each rank's loss has its own weight, the same along the axes where the gradient is
    taken as Replicate."""
    torch.set_num_threads(1)
    mesh = _mesh(mesh_shape)
    coordinate = mesh.mesh.coordinate(dist.get_rank())
    records: list[Record] = []
    for shape, (src, grad) in itertools.product(SHAPES, _dual_cases(mesh_shape)):
        label = f"{shape} {list(src)} grad_placements={list(grad)}"
        seed = zlib.crc32(label.encode())
        local = _local(mesh, shape, src, seed)
        key = tuple(c for c, g in zip(coordinate, grad, strict=True) if g == "P")
        weight = _weight(shape, "weighted", seed + 1000 * (1 + zlib.crc32(repr(key).encode())))
        ours_gp = [_ours(g) for g in grad]
        theirs_gp = [_theirs(g) for g in grad]
        _, ours, ours_local = _ours_grad(mesh, local, src, shape, weight, ours_gp)
        _, theirs, _ = _theirs_grad(mesh, local, src, shape, weight, theirs_gp)
        local_ok: bool | None = None
        if all(g == "P" for g in grad):
            # The old (dual) path: redistribute to Replicate, then the local tensor.
            leaf = local.clone().requires_grad_()
            x = DTensor.from_local(leaf, mesh, [_ours(c) for c in src], shape=shape)
            y = x.redistribute(placements=[Replicate()] * mesh.ndim).to_local()
            (y * weight).sum().backward()
            assert leaf.grad is not None
            local_ok = torch.equal(ours_local, leaf.grad)
        records.append(
            Record(
                label,
                value_ok=True,
                global_ok=torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6),
                local_ok=local_ok,
                error=float((ours - theirs).abs().max()),
            )
        )
    return records


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_grad_placements_partial_is_the_dual_convention(mesh_shape: tuple[int, ...]) -> None:
    world = int(np.prod(mesh_shape))
    results = run_on_ranks(world, _dual_body, mesh_shape, timeout=300)
    _check(results, len(SHAPES) * len(_dual_cases(mesh_shape)))


def _options_body() -> dict[str, str]:
    torch.set_num_threads(1)
    mesh = _mesh((2,))
    x = DTensor.from_local(torch.ones(2, 3, requires_grad=True), mesh, [Shard(0)])
    out: dict[str, str] = {}
    for name, gp in (("shard", [Shard(0)]), ("avg", [Partial("avg")]), ("length", [])):
        try:
            x.full_tensor(grad_placements=gp)
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)
    # Explicit Replicate is the default; without grad the result is the plain gathered tensor.
    explicit = x.full_tensor(grad_placements=[Replicate()])
    explicit.sum().backward()
    out["explicit"] = repr(as_dtensor(x.grad).full_tensor().tolist())
    with torch.no_grad():
        out["no_grad"] = repr(x.full_tensor().grad_fn)
    return out


@pytest.mark.multiprocess
def test_grad_placements_are_checked() -> None:
    for out in run_on_ranks(2, _options_body, timeout=120):
        assert "Replicate() or Partial('sum')" in out["shard"], out
        assert "Replicate() or Partial('sum')" in out["avg"], out
        assert "one placement per mesh axis" in out["length"], out
        assert out["explicit"] == repr([[1.0] * 3] * 4), out
        assert out["no_grad"] == "None", out

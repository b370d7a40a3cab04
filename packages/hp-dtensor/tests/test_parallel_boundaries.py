"""Production-mode boundary conversions (compiled once per local shape) against torch DTensor
and against the generic plan executor, for every pair of placements.

On a 1-D mesh of 2 ranks, every source and destination in {Replicate, Shard on each dim,
Partial(sum)} (except Shard -> Partial, which ``hp_layout`` refuses) runs on uneven 2-D shapes
and an even 3-D one (``Shard(-1)`` included, the column-parallel output), from identical local
data, through :meth:`BoundaryConverter.move`, with and without ``owned`` (the in-place sum of a
fresh row-parallel output). The local results must be identical to torch's
``DTensor.redistribute`` (where torch accepts the pair) and to ``redistribute_local`` (the
generic executor), and so must the input gradients for the same random cotangent. An owned
sum runs in place; a non-contiguous one is still right.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Placement as TorchPlacement
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard

from hp_dtensor import DeviceMesh
from hp_dtensor.interop import torch_device_mesh
from hp_dtensor.parallel._boundary import BoundaryConverter
from hp_dtensor.redistribute import redistribute_local
from hp_layout import Layout, Mesh, Partial, Placement, Replicate, Shard
from hp_layout.reference import scatter
from hp_testing import run_on_ranks

CASES: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...] = (
    ((5, 3), ("R", "S0", "S1", "P")),
    ((3, 7), ("R", "S0", "S1", "P")),
    ((2, 4, 6), ("R", "S0", "S2", "S-1", "P")),
)


def _ours(code: str) -> Placement:
    if code == "R":
        return Replicate()
    if code == "P":
        return Partial("sum")
    return Shard(int(code[1:]))


def _theirs(code: str) -> TorchPlacement:
    if code == "R":
        return TorchReplicate()
    if code == "P":
        return TorchPartial("sum")
    return TorchShard(int(code[1:]))


@dataclass
class Record:
    """One rank's view of one (shape, src, dst, owned) case."""

    label: str
    same_as_generic: bool
    same_grad: bool
    same_as_torch: bool | None  # None: torch refuses the pair (non-Partial -> Partial)
    in_place: bool | None  # an owned sum: whether it reused the input; None otherwise
    box_ok: bool


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(s) for s in torch.empty(shape).stride())


def _case(mesh: DeviceMesh, shape: tuple[int, ...], src: str, dst: str, owned: bool) -> Record:
    rank = dist.get_rank()
    seed = zlib.crc32(repr((shape, src, dst)).encode())
    value = torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(seed))
    value = value.to(torch.float64)
    src_layout = Layout(shape, mesh.mesh, [_ours(src)])
    dst_layout = Layout(shape, mesh.mesh, [_ours(dst)])
    pieces = scatter(value.numpy(), src_layout, rng=np.random.default_rng(seed))
    local = torch.from_numpy(np.ascontiguousarray(pieces[rank]))

    converter = BoundaryConverter(mesh)
    leaf = local.clone().requires_grad_()
    fresh = leaf * 1.0  # what a module hands on: a result nothing else holds
    move = converter.move(fresh, _ours(src), _ours(dst), owned=owned)
    y = fresh if move is None else move(fresh)
    in_place = y.data_ptr() == fresh.data_ptr() if owned and src == "P" and dst == "R" else None
    gathers = src.startswith("S") and dst == "R"
    box_ok = (move is not None and move.gathered_box == src_layout.local_region(rank).box) or (
        not gathers and (move is None or move.gathered_box is None)
    )

    generic_leaf = local.clone().requires_grad_()
    y_generic = redistribute_local(generic_leaf * 1.0, src_layout, dst_layout, mesh)
    cotangent = torch.randn(
        y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + rank)
    )
    (grad,) = torch.autograd.grad(y, leaf, cotangent)
    (grad_generic,) = torch.autograd.grad(y_generic, generic_leaf, cotangent)

    same_as_torch = None
    if not (src != "P" and dst == "P"):
        tmesh = torch_device_mesh(mesh)
        theirs = TorchDTensor.from_local(
            local.clone(),
            tmesh,
            [_theirs(src)],
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_strides(shape),
        ).redistribute(tmesh, [_theirs(dst)])
        same_as_torch = bool(torch.equal(y.detach(), theirs.to_local()))
    return Record(
        label=f"{shape} {src} -> {dst}{' owned' if owned else ''}",
        same_as_generic=bool(torch.equal(y.detach(), y_generic.detach())),
        same_grad=bool(torch.equal(grad, grad_generic)),
        same_as_torch=same_as_torch,
        in_place=in_place,
        box_ok=box_ok,
    )


def _body() -> list[Record]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("a",)))
    records: list[Record] = []
    for shape, codes in CASES:
        for src, dst in itertools.product(codes, codes):
            if src.startswith("S") and dst == "P":
                continue  # hp_layout refuses it (see test_redistribute_vs_torch)
            records.extend(_case(mesh, shape, src, dst, owned) for owned in (False, True))
    return records


@pytest.mark.multiprocess
def test_every_boundary_pair_matches_torch_and_the_generic_executor() -> None:
    results = run_on_ranks(2, _body, timeout=300)
    for views in zip(*results, strict=True):
        label = views[0].label
        assert all(v.same_as_generic for v in views), f"{label}: differs from execute_plan"
        assert all(v.same_grad for v in views), f"{label}: gradient differs from execute_plan"
        assert all(v.same_as_torch in (None, True) for v in views), f"{label}: differs from torch"
        assert all(v.in_place in (None, True) for v in views), f"{label}: not in place"
        assert all(v.box_ok for v in views), f"{label}: wrong gathered box"
    # Every pair ran: 2-D 4 x 4 - 2 (S -> P) per shape, 3-D 5 x 5 - 3, each owned or not.
    assert len(results[0]) == 2 * (2 * 14 + 22)


def _non_contiguous_owned_sum() -> bool:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("a",)))
    rank = dist.get_rank()
    leaf = (torch.arange(12.0).reshape(3, 4) * (rank + 1)).requires_grad_()
    fresh = (leaf * 1.0).t()  # owned but not contiguous: reduced out of place, same value
    move = BoundaryConverter(mesh).move(fresh, Partial("sum"), Replicate(), owned=True)
    assert move is not None
    y = move(fresh)
    y.sum().backward()
    assert leaf.grad is not None
    want = torch.arange(12.0).reshape(3, 4).t() * 3
    return bool(torch.equal(y.detach(), want)) and bool(
        torch.equal(leaf.grad, torch.full_like(leaf, 2.0))
    )


@pytest.mark.multiprocess
def test_an_owned_sum_of_a_non_contiguous_tensor_is_right() -> None:
    assert all(run_on_ranks(2, _non_contiguous_owned_sum, timeout=60))

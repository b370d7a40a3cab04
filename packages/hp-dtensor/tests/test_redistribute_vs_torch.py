"""Our redistribution side by side with ``torch.distributed.tensor``'s, for every pair.

On a 1-D mesh (world 2) and a (2, 2) mesh (world 4), every source and destination made of
{Replicate, Shard(0), Shard(1), Partial(sum)} per axis (16 and 256 pairs) runs on uneven
shapes in both libraries from identical local data (Partial sources get the same random
integer pieces), and the local results must be identical. Where a library refuses, the
refusal must be the documented one:

* ours refuses exactly the pairs that ask some axis to go from Shard to Partial
  (``hp_layout.RedistributionError``: the data would have to be replicated first);
* torch refuses exactly the pairs that ask some axis to go from a non-Partial placement to
  Partial (``Replicate -> Partial`` is "for internal use only" in torch 2.13).

So the pairs with a ``Replicate -> Partial`` axis and no ``Shard -> Partial`` axis run in
ours only; there the reduced value must equal the source value (we partition by keeping the
value on coordinate 0 and zeros elsewhere; torch's private partition divides by the axis
size). Every pair ours accepts is also checked to backpropagate the true adjoint:
``sum_r <y_r, c_r> == sum_r <x_r, grad_r>`` over the ranks, for random cotangents ``c_r``.
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

from hp_dtensor import DeviceMesh, DTensor
from hp_dtensor.interop import torch_device_mesh
from hp_layout import Layout, Mesh, Partial, Placement, RedistributionError, Replicate, Shard
from hp_layout.reference import scatter
from hp_testing import run_on_ranks

CODES = ("R", "S0", "S1", "P")
SHAPES = ((5, 3), (3, 7))

Pair = tuple[tuple[str, ...], tuple[str, ...]]


@dataclass
class PairRecord:
    """One rank's view of one (shape, src, dst) case."""

    shape: tuple[int, ...]
    src: tuple[str, ...]
    dst: tuple[str, ...]
    ours: str  # "ok" or "refused: <message>"
    theirs: str
    same_local: bool | None = None
    value_ok: bool | None = None
    lhs: float = 0.0
    rhs: float = 0.0


def _ours(code: str) -> Placement:
    table: dict[str, Placement] = {
        "R": Replicate(),
        "S0": Shard(0),
        "S1": Shard(1),
        "P": Partial("sum"),
        "Pa": Partial("avg"),
    }
    return table[code]


def _theirs(code: str) -> TorchPlacement:
    table: dict[str, TorchPlacement] = {
        "R": TorchReplicate(),
        "S0": TorchShard(0),
        "S1": TorchShard(1),
        "P": TorchPartial("sum"),
        "Pa": TorchPartial("avg"),
    }
    return table[code]


def ours_refuses(src: tuple[str, ...], dst: tuple[str, ...]) -> bool:
    """Documented: hp_layout refuses Shard -> Partial on any axis."""
    return any(s.startswith("S") and d == "P" for s, d in zip(src, dst, strict=True))


def torch_refuses(src: tuple[str, ...], dst: tuple[str, ...]) -> bool:
    """Observed in torch 2.13: redistribute refuses any non-Partial -> Partial axis."""
    return any(s != "P" and d == "P" for s, d in zip(src, dst, strict=True))


def _value(shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    return torch.randint(-9, 10, shape, generator=g).to(torch.float64)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(s) for s in torch.empty(shape).stride())


class _Case:
    """One pair on this rank: builds both libraries' inputs from the same pieces."""

    def __init__(self, mesh: DeviceMesh, shape: tuple[int, ...], pair: Pair, seed: int):
        self.mesh, self.shape, (self.src, self.dst), self.seed = mesh, shape, pair, seed
        self.rank = dist.get_rank()
        self.value = _value(shape)
        layout = Layout(shape, mesh.mesh, [_ours(c) for c in self.src])
        pieces = scatter(self.value.numpy(), layout, rng=np.random.default_rng(seed))
        self.local = torch.from_numpy(np.ascontiguousarray(pieces[self.rank]))

    def run_ours(self, record: PairRecord) -> DTensor | None:
        x_local = self.local.clone().requires_grad_()
        x = DTensor.from_local(x_local, self.mesh, [_ours(c) for c in self.src], shape=self.shape)
        try:
            y = x.redistribute(placements=[_ours(c) for c in self.dst])
        except RedistributionError as exc:
            record.ours = f"refused: {exc}"
            return None
        record.ours = "ok"
        record.value_ok = bool(torch.equal(y.full_tensor().detach(), self.value))
        y_local = y.to_local()
        g = torch.Generator().manual_seed(self.seed * 31 + self.rank)
        cot = torch.randn(y_local.shape, dtype=torch.float64, generator=g)
        (grad,) = torch.autograd.grad(y_local, x_local, cot, allow_unused=True)
        grad = torch.zeros_like(x_local) if grad is None else grad
        record.lhs = float((y_local.detach() * cot).sum())
        record.rhs = float((x_local.detach() * grad).sum())
        return y

    def run_theirs(self, record: PairRecord) -> torch.Tensor | None:
        tmesh = torch_device_mesh(self.mesh)
        t = TorchDTensor.from_local(
            self.local.clone(),
            tmesh,
            [_theirs(c) for c in self.src],
            run_check=False,
            shape=torch.Size(self.shape),
            stride=_contiguous_strides(self.shape),
        )
        try:
            u = t.redistribute(tmesh, [_theirs(c) for c in self.dst])
        except RuntimeError as exc:
            record.theirs = f"refused: {exc}"
            return None
        record.theirs = "ok"
        return u.to_local()


def _body(mesh_shape: tuple[int, ...]) -> list[PairRecord]:
    torch.set_num_threads(1)
    names = ("a", "b")[: len(mesh_shape)]
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    per_axis = list(itertools.product(CODES, repeat=len(mesh_shape)))
    records: list[PairRecord] = []
    for shape in SHAPES:
        for src, dst in itertools.product(per_axis, per_axis):
            seed = zlib.crc32(repr((shape, src, dst)).encode())
            case = _Case(mesh, shape, (src, dst), seed)
            record = PairRecord(shape, src, dst, ours="", theirs="")
            y = case.run_ours(record)
            u = case.run_theirs(record)
            if y is not None and u is not None:
                record.same_local = bool(torch.equal(y.to_local().detach(), u))
            records.append(record)
    return records


def _check(results: list[list[PairRecord]]) -> dict[str, int]:
    """Assert on every pair; returns counts for the summary."""
    counts = {"both": 0, "ours_only": 0, "neither": 0}
    by_pair = list(zip(*results, strict=True))
    for views in by_pair:
        first = views[0]
        label = f"{first.shape} {list(first.src)} -> {list(first.dst)}"
        ours_ok = {v.ours == "ok" for v in views}
        theirs_ok = {v.theirs == "ok" for v in views}
        assert len(ours_ok) == 1, f"{label}: ranks disagree"
        assert len(theirs_ok) == 1, f"{label}: ranks disagree"
        assert (first.ours != "ok") == ours_refuses(first.src, first.dst), (label, first.ours)
        assert (first.theirs != "ok") == torch_refuses(first.src, first.dst), (
            label,
            first.theirs,
        )
        if first.ours != "ok":
            assert "a Partial destination needs Replicate" in first.ours, first.ours
            assert first.theirs != "ok", f"{label}: torch accepts what we refuse"
            counts["neither"] += 1
            continue
        assert all(v.value_ok for v in views), f"{label}: our reduced value is wrong"
        lhs = sum(v.lhs for v in views)
        rhs = sum(v.rhs for v in views)
        assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-10), f"{label}: not the adjoint"
        if first.theirs == "ok":
            bad = [r for r, v in enumerate(views) if not v.same_local]
            assert not bad, f"{label}: local shards differ from torch on ranks {bad}"
            counts["both"] += 1
        else:
            counts["ours_only"] += 1
    return counts


@pytest.mark.multiprocess
def test_every_pair_on_a_1d_mesh_matches_torch() -> None:
    counts = _check(run_on_ranks(2, _body, (2,), timeout=300))
    # 16 pairs per shape: R->P is ours only, S->P neither.
    assert counts == {"both": 2 * 13, "ours_only": 2 * 1, "neither": 2 * 2}


@pytest.mark.multiprocess
def test_every_pair_on_a_2d_mesh_matches_torch() -> None:
    counts = _check(run_on_ranks(4, _body, (2, 2), timeout=300))
    # Per axis, 13 of 16 (src, dst) pairs run in both, 14 in ours.
    assert counts == {"both": 2 * 13 * 13, "ours_only": 2 * (14 * 14 - 13 * 13), "neither": 2 * 60}

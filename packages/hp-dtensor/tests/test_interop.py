"""Interop with torch.distributed.tensor: layouts, zero-copy conversions, gradients, DCP.

Pure tests check the placement mapping against torch's own code (``_StridedShard`` splits,
``DTensorSpec``'s shard-order encoding) without processes. Multi-rank tests (world 2 on a
(2,) mesh, world 4 on a (2, 2) mesh) convert every placement combination both ways, check
storage sharing, values and gradients, and round-trip state dicts through
``torch.distributed.checkpoint`` into other layouts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Placement as TorchPlacement
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

from hp_dtensor import DeviceMesh, DTensor, distribute_tensor, grad_layout
from hp_dtensor.interop import (
    InteropError,
    annotate_layout,
    from_torch_dtensor,
    from_torch_state_dict,
    layout_from_torch,
    layout_of,
    to_torch_dtensor,
    to_torch_state_dict,
    torch_device_mesh,
    torch_placements,
)
from hp_layout import Layout, Mesh, Partial, Placement, RaggedShard, ReduceOp, Replicate, Shard
from hp_layout.reference import scatter
from hp_testing import run_on_ranks

# Pure: layouts of plain tensors ------------------------------------------------------------------


def test_a_plain_tensor_has_a_single_rank_replicated_layout() -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = layout_of(torch.zeros(4, 3))
    assert layout == Layout((4, 3), Mesh((1,), ("replica",), (rank,)), [Replicate()])
    assert layout.local_shape(0) == (4, 3)


def test_an_annotated_parameter_reports_its_layout() -> None:
    layout = Layout((5, 3), Mesh((2,), ("x",)), [Shard(0)])
    param = torch.nn.Parameter(torch.zeros(2, 3))
    assert annotate_layout(param, layout, rank=1) is param
    assert layout_of(param) is layout
    assert layout_of(param.detach()) != layout  # the annotation stays on that object
    with pytest.raises(ValueError, match=r"gives this rank shape \(3, 3\)"):
        annotate_layout(torch.zeros(2, 3), layout, rank=0)
    with pytest.raises(ValueError, match="rank 7 is not in"):
        annotate_layout(torch.zeros(2, 3), layout, rank=7)
    with pytest.raises(TypeError, match=r"hp_layout\.Layout"):
        annotate_layout(torch.zeros(2, 3), "Shard(0)", rank=0)  # type: ignore[arg-type]


# Pure: placement mapping ------------------------------------------------------------------------


MESH2 = Mesh((2,), ("x",))
MESH22 = Mesh((2, 2), ("dp", "tp"))


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (Replicate(), TorchReplicate()),
        (Shard(0), TorchShard(0)),
        (Shard(1), TorchShard(1)),
        (Partial("sum"), TorchPartial("sum")),
        (Partial("avg"), TorchPartial("avg")),
        (Partial("max"), TorchPartial("max")),
        (Partial("min"), TorchPartial("min")),
    ],
)
def test_simple_placements_map_one_to_one(ours: Placement, theirs: TorchPlacement) -> None:
    layout = Layout((5, 3), MESH2, [ours])
    assert torch_placements(layout) == (theirs,)
    assert layout_from_torch((5, 3), MESH2, [theirs]) == layout


def test_negative_torch_shard_dims_are_normalized() -> None:
    assert layout_from_torch((5, 3), MESH2, [TorchShard(-1)]) == Layout((5, 3), MESH2, [Shard(1)])


def test_fsdp2_on_tp_is_a_tp_first_shard_order() -> None:
    """FSDP2 over a TP-sharded parameter: dim 0 split by tp first, then by dp."""
    fsdp_tp = [_StridedShard(0, split_factor=2), TorchShard(0)]
    layout = layout_from_torch((8, 4), MESH22, fsdp_tp)
    assert layout == Layout((8, 4), MESH22, [Shard(0), Shard(0)], ("tp", "dp"))
    assert layout.dim_interval(0, (1, 0)) == (2, 4)  # (dp=1, tp=0) holds rows 2-3
    assert torch_placements(layout) == tuple(fsdp_tp)
    # The default order needs no _StridedShard.
    default = Layout((8, 4), MESH22, [Shard(0), Shard(0)])
    assert torch_placements(default) == (TorchShard(0), TorchShard(0))


class _SizedMesh:
    """Just enough of a torch DeviceMesh for DTensorSpec's static shard-order helpers."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)

    def size(self, mesh_dim: int) -> int:
        return self.shape[mesh_dim]


def _torch_elements(
    length: int,
    mesh_shape: Sequence[int],
    placements: Sequence[TorchPlacement],
    coord: Sequence[int],
) -> list[int]:
    """Indices of dim 0 that torch's own splitting gives ``coord`` (left to right)."""
    local = torch.arange(length)
    for axis, placement in enumerate(placements):
        if isinstance(placement, TorchShard | _StridedShard):
            pieces, _ = placement._split_tensor(local, mesh_shape[axis], with_padding=False)
            local = pieces[coord[axis]]
    return [int(i) for i in local.tolist()]


NESTING_MESHES = [(2, 2), (3, 2), (2, 3), (4, 2), (2, 2, 2), (3, 2, 2)]


def _nested_layouts() -> list[Layout]:
    out: list[Layout] = []
    for shape in NESTING_MESHES:
        names = ("a", "b", "c")[: len(shape)]
        mesh = Mesh(shape, names)
        for k in range(2, len(shape) + 1):
            for axes in itertools.permutations(range(len(shape)), k):
                placements = [Shard(0) if i in axes else Replicate() for i in range(len(shape))]
                order = [names[i] for i in axes]
                out.extend(Layout((n, 2), mesh, placements, order) for n in range(14))
    return out


def test_nested_shards_agree_with_torchs_own_splitting() -> None:
    """Each nested layout either maps to torch placements that give every rank exactly our
    elements (checked with torch's own ``_split_tensor``), or raises because torch's split
    differs; mapped placements equal ``DTensorSpec``'s own encoding of the shard order."""
    mapped = refused = 0
    layouts = _nested_layouts()
    for layout in layouts:
        mesh = layout.mesh
        order = tuple(mesh.axis_index(n) for n in layout.dim_sharding(0))
        spec_placements = DTensorSpec._convert_shard_order_to_StridedShard(
            (ShardOrderEntry(tensor_dim=0, mesh_dims=order),),
            tuple(
                TorchShard(0) if isinstance(p, Shard) else TorchReplicate()
                for p in layout.placements
            ),
            _SizedMesh(mesh.shape),  # type: ignore[arg-type]
        )
        differs = False
        for coord in itertools.product(*(range(n) for n in mesh.shape)):
            start, stop = layout.dim_interval(0, coord)
            theirs = _torch_elements(layout.global_shape[0], mesh.shape, spec_placements, coord)
            differs |= theirs != list(range(start, stop))
        if differs:
            with pytest.raises(InteropError, match="_StridedShard splits unevenly"):
                torch_placements(layout)
            refused += 1
            continue
        placements = torch_placements(layout)
        assert placements == spec_placements
        assert layout_from_torch(layout.global_shape, mesh, placements) == layout
        for coord in itertools.product(*(range(n) for n in mesh.shape)):
            local, _ = _compute_local_shape_and_global_offset(
                layout.global_shape, mesh.shape, list(coord), placements
            )
            assert local == layout.region_at(coord).shape
        mapped += 1
    assert mapped + refused == len(layouts)
    assert 0 < refused < mapped  # 31 of 448 refused


def test_unmappable_placements_raise_clear_errors() -> None:
    ragged = Layout((6,), MESH2, [RaggedShard((4, 2))])
    with pytest.raises(InteropError, match=r"RaggedShard.*no torch counterpart"):
        torch_placements(ragged)
    with pytest.raises(InteropError, match="'product'"):
        layout_from_torch((4,), MESH2, [TorchPartial("product")])
    with pytest.raises(InteropError, match="_MaskPartial"):
        layout_from_torch((4,), MESH2, [_MaskPartial(offset_shape=None, offset_dim=0)])
    with pytest.raises(InteropError, match="no nesting order"):
        layout_from_torch((8,), MESH22, [_StridedShard(0, split_factor=3), TorchShard(0)])
    uneven = [_StridedShard(0, split_factor=2), TorchShard(0)]
    with pytest.raises(InteropError, match="different elements of dim 0"):
        layout_from_torch((7,), Mesh((3, 2), ("dp", "tp")), uneven)
    with pytest.raises(InteropError, match="2 axes"):
        layout_from_torch((4,), MESH22, [TorchShard(0)])


# Multi-rank: conversions and gradients ----------------------------------------------------------


PLACEMENT_CODES: dict[str, Placement] = {
    "R": Replicate(),
    "S0": Shard(0),
    "S1": Shard(1),
    "Psum": Partial("sum"),
    "Pavg": Partial("avg"),
    "Pmax": Partial("max"),
    "Pmin": Partial("min"),
}


@dataclass
class InteropReport:
    """One rank's findings (failures must be empty)."""

    failures: list[str] = field(default_factory=list)
    cases: int = 0


MESH_2D_CODES = [
    ("R", "R"),
    ("S0", "S1"),
    ("S1", "S0"),
    ("S0", "R"),
    ("R", "S1"),
    ("Psum", "S0"),
    ("S1", "Psum"),
    ("Pavg", "R"),
    ("R", "Pmax"),
    ("Pmin", "S0"),
    ("S0", "Pavg"),
    ("Psum", "Psum"),
    ("Pavg", "Pavg"),
    ("Pmax", "Pmax"),
    ("Pmin", "Pmin"),
]
"""On the (2, 2) mesh: every placement on each axis, with shards, replicas and partials."""


def _layouts(mesh: Mesh) -> list[Layout]:
    """The placements on a (5, 3) tensor (uneven), and nested shards on 2-D."""
    if mesh.ndim == 1:
        return [Layout((5, 3), mesh, [p]) for p in PLACEMENT_CODES.values()]
    out = [Layout((5, 3), mesh, [PLACEMENT_CODES[a], PLACEMENT_CODES[b]]) for a, b in MESH_2D_CODES]
    nested = itertools.product(((5, 3), (8, 3)), (("a", "b"), ("b", "a")))
    return out + [Layout(shape, mesh, [Shard(0), Shard(0)], order) for shape, order in nested]


def _expected_piece_grad(
    layout: Layout, pieces: dict[int, Any], cot: torch.Tensor, rank: int
) -> torch.Tensor | None:
    """The true derivative of the reduced value with respect to this rank's piece, for
    layouts that are Partial on every axis (None otherwise)."""
    if len(layout.partial_axes) != layout.mesh.ndim:
        return None
    (op,) = {p.op for p in layout.placements if isinstance(p, Partial)}
    if op is ReduceOp.SUM:
        return cot
    if op is ReduceOp.AVG:
        return cot / layout.mesh.size
    stacked = torch.stack([torch.from_numpy(pieces[r]) for r in layout.mesh.ranks])
    result = stacked.amax(0) if op is ReduceOp.MAX else stacked.amin(0)
    hits = (stacked == result).to(torch.float64)
    mine = hits[layout.mesh.ranks.index(rank)]
    return cot * mine / hits.sum(0)


class _Conversion:
    """Checks one layout on this rank; appends failures to the report."""

    def __init__(self, mesh: DeviceMesh, layout: Layout, seed: int, report: InteropReport):
        self.mesh, self.layout, self.report = mesh, layout, report
        self.rank = dist.get_rank()
        g = torch.Generator().manual_seed(seed)
        self.value = torch.randint(-3, 4, layout.global_shape, generator=g).to(torch.float64)
        self.cot = torch.randn(layout.global_shape, dtype=torch.float64, generator=g)
        self.pieces = scatter(self.value.numpy(), layout, rng=np.random.default_rng(seed))
        self.local = torch.from_numpy(np.ascontiguousarray(self.pieces[self.rank]))

    def fail(self, what: str) -> None:
        self.report.failures.append(f"rank {self.rank} {self.layout!r}: {what}")

    def ours(self) -> tuple[DTensor, torch.Tensor]:
        leaf = self.local.clone().requires_grad_()
        x = DTensor.from_local(
            leaf,
            self.mesh,
            self.layout.placements,
            shape=self.layout.global_shape,
            shard_order=self.layout.shard_order,
        )
        return x, leaf

    def theirs(self, leaf: torch.Tensor) -> TorchDTensor:
        shape = self.layout.global_shape
        return TorchDTensor.from_local(
            leaf,
            torch_device_mesh(self.mesh),
            torch_placements(self.layout),
            run_check=False,
            shape=torch.Size(shape),
            stride=tuple(torch.empty(shape).stride()),
        )

    def check_to_torch(self) -> None:
        x, leaf = self.ours()
        t = to_torch_dtensor(x)
        if t.to_local().data_ptr() != leaf.data_ptr():
            self.fail("to_torch_dtensor copied the local tensor")
        if tuple(t.shape) != self.layout.global_shape or layout_of(t) != self.layout:
            self.fail(f"torch DTensor has shape {tuple(t.shape)}, layout {layout_of(t)!r}")
        full = t.full_tensor()  # torch's own reading of our shards
        if not torch.equal(full.detach(), self.value):
            self.fail("torch's full_tensor differs from the value")
        back = from_torch_dtensor(t)
        if back.dist_layout != self.layout or back.to_local().data_ptr() != leaf.data_ptr():
            self.fail(f"round trip gave {back.dist_layout!r} or copied")
        (full * self.cot).sum().backward()
        assert leaf.grad is not None
        grad = DTensor(leaf.grad, grad_layout(self.layout), self.mesh).full_tensor()
        if not torch.allclose(grad, self.cot, rtol=1e-12, atol=1e-12):
            self.fail(f"gradient through torch {grad.tolist()} != {self.cot.tolist()}")
        piece = _expected_piece_grad(self.layout, self.pieces, self.cot, self.rank)
        if piece is not None and not torch.allclose(leaf.grad, piece, rtol=1e-12, atol=1e-12):
            self.fail(f"piece gradient {leaf.grad.tolist()} != {piece.tolist()}")

    def check_from_torch(self) -> None:
        """A torch leaf's local gradient is the same through our ops and through torch's."""
        leaf = self.local.clone().requires_grad_()
        x = from_torch_dtensor(self.theirs(leaf))
        if x.dist_layout != self.layout or x.to_local().data_ptr() != leaf.data_ptr():
            self.fail(f"from_torch_dtensor gave {x.dist_layout!r} or copied")
        full = x.full_tensor()
        if not torch.equal(full.detach(), self.value):
            self.fail("our full_tensor of the converted torch DTensor differs")
        # The loss is one global scalar: in our dual layout its seed is 1 on one rank.
        first = self.rank == self.layout.mesh.ranks[0]
        (full * self.cot).sum().backward(torch.tensor(1.0 if first else 0.0, dtype=full.dtype))
        reference = self.local.clone().requires_grad_()
        (self.theirs(reference).full_tensor() * self.cot).sum().backward()
        assert leaf.grad is not None
        assert reference.grad is not None
        if not torch.allclose(leaf.grad, reference.grad, rtol=1e-12, atol=1e-12):
            self.fail(
                f"torch leaf grad {leaf.grad.tolist()} != torch-only {reference.grad.tolist()}"
            )


def _conversions(mesh_shape: tuple[int, ...]) -> InteropReport:
    torch.set_num_threads(1)
    names = ("a", "b")[: len(mesh_shape)]
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    report = InteropReport()
    for n, layout in enumerate(_layouts(mesh.mesh)):
        case = _Conversion(mesh, layout, seed=n, report=report)
        case.check_to_torch()
        case.check_from_torch()
        report.cases += 1
    return report


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_conversions_share_storage_and_gradients(world: int) -> None:
    mesh_shape = (2,) if world == 2 else (2, 2)
    reports = run_on_ranks(world, _conversions, mesh_shape, timeout=300)
    failures = [f for r in reports for f in r.failures]
    assert not failures, "\n".join(failures[:10])
    assert reports[0].cases == (7 if world == 2 else len(MESH_2D_CODES) + 4)


def _stage_submesh_to_torch() -> tuple[list[int], list[int], bool]:
    torch.set_num_threads(1)
    root = DeviceMesh("cpu", Mesh((2, 2, 1), ("pp", "dp", "tp")))
    # Ranks of different "pp" rows convert *different* sub-meshes at the same point, as
    # pipeline stages do when they build their state dicts.
    stage = root[["dp", "tp"]]
    converted = stage.to_torch()
    sliced = root.to_torch()[("dp", "tp")]
    group = converted.get_group("dp")
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=group)
    return (
        converted.mesh.flatten().tolist(),
        [int(value.item())],
        converted.get_group("dp") is sliced.get_group("dp"),
    )


@pytest.mark.multiprocess
def test_sub_meshes_of_one_root_convert_through_the_root() -> None:
    """Each pipeline stage converting its own sub-mesh never pairs mismatched group
    creations: the conversion slices the root's torch mesh, built by every rank."""
    results = run_on_ranks(4, _stage_submesh_to_torch, timeout=120)
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[1] for r in results] == [[1], [1], [5], [5]]
    assert all(r[2] for r in results)


# Multi-rank: torch.distributed.checkpoint -------------------------------------------------------


LayoutSpecs = dict[str, tuple[list[Placement], tuple[str, ...] | None]]


def _state(mesh: DeviceMesh, layouts: LayoutSpecs, zero: bool) -> dict[str, Any]:
    values = _checkpoint_values()
    sd: dict[str, Any] = {}
    for key, (placements, order) in layouts.items():
        value = torch.zeros_like(values[key]) if zero else values[key]
        sd[key] = distribute_tensor(value, mesh, placements, shard_order=order, src_data_rank=None)
    sd["optim"] = {"step": 0 if zero else 7, "exp_avg": sd["w"]}
    return sd


def _checkpoint_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "b": torch.randn(7, generator=g, dtype=torch.float64),
        "nested": torch.randn(5, 3, generator=g, dtype=torch.float64),
    }


def _checkpoint_layouts(ndim: int) -> tuple[LayoutSpecs, LayoutSpecs]:
    """Save layouts (uneven, nested on 2-D) and different load layouts."""
    save: LayoutSpecs
    load: LayoutSpecs
    if ndim == 1:
        save = {"w": ([Shard(0)], None), "b": ([Shard(0)], None), "nested": ([Shard(1)], None)}
        load = {"w": ([Shard(1)], None), "b": ([Replicate()], None), "nested": ([Shard(0)], None)}
        return save, load
    save = {
        "w": ([Shard(0), Shard(1)], None),
        "b": ([Shard(0), Shard(0)], None),
        "nested": ([Shard(0), Shard(0)], ("b", "a")),  # a torch _StridedShard
    }
    load = {
        "w": ([Shard(1), Replicate()], None),
        "b": ([Replicate(), Shard(0)], None),
        "nested": ([Shard(1), Shard(0)], None),
    }
    return save, load


def _checkpoint(path: str, mesh_shape: tuple[int, ...]) -> list[str]:
    torch.set_num_threads(1)
    names = ("a", "b")[: len(mesh_shape)]
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    save_layouts, load_layouts = _checkpoint_layouts(len(mesh_shape))
    values = _checkpoint_values()
    dcp_save(to_torch_state_dict(_state(mesh, save_layouts, zero=False)), checkpoint_id=path)
    problems: list[str] = []
    for label, layouts in (("same", save_layouts), ("other", load_layouts)):
        target = _state(mesh, layouts, zero=True)
        converted = to_torch_state_dict(target)
        dcp_load(converted, checkpoint_id=path)
        back = from_torch_state_dict(converted)
        for key, value in values.items():
            # Loading filled our DTensors' storage in place; the converted-back dict agrees.
            for where, tensor in (("in place", target[key]), ("converted", back[key])):
                if not torch.equal(tensor.full_tensor(), value):
                    problems.append(f"{label} layout, {key} ({where}) differs after load")
        if back["optim"]["step"] != 7 or not torch.equal(
            back["optim"]["exp_avg"].full_tensor(), values["w"]
        ):
            problems.append(f"{label} layout: nested optimizer state not restored")
    plain = {key: torch.zeros_like(value) for key, value in values.items()}
    dcp_load(plain, checkpoint_id=path)  # any layout, even whole tensors, can load it
    problems += [f"plain {k} differs" for k, v in values.items() if not torch.equal(plain[k], v)]
    return problems


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_distributed_checkpoint_round_trip(world: int, tmp_path: Any) -> None:
    mesh_shape = (2,) if world == 2 else (2, 2)
    path = str(tmp_path / f"ckpt_world{world}")
    results = run_on_ranks(world, _checkpoint, path, mesh_shape, timeout=300)
    problems = [p for r in results for p in r]
    assert not problems, "\n".join(problems)


def test_to_torch_state_dict_keeps_other_values() -> None:
    sd: dict[str, Any] = {"step": 3, "lr": [0.1, (torch.ones(1),)], "name": "x"}
    out = to_torch_state_dict(sd)
    assert (out["step"], out["name"], out["lr"][0]) == (3, "x", 0.1)
    assert isinstance(out["lr"][1], tuple)
    assert out["lr"][1][0] is sd["lr"][1][0]
    assert from_torch_state_dict(out)["lr"][1][0] is sd["lr"][1][0]

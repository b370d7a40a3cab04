"""A fully_shard group is planned as frozen data (``plan_group``) before it is allocated, and its
slots are readable from ``hp_dtensor.contract.parallel_plan_of``.

* Pure: with no process group, on shapes (and a meta model's parameters) alone; deterministic,
  equal plans compare equal; the buffer is ``hp_layout.plan_flat_buffer``'s.
* World 2 (a nested and a root group of uneven sizes): every parameter's slot in
  ``parallel_plan_of(model)`` is its group's plan's; this rank's sharded piece is the slice of
  the flat buffer the slot names, a view of the group's chunk at that place; the unsharded
  parameter is the view of the unsharded buffer at the slot's offset, with its values.
* World 4, FSDP x TP on a 2x2 (dp, tp) mesh: the norms (replicated on tp, their gradients
  all-reduced over tp) are packed last, ``extra_start`` is the first norm's offset, and each
  slot holds the parameter's tensor-parallel local shard.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh, layout_of
from hp_dtensor.contract import ParamFlatSlot, parallel_plan_of
from hp_dtensor.parallel import parallelize_module, transformer_tp_plan
from hp_fsdp import GroupPlan, MixedPrecisionPolicy, ParamSpec, fully_shard, plan_group
from hp_fsdp._group import FSDPParamGroup
from hp_fsdp._state import FSDPState
from hp_fsdp.group_plan import spec_of
from hp_layout import Layout, Mesh, ReduceOp, Replicate, Shard, plan_flat_buffer
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

TP = (("tp", ReduceOp.SUM),)


def _group(module: nn.Module) -> FSDPParamGroup:
    state: FSDPState = module._hp_fsdp_state  # type: ignore[assignment]
    assert state.group is not None
    return state.group


def _tp_specs() -> list[ParamSpec]:
    """A block's parameters on a (dp, tp) mesh: the norm first, replicated on tp."""
    grid = Mesh((2, 2), ("dp", "tp"))
    col = Layout((8, 6), grid, [Replicate(), Shard(0)])
    row = Layout((6, 8), grid, [Replicate(), Shard(1)])
    norm = Layout((6,), grid, [Replicate(), Replicate()])
    return [
        ParamSpec("norm.weight", (6,), "float32", norm, TP),
        ParamSpec("w1.weight", (4, 6), "float32", col, (("dp", ReduceOp.AVG),)),
        ParamSpec("w2.weight", (6, 4), "float32", row),
        ParamSpec("norm2.weight", (6,), "float32", norm, TP),
    ]


def _assert_slots_consistent(plan: GroupPlan) -> None:
    """Offsets, paddings and chunk size agree with ``hp_layout.plan_flat_buffer``."""
    align = 16 // torch.empty((), dtype=getattr(torch, plan.storage_dtype)).element_size()
    flat = plan_flat_buffer(plan.shapes, plan.mesh.axis_size(plan.shard_axis), align)
    assert plan.flat == flat
    slots = list(plan.flat_slots().values())
    assert list(plan.flat_slots()) == list(plan.fqns)
    position = 0
    for i, (slot, shape) in enumerate(zip(slots, plan.shapes, strict=True)):
        assert slot.index == i
        assert slot.offset == flat.slots[i].offset
        assert slot.numel == math.prod(shape)
        assert slot.offset >= position
        assert slot.offset % align == 0
        position = slot.offset + slot.numel + slot.padding
    assert position == flat.padded_numel == slots[-1].buffer_numel
    assert all(s.chunk_numel == flat.chunk_numel for s in slots)
    assert all(s.buffer_numel == flat.shards * flat.chunk_numel for s in slots)


# Pure ---------------------------------------------------------------------------------------


def test_plan_group_is_pure_and_deterministic() -> None:
    assert not dist.is_initialized()
    dp = Mesh((2,), ("dp",))
    plan = plan_group(_tp_specs(), dp, "dp", owner="layers.0")
    assert plan == plan_group(_tp_specs(), dp, "dp", owner="layers.0")
    assert plan != plan_group(_tp_specs(), dp, "dp", owner="layers.1")
    assert plan.with_owner("layers.1") == plan_group(_tp_specs(), dp, "dp", owner="layers.1")
    # Norms (an extra reduction over tp, which FSDP does not own) last, in their given order;
    # the reduction over the FSDP axis itself is not extra.
    assert plan.fqns == ("w1.weight", "w2.weight", "norm.weight", "norm2.weight")
    assert plan.extra_reduce == TP
    assert plan.extra_start == plan.flat.slots[2].offset
    assert plan.shapes == ((4, 6), (6, 4), (6,), (6,))
    _assert_slots_consistent(plan)
    w1 = plan.layouts[0]
    assert w1.mesh.axis_names == ("dp", "tp")
    assert isinstance(w1.placement("tp"), Shard)
    assert w1.global_shape == (8, 6)
    slot = plan.flat_slots()["norm.weight"]
    assert slot == ParamFlatSlot(
        group="layers.0",
        index=2,
        offset=plan.flat.slots[2].offset,
        numel=6,
        padding=plan.flat.slots[3].offset - plan.flat.slots[2].end,
        buffer_numel=plan.flat.padded_numel,
        chunk_numel=plan.flat.chunk_numel,
        shard_axes=("dp",),
        replicate_axes=(),
        dtype="float32",
    )


def test_plan_group_on_shapes_alone() -> None:
    assert not dist.is_initialized()
    hsdp = Mesh((2, 2), ("replicate", "shard"))
    specs = [ParamSpec("a", (3, 5), "bfloat16"), ParamSpec("b", (7,), "bfloat16")]
    plan = plan_group(specs, hsdp, "shard", "replicate", reduce_dtype=torch.float32)
    assert plan.fqns == ("a", "b")
    assert plan.extra_reduce == ()
    assert plan.extra_start == plan.flat.padded_numel
    assert (plan.storage_dtype, plan.param_dtype, plan.reduce_dtype) == (
        "bfloat16",
        "bfloat16",
        "float32",
    )
    assert plan.flat.alignment == 8  # 16 bytes of bf16
    assert plan.replicate_axes == ("replicate",)
    assert {s.replicate_axes for s in plan.flat_slots().values()} == {("replicate",)}
    assert plan.layouts[1].placement("replicate") == Replicate()
    _assert_slots_consistent(plan)
    with pytest.raises(ValueError, match="several dtypes"):
        plan_group([*specs, ParamSpec("c", (2,), "float32")], hsdp, "shard", label="Block")


def test_a_meta_model_plans_as_a_real_one() -> None:
    def specs(device: str) -> list[ParamSpec]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7, device=device), nn.Linear(7, 3, device=device))
        return [spec_of(fqn, p) for fqn, p in model.named_parameters()]

    mesh = Mesh((3,), ("shard",))
    meta = plan_group(specs("meta"), mesh, "shard", param_dtype=torch.bfloat16)
    assert meta == plan_group(specs("cpu"), mesh, "shard", param_dtype=torch.bfloat16)
    assert meta.param_dtype == "bfloat16"
    assert meta.storage_dtype == "float32"
    _assert_slots_consistent(meta)


# World 2 ------------------------------------------------------------------------------------


def _slots_match_allocation() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("shard",)))
    torch.manual_seed(0)
    # Uneven sizes: chunk boundaries fall inside parameters, slots carry padding.
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    original = {fqn: p.detach().clone() for fqn, p in model.named_parameters()}
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    plan = parallel_plan_of(model)
    assert plan is not None
    coordinate = mesh.get_local_rank("shard")
    groups = {"0": _group(model[0]), "": _group(model)}
    sharded = dict(model.named_parameters())
    assert set(sharded) == set(original)
    for owner, group in groups.items():
        prefix = f"{owner}." if owner else ""
        assert group.plan.owner == owner
        _assert_slots_consistent(group.plan)
        chunk = group.flat.chunk_numel
        lo = coordinate * chunk
        buffer = torch.zeros(group.flat.padded_numel)
        for fqn, slot in group.plan.flat_slots().items():
            assert plan.param(prefix + fqn).flat == slot
            assert slot.group == owner
            buffer[slot.offset : slot.offset + slot.numel] = original[prefix + fqn].reshape(-1)
        # This rank's chunk is the slice of the buffer the slots describe.
        assert torch.equal(group.sharded_flat, buffer[lo : lo + chunk])
        for fqn, slot in group.plan.flat_slots().items():
            piece = sharded[prefix + fqn]
            start = max(slot.offset, lo)
            stop = max(start, min(slot.offset + slot.numel, lo + chunk))
            assert torch.equal(piece.detach(), buffer[start:stop])
            if stop > start:
                where = piece.data_ptr() - group.sharded_flat.data_ptr()
                assert where == (start - lo) * piece.element_size()
    for module in (model[0], model):
        module.unshard()  # type: ignore[operator]
    for owner, group in groups.items():
        prefix = f"{owner}." if owner else ""
        for fqn, slot in group.plan.flat_slots().items():
            full = dict(model.named_parameters())[prefix + fqn]
            assert torch.equal(full.detach(), original[prefix + fqn])
            where = full.data_ptr() - group.unsharded_flat.data_ptr()
            assert where == slot.offset * full.element_size()
    for module in (model[0], model):
        module.reshard()  # type: ignore[operator]
    return {p.fqn: p.flat for p in plan.params}


@pytest.mark.multiprocess
def test_slots_are_where_the_group_keeps_the_parameters() -> None:
    slots = run_on_ranks(2, _slots_match_allocation)
    assert slots[0] == slots[1]  # every rank plans the same
    assert set(slots[0]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {s.group for s in slots[0].values() if s is not None} == {"0", ""}
    assert all(s is not None for s in slots[0].values())


# World 4: FSDP x TP ---------------------------------------------------------------------------

CONFIG = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)


def _tp_slots(mp: MixedPrecisionPolicy) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2, 2), ("dp", "tp")))
    torch.manual_seed(0)
    model = Llama(CONFIG)
    parallelize_module(model, mesh, transformer_tp_plan(), tp_axis="tp")
    tp_plan = parallel_plan_of(model)
    assert tp_plan is not None
    assert all(p.flat is None for p in tp_plan.params)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    plan = parallel_plan_of(model)
    assert plan is not None
    rank = dist.get_rank()
    groups = {f"layers.{i}": _group(b) for i, b in enumerate(model.layers)}
    groups[""] = _group(model)
    norms: dict[str, tuple[str, ...]] = {}
    for owner, group in groups.items():
        prefix = f"{owner}." if owner else ""
        gp = group.plan
        _assert_slots_consistent(gp)
        assert gp.owner == owner
        assert gp.extra_reduce == TP
        assert (gp.param_dtype, gp.reduce_dtype) == ("bfloat16", "float32")
        # Parameters replicated on tp (an extra tp reduction) come last; the tail starts at
        # the first of them.
        extra = [i for i, f in enumerate(gp.fqns) if _replicated_on_tp(plan.param(prefix + f))]
        assert extra
        assert extra == list(range(len(gp.fqns) - len(extra), len(gp.fqns)))
        assert gp.extra_start == gp.flat.slots[extra[0]].offset == group.extra_start
        norms[owner] = tuple(gp.fqns[i] for i in extra)
        for i, fqn in enumerate(gp.fqns):
            param = plan.param(prefix + fqn)
            assert param.flat is not None
            assert param.flat == gp.flat_slot(i)
            assert param.flat.group == owner
            assert param.flat.dtype == "float32"
            assert param.flat.shard_axes == ("dp",)
            # The slot holds the tensor-parallel local shard.
            assert param.flat.numel == math.prod(param.local_shape(rank))
            assert gp.bases[i] == param.layout
            assert layout_of(dict(model.named_parameters())[prefix + fqn]) == gp.layouts[i]
    assert all(p.flat is not None for p in plan.params)
    plan.table()
    return norms


@pytest.mark.multiprocess
def test_fsdp_tp_packs_norms_last() -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for norms in run_on_ranks(4, _tp_slots, mp, timeout=300):
        assert norms == {
            "layers.0": ("attn_norm.weight", "ffn_norm.weight"),
            "layers.1": ("attn_norm.weight", "ffn_norm.weight"),
            "": ("norm.weight",),
        }


def _replicated_on_tp(param: Any) -> bool:
    return isinstance(param.layout.placement("tp"), Replicate)

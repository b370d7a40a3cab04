"""Counted, not guessed: the kernels and collectives of one hp-fsdp training step.

A step is forward, cross-entropy and backward of ``hp_testing.llama.Llama`` (fp32, three
blocks: four FSDP groups with the root), the optimizer excluded, counted with
:class:`hp_fsdp.counting.CountingMode` after a warm-up step. The same model on one device, on
the same local batch, is the baseline: the model's own math runs copy kernels (rotary
``cat``, ``reshape`` of a transposed tensor), so what FSDP adds is the difference.

* hp-fsdp adds no copy kernel: the all-gather writes the unsharded buffer whose views the
  module computes with, gradients accumulate into views of the reduce-scatter's input, and the
  reduce-scatter writes into the gradient arena whose views are the sharded gradients. What it
  adds instead: one zero fill of each group's gradient buffer, one in-place addition per
  parameter (gradient accumulation into that buffer) and one scaling per group.
* torch FSDP2 copies parameters into its all-gather input (``fsdp.all_gather_copy_in``), out
  of the all-gather output (``fsdp.split_with_sizes_copy``), and gradients into its
  reduce-scatter input (``fsdp.chunk_cat``): one copy kernel per collective.
* Both run on gloo, whose reduce-scatter copies the reduced chunk into the output when waited
  (a backend internal, counted apart: ``CountingMode.backend_ops``).
* HSDP (2, 2) with four groups: the slow tier all-reduces the gradient arena in fewer
  collectives than there are groups (one, here), counted both by the arena and by the mode;
  torch FSDP2 issues one all-reduce per group.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_fsdp.counting import (
    COPY_KERNELS,
    CountingMode,
    collective_kind,
    extra_counts,
    is_copy_kernel,
    op_name,
)
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=16)
GROUPS = CONFIG.n_layers + 1  # one per block, plus the root's (embedding, norm, head)
PARAMS = 9 * CONFIG.n_layers + 3  # parameters with gradients


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    return ids, torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)


def _step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> None:
    logits = model(ids)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()


def _counted_step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> CountingMode:
    """A warm-up step (lazy initialization, forward order), then one counted step."""
    _step(model, ids, targets)
    model.zero_grad(set_to_none=True)
    with CountingMode() as counts:
        _step(model, ids, targets)
    return counts


def _hp_model(mesh_shape: tuple[int, ...]) -> nn.Module:
    from hp_dtensor import DeviceMesh
    from hp_fsdp import fully_shard
    from hp_layout import Mesh

    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _torch_model(mesh_shape: tuple[int, ...]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _slow_collectives(model: nn.Module) -> int:
    from hp_fsdp._state import FSDPState

    state: FSDPState = model._hp_fsdp_state  # type: ignore[assignment]
    assert state.root is not None
    assert state.root.arena is not None
    return state.root.arena.slow_collectives


def _axis_groups(mesh_shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """This rank's shard group and (HSDP) replicate group, as global ranks."""
    rank = dist.get_rank()
    shard = mesh_shape[-1]
    groups = {"shard": tuple(range(rank - rank % shard, rank - rank % shard + shard))}
    if len(mesh_shape) == 2:
        groups["replicate"] = tuple(range(rank % shard, dist.get_world_size(), shard))
    return groups


def _count(mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    torch.set_num_threads(1)
    ids, targets = _batch(dist.get_rank())
    torch.manual_seed(0)
    single = _counted_step(Llama(CONFIG), ids, targets)
    hp = _hp_model(mesh_shape)
    _step(hp, ids, targets)  # warm-up outside _counted_step, to read the arena before and after
    hp.zero_grad(set_to_none=True)
    slow_before = _slow_collectives(hp)
    with CountingMode() as hp_counts:
        _step(hp, ids, targets)
    slow = _slow_collectives(hp) - slow_before
    theirs = _counted_step(_torch_model(mesh_shape), ids, targets)
    over = {
        axis: dict(Counter(c.kind for c in hp_counts.collectives_over(ranks)))
        for axis, ranks in _axis_groups(mesh_shape).items()
    }
    return {
        "single": single.summary(),
        "hp": hp_counts.summary(),
        "torch": theirs.summary(),
        "hp_slow_collectives": slow,
        "hp_collectives_by_axis": over,
    }


def _report(mesh_shape: tuple[int, ...], result: dict[str, Any]) -> str:
    single, hp, theirs = result["single"], result["hp"], result["torch"]
    lines = [
        f"mesh {mesh_shape}, one step (forward + backward), {GROUPS} groups, {PARAMS} params:",
        f"  single-device copies: {single['copies']}",
        f"  hp-fsdp  copies: {hp['copies']}; extra vs single: "
        f"{extra_counts(hp['copies'], single['copies'])}; backend (gloo wait): "
        f"{hp['backend_ops']}",
        f"  torch FSDP2 copies: {theirs['copies']}; extra vs single: "
        f"{extra_counts(theirs['copies'], single['copies'])}; backend: {theirs['backend_ops']}",
        f"  hp fills {hp['fills']}, in-place adds {hp['inplace_adds']}, "
        f"collectives {hp['collectives']} by axis {result['hp_collectives_by_axis']}",
        f"  torch fills {theirs['fills']}, in-place adds {theirs['inplace_adds']}, "
        f"collectives {theirs['collectives']}",
    ]
    return "\n".join(lines)


@functools.cache
def _results(mesh_shape: tuple[int, ...]) -> list[dict[str, Any]]:
    """Per-rank counts for ``mesh_shape`` (one run on the ranks per mesh, shared by tests)."""
    world = 1
    for size in mesh_shape:
        world *= size
    return run_on_ranks(world, _count, mesh_shape)


def _extra_copies(result: dict[str, Any], variant: str) -> dict[str, int]:
    return extra_counts(result[variant]["copies"], result["single"]["copies"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_fsdp_step_adds_no_copy_kernels(mesh_shape: tuple[int, ...]) -> None:
    results = _results(mesh_shape)
    result = results[0]
    print(_report(mesh_shape, result))
    for r in results:
        hp_extra = _extra_copies(r, "hp")
        assert not {k: v for k, v in hp_extra.items() if v > 0}, _report(mesh_shape, r)
        # The zero fill of each group's gradient buffer; one in-place add per parameter.
        assert r["hp"]["fills"] == {"aten.zeros": GROUPS}, r["hp"]["fills"]
        assert r["hp"]["inplace_adds"] == {"aten.add_": PARAMS}, r["hp"]["inplace_adds"]
        assert r["single"]["inplace_adds"] == {}
        # gloo's reduce-scatter copies into its output inside Work.wait: one per reduce-scatter.
        reduce_scatters = r["hp"]["collectives"]["reduce_scatter/2"]
        assert r["hp"]["backend_ops"].get("aten.copy_", 0) == reduce_scatters

    # torch FSDP2: one copy-in per all-gather, one copy-out per all-gather, one copy-in per
    # reduce-scatter.
    theirs = result["torch"]
    gathers = theirs["collectives"]["all_gather/2"]
    scatters = theirs["collectives"]["reduce_scatter/2"]
    assert _extra_copies(result, "torch") == {
        "fsdp.all_gather_copy_in": gathers,
        "fsdp.split_with_sizes_copy": gathers,
        "fsdp.chunk_cat": scatters,
    }
    # The same collectives on the fast tier: all-gather per group forward, again per block in
    # backward (the root keeps its parameters), reduce-scatter per group.
    hp = result["hp"]["collectives"]
    assert hp["all_gather/2"] == gathers == GROUPS + CONFIG.n_layers
    assert hp["reduce_scatter/2"] == scatters == GROUPS


@pytest.mark.multiprocess
def test_hsdp_slow_tier_collectives_fewer_than_groups() -> None:
    for result in _results((2, 2)):
        slow = result["hp_slow_collectives"]
        by_axis = result["hp_collectives_by_axis"]
        assert 0 < slow < GROUPS, result
        # The arena's counter is what was issued: the replicate group saw exactly those
        # all-reduces, the shard group only all-gathers and reduce-scatters.
        assert by_axis["replicate"] == {"all_reduce": slow}, by_axis
        assert set(by_axis["shard"]) == {"all_gather", "reduce_scatter"}, by_axis
        # torch FSDP2 all-reduces each group's gradient across replicas separately.
        assert slow < result["torch"]["collectives"]["all_reduce/2"]


def test_classification() -> None:
    assert is_copy_kernel(op_name(torch.ops.aten.copy_.default))
    assert is_copy_kernel("aten.cat")
    assert is_copy_kernel("fsdp.all_gather_copy_in")
    assert not is_copy_kernel("aten.view")
    assert not is_copy_kernel("aten.zeros")
    assert "aten.add_" not in COPY_KERNELS
    assert collective_kind("c10d._allgather_base_") == "all_gather"
    assert collective_kind("c10d._reduce_scatter_base_") == "reduce_scatter"
    assert collective_kind("c10d.allreduce_") == "all_reduce"
    assert collective_kind("aten.mm") is None
    assert extra_counts({"a": 2, "b": 1}, {"a": 2, "c": 1}) == {"b": 1, "c": -1}


def test_counting_mode_counts_local_ops() -> None:
    x = torch.randn(4, 3)
    with CountingMode() as counts:
        y = x.t().contiguous()  # a clone
        z = torch.cat([y, y])
        z.add_(1.0)
        torch.zeros(3)
    assert counts.copies() == Counter({"aten.clone": 1, "aten.cat": 1})
    assert counts.copy_count == 2
    assert counts.inplace_adds() == Counter({"aten.add_": 1})
    assert counts.fills() == Counter({"aten.zeros": 1})
    assert counts.collectives == []

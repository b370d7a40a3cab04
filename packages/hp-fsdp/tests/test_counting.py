"""Counted, not guessed: the kernels and collectives of one hp-fsdp training step.

A step is forward, cross-entropy and backward of ``hp_testing.llama.Llama`` (fp32, three
blocks: four FSDP groups with the root), the optimizer excluded, counted with
:class:`hp_fsdp.counting.CountingMode` after a warm-up step. The same model on one device, on
the same local batch, is the baseline: the model's own math runs copy kernels (rotary
``cat``, ``reshape`` of a transposed tensor), so what FSDP adds is the difference.

* hp-fsdp adds one copy kernel per parameter and no other: the all-gather writes the unsharded
  buffer whose views the module computes with; autograd hands each parameter its gradient as
  the tensor its backward produced, and hp-fsdp moves it into the reduce-scatter's input (one
  ``aten.copy_`` per parameter, in place of a zero fill of the buffer and autograd's in-place
  addition into it: half the memory traffic); the reduce-scatter writes into the gradient arena
  whose views are the sharded gradients. No zero fill, no in-place addition, one scaling per
  group. The step runs no unclassified operator (a custom operator the counter cannot judge),
  and the same step with a copy planted through this project's own ``hp_kernels.pack`` (each
  all-gather's input packed into a staging buffer first, as torch FSDP2's copy-in does) counts
  exactly one extra copy per all-gather: the claim fails when a copy is added.
* torch FSDP2 copies parameters into its all-gather input (``fsdp.all_gather_copy_in``), out
  of the all-gather output (``fsdp.split_with_sizes_copy``), and gradients into its
  reduce-scatter input (``fsdp.chunk_cat``): one copy kernel per collective.
* Both run on gloo, whose reduce-scatter copies the reduced chunk into the output when waited
  (a backend internal, counted apart: ``CountingMode.backend_ops``). hp-fsdp's reduce-scatter
  on gloo is an all-to-all and a local sum into the arena (``hp_fsdp._collectives``): no copy
  there either.
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
    NON_COPY_CUSTOM_OPS,
    CountingMode,
    PeakMemoryMode,
    collective_kind,
    extra_counts,
    is_classified,
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


def _planted_copy_step(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> CountingMode:
    """One counted step with a copy planted where hp-fsdp promises none: before each all-gather,
    the shard is packed into a staging buffer with ``hp_kernels.pack`` (the project's own
    custom copy operator; the all-gather itself is unchanged, so the step computes the same)."""
    import hp_kernels
    from hp_fsdp._group import FSDPParamGroup, ShardedState

    original = FSDPParamGroup.unshard

    def unshard(group: FSDPParamGroup, async_op: bool = False) -> None:
        if group.state is ShardedState.SHARDED:
            staging = torch.empty_like(group.sharded_flat)
            hp_kernels.pack([group.sharded_flat], staging, [0])
        original(group, async_op)

    # The workers persist across tests: restore the method whatever happens.
    FSDPParamGroup.unshard = unshard  # type: ignore[method-assign,assignment]
    try:
        model.zero_grad(set_to_none=True)
        with CountingMode() as counts:
            _step(model, ids, targets)
    finally:
        FSDPParamGroup.unshard = original  # type: ignore[method-assign]
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
    planted = _planted_copy_step(hp, ids, targets)
    theirs = _counted_step(_torch_model(mesh_shape), ids, targets)
    over = {
        axis: dict(Counter(c.kind for c in hp_counts.collectives_over(ranks)))
        for axis, ranks in _axis_groups(mesh_shape).items()
    }
    return {
        "single": single.summary(),
        "hp": hp_counts.summary(),
        "planted": planted.summary(),
        "torch": theirs.summary(),
        "hp_slow_collectives": slow,
        "hp_collectives_by_axis": over,
        "hp_purposes": dict(Counter(c.purpose for c in hp_counts.collectives)),
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


def _added_copies(result: dict[str, Any], variant: str) -> dict[str, int]:
    """Copy kernels ``variant`` ran beyond the single-device step."""
    return {k: v for k, v in _extra_copies(result, variant).items() if v > 0}


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_fsdp_step_adds_no_copy_kernels(mesh_shape: tuple[int, ...]) -> None:
    """hp-fsdp's step runs one copy kernel per parameter beyond the single-device step (each
    gradient into the flat buffer), plus, on a pair of gloo ranks, one per all-gather (this
    rank's shard into its slice of the unsharded buffer: gloo's own all-gather copies the whole
    gathered buffer, inside the backend where no dispatch mode sees it), and no operator the
    counter cannot classify; the check catches a copy planted through ``hp_kernels.pack``."""
    results = _results(mesh_shape)
    result = results[0]
    print(_report(mesh_shape, result))
    for r in results:
        gathers = r["hp_purposes"]["param_all_gather"]
        assert _added_copies(r, "hp") == {"aten.copy_": PARAMS + gathers}, _report(mesh_shape, r)
        for variant in ("single", "hp", "planted", "torch"):
            assert r[variant]["unclassified"] == {}, (variant, r[variant]["unclassified"])
        # The planted copy is seen, once per all-gather, by the same check.
        assert _added_copies(r, "planted") == {
            "aten.copy_": PARAMS + gathers,
            "hp_kernels.pack": gathers,
        }, r["planted"]
        # No zero fill of the gradient buffers, no accumulation into them.
        assert r["hp"]["fills"] == {}, r["hp"]["fills"]
        assert r["hp"]["inplace_adds"] == {}, r["hp"]["inplace_adds"]
        assert r["single"]["inplace_adds"] == {}
        # On gloo a gradient reduce-scatter is an all-to-all and a local sum (hp_fsdp._collectives),
        # one per group, with no copy inside the backend's wait (gloo's own reduce-scatter copies
        # into its output there); over a pair, so is each all-gather (an exchange).
        assert "reduce_scatter/2" not in r["hp"]["collectives"], r["hp"]["collectives"]
        assert "all_gather/2" not in r["hp"]["collectives"], r["hp"]["collectives"]
        assert r["hp"]["collectives"]["all_to_all/2"] == GROUPS + gathers, r["hp"]["collectives"]
        assert r["hp"]["backend_ops"].get("aten.copy_", 0) == 0, r["hp"]["backend_ops"]

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
    purposes = result["hp_purposes"]
    assert purposes["param_all_gather"] == gathers == GROUPS + CONFIG.n_layers
    assert purposes["grad_reduce_scatter"] == scatters == GROUPS


@pytest.mark.multiprocess
def test_hsdp_slow_tier_collectives_fewer_than_groups() -> None:
    for result in _results((2, 2)):
        slow = result["hp_slow_collectives"]
        by_axis = result["hp_collectives_by_axis"]
        assert 0 < slow < GROUPS, result
        # The arena's counter is what was issued: the replicate group saw exactly those
        # all-reduces, the shard group only all-gathers and reduce-scatters (both all-to-alls
        # over a pair of gloo ranks).
        assert by_axis["replicate"] == {"all_reduce": slow}, by_axis
        assert set(by_axis["shard"]) == {"all_to_all"}, by_axis
        # torch FSDP2 all-reduces each group's gradient across replicas separately.
        assert slow < result["torch"]["collectives"]["all_reduce/2"]


def test_classification() -> None:
    """Copies by name and by rule, the project's own copy operators, non-copies, and what is
    left unclassified."""
    assert is_copy_kernel(op_name(torch.ops.aten.copy_.default))
    assert is_copy_kernel("aten.cat")
    assert is_copy_kernel("fsdp.all_gather_copy_in")
    assert is_copy_kernel("fsdp.copy_")
    # The project's own custom copy operators (and the CPU extension's kernels behind them).
    for name in ("hp_kernels.pack", "hp_kernels.unpack", "hp_kernels_cpu.pack"):
        assert is_copy_kernel(name), name
        assert is_classified(name), name
    # aten's materialized views and scatters by their names.
    assert is_copy_kernel("aten.diagonal_copy")
    assert is_copy_kernel("aten.select_scatter")
    assert is_copy_kernel("aten.index_select")
    assert not is_copy_kernel("aten.view")
    assert not is_copy_kernel("aten.zeros")
    assert not is_copy_kernel("aten.scatter_add")
    assert not is_copy_kernel("hp_kernels.newton_schulz")
    assert "aten.add_" not in COPY_KERNELS
    assert is_classified("aten.mm")
    assert is_classified("c10d._allgather_base_")
    assert not is_classified("somelib.fused_copy")
    assert collective_kind("c10d._allgather_base_") == "all_gather"
    assert collective_kind("c10d._reduce_scatter_base_") == "reduce_scatter"
    assert collective_kind("c10d.allreduce_") == "all_reduce"
    assert collective_kind("aten.mm") is None
    assert extra_counts({"a": 2, "b": 1}, {"a": 2, "c": 1}) == {"b": 1, "c": -1}


def test_every_custom_copy_namespace_op_is_classified() -> None:
    """Every operator registered by this project (``hp_kernels``, its CPU extension
    ``hp_kernels_cpu``) and by torch FSDP2 (``fsdp``) is classified: a new custom operator that
    copies cannot be counted as no copy without someone deciding so here."""
    import importlib
    import pkgutil

    import torch.distributed.fsdp  # registers the fsdp:: operators

    import hp_kernels
    from hp_kernels.backends import cpu_extension_missing

    # Every module of hp_kernels, so that an operator registered anywhere in it is seen (those
    # needing an absent accelerator library cannot register anything here).
    for module in pkgutil.walk_packages(hp_kernels.__path__, "hp_kernels."):
        try:
            importlib.import_module(module.name)
        except ImportError:
            continue
    cpu_extension_missing()  # loads the extension, registering its operators
    registered = {
        name.split(".")[0].replace("::", ".")
        for name in torch._C._dispatch_get_all_op_names()
        if name.split("::")[0] in ("hp_kernels", "hp_kernels_cpu", "fsdp")
    }
    assert {"hp_kernels.pack", "hp_kernels.unpack", "fsdp.copy_"} <= registered, registered
    unknown = sorted(n for n in registered if not is_classified(n))
    assert not unknown, f"classify these in hp_fsdp.counting: {unknown}"
    assert NON_COPY_CUSTOM_OPS.isdisjoint(COPY_KERNELS)


@torch.library.custom_op("hp_fsdp_tests::mirror", mutates_args=("out",))
def _mirror(x: torch.Tensor, out: torch.Tensor) -> None:
    """A custom operator that copies (as a third-party one might)."""
    out.copy_(x)


def test_counting_mode_counts_local_ops() -> None:
    """A mode sees each custom operator as one call: the project's pack and unpack count as
    copies; an unknown custom copy is reported as unclassified, not as no copy."""
    import hp_kernels

    x = torch.randn(4, 3)
    flat = torch.empty(12)
    with CountingMode() as counts:
        y = x.t().contiguous()  # a clone
        z = torch.cat([y, y])
        z.add_(1.0)
        torch.zeros(3)
        hp_kernels.pack([x], flat, [0])
        hp_kernels.unpack(flat, [0], [y])
        _mirror(y, z[:3])
    assert counts.copies() == Counter(
        {"aten.clone": 1, "aten.cat": 1, "hp_kernels.pack": 1, "hp_kernels.unpack": 1}
    )
    assert counts.copy_count == 4
    assert counts.unclassified() == Counter({"hp_fsdp_tests.mirror": 1})
    assert counts.inplace_adds() == Counter({"aten.add_": 1})
    assert counts.fills() == Counter({"aten.zeros": 1})
    assert counts.collectives == []


def test_peak_memory_mode_counts_live_storage() -> None:
    """Live bytes, sampled after every operator: a tensor counts while something holds it, a
    view of it adds nothing, a freed one stops counting, and a storage resized outside the
    dispatcher (as FSDP frees and re-allocates unsharded parameters) counts at its new size
    from the next operator on."""
    buffer = torch.empty(0)  # live on entry, 0 bytes
    with PeakMemoryMode() as memory:
        a = torch.zeros(1000)
        view = a[10:]
        c = torch.zeros(500)
        after_three = memory.peak_increase
        del a, view, c
        d = torch.zeros(10)
        buffer.untyped_storage().resize_(8000)
        torch.zeros(1)
    assert after_three == 4 * 1000 + 4 * 500  # the view shares a's storage
    # The peak: d, the resized buffer, and the zeros(1) result while its operator ran.
    assert memory.peak_increase == 40 + 8000 + 4
    assert memory.peak_op == "aten.zeros"
    assert memory.end_bytes - memory.start_bytes == 40 + 8000
    assert d.numel() == 10


def test_the_runtime_does_not_import_the_instrument() -> None:
    """fully_shard and its runtime tag their collectives through ``hp_fsdp._purpose``; the
    counting mode is a measuring instrument that only tests and the dry run load."""
    import subprocess
    import sys

    probe = (
        "import sys; import hp_fsdp; from hp_fsdp import fully_shard, clip_grad_norm_; "
        "import hp_fsdp.state_dict; sys.exit('hp_fsdp.counting' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0

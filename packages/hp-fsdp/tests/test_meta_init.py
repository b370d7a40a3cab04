"""Deferred (meta-device) initialization under hp-fsdp, as FSDP2 codebases build large models.

The model is built on ``meta`` and sharded there (plans from shapes, nothing allocated), then
either

* materialized by ``hp_dtensor.parallel.materialize(model, seed=0)``: every module's
  ``reset_parameters`` replayed on full-size temporaries, each rank keeping its piece, written
  straight into the flat buffers (``hp_dtensor.contract.set_materialize_target``). The shards
  are bit-identical to a single-device construction under the same seed (asserted exactly:
  difference 0.0), at world 2 and 4, with tensor parallelism (2 x 2) and in the per-parameter
  layout (torch DTensor parameters, world 4), and training from
  them equals training the model sharded from real parameters, bit for bit;
* or allocated by ``model.to_empty(device="cpu")``, which allocates this rank's flat chunks
  only (the parameter objects stay the same), and filled by ``load_state_dict``.

Peak memory of the materialization (``counting.PeakMemoryMode``), measured at world 2: 81,345 B
= this rank's chunks and the buffers (71,104 B) + the largest module's full-size temporaries
(8,192 B) + materialize's check that the initializer wrote them all (``isnan``: 1 byte per
element, 2,048 B) + a scalar; the whole model is 141,184 B. Under TP (2 x 2) the local region of
the temporaries is taken as a copy as well: 1.5 x the largest module above the shards. Asserted:
at most the sharded model and buffers + 1.5 x the largest module + 1 KiB, at every world size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import materialize, parallelize_module, transformer_tp_plan
from hp_dtensor.parallel.equivalence import full_value
from hp_fsdp import fully_shard
from hp_fsdp.counting import PeakMemoryMode
from hp_layout import Mesh
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=16)
# The peak of materializing, above the sharded model and buffers: one module's full-size
# temporaries, their NaN mask (1/4 of fp32) and, under TP, the region taken of them (1/4 at
# tp=2 for the largest, a 2-d weight whose dp piece is cut from its tp shard), plus scalars.
PEAK_MODULE_FACTOR, PEAK_SLACK_BYTES = 1.5, 1024


def _shard(model: Llama, mesh: DeviceMesh, layout: str = "flat") -> None:
    for block in model.layers:
        fully_shard(block, mesh=mesh, param_layout=layout)
    fully_shard(model, mesh=mesh, param_layout=layout)


def _meshes(kind: str) -> tuple[DeviceMesh, DeviceMesh]:
    """(the whole mesh, the data-parallel mesh fully_shard gets)."""
    world = dist.get_world_size()
    if kind == "fsdp_tp":
        mesh = DeviceMesh("cpu", Mesh((2, 2), ("dp", "tp")))
        return mesh, mesh["dp"]
    mesh = DeviceMesh("cpu", Mesh((world,), ("shard",)))
    return mesh, mesh


def _build(kind: str, on_meta: bool) -> tuple[Llama, DeviceMesh]:
    mesh, dp_mesh = _meshes(kind)
    torch.manual_seed(0)
    if on_meta:
        with torch.device("meta"):
            model = Llama(CONFIG)
    else:
        model = Llama(CONFIG)
    if kind == "fsdp_tp":
        parallelize_module(model, mesh, transformer_tp_plan(), mode="production", tp_axis="tp")
    _shard(model, dp_mesh, "per_param" if kind == "per_param" else "flat")
    return model, mesh


def _whole(p: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    full_tensor = getattr(p, "full_tensor", None)  # a per-parameter torch DTensor
    return full_tensor().detach() if callable(full_tensor) else full_value(p, mesh)


def _module_bytes(model: nn.Module) -> int:
    """The largest full size of one module's own parameters and buffers (its temporaries)."""
    sizes = [0]
    for sub in Llama(CONFIG).modules():
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        sizes.append(sum(t.numel() * t.element_size() for t in own))
    del model
    return max(sizes)


def _sharded_bytes(model: nn.Module) -> int:
    total = 0
    for sub in model.modules():
        state = getattr(sub, "_hp_fsdp_state", None)
        if state is not None and sub is state.module:
            total += sum(
                g.sharded_flat.numel() * g.sharded_flat.element_size() for g in state.groups
            )
    return total


def _losses(model: nn.Module, kind: str, steps: int = 3) -> list[float]:
    """Per-step losses of AdamW on this rank's slice of fixed global batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp, dp_size = (rank // 2, 2) if kind == "fsdp_tp" else (rank, world)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, CONFIG.vocab_size, (4, 8), generator=g).chunk(dp_size)[dp]
        optimizer.zero_grad()
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), ids.roll(1, 1).reshape(-1))
        loss.backward()
        optimizer.step()
        out.append(loss.item())
    return out


def _materialized(kind: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = Llama(CONFIG)
    model, mesh = _build(kind, on_meta=True)
    assert all(p.is_meta for p in model.parameters())
    with PeakMemoryMode() as memory:
        materialize(model, seed=0)
    errors = {}
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        errors[name] = (_whole(p, mesh).reshape(q.shape) - q).abs().max().item()
    buffers = max((b - model.cos).abs().max().item() for b in (reference.cos,))
    sharded, largest = _sharded_bytes(model), _module_bytes(model)
    real, _ = _build(kind, on_meta=False)
    return {
        "errors": errors,
        "buffers": buffers,
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "peak": memory.peak_bytes - memory.start_bytes,
        "sharded": sharded,
        "largest": largest,
        "losses": _losses(model, kind),
        "real_losses": _losses(real, kind),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("kind", "world"), [("fsdp", 2), ("fsdp", 4), ("fsdp_tp", 4), ("per_param", 4)]
)
def test_materialized_shards_equal_single_device_init(kind: str, world: int) -> None:
    for result in run_on_ranks(world, _materialized, kind, timeout=300):
        assert max(result["errors"].values()) == 0.0, result["errors"]
        assert result["buffers"] == 0.0
        assert result["losses"] == result["real_losses"]
        # Never the whole model: the shards, and one module at full size at a time.
        bound = (
            result["sharded"]
            + result["buffer_bytes"]
            + PEAK_MODULE_FACTOR * result["largest"]
            + PEAK_SLACK_BYTES
        )
        assert result["peak"] <= bound, result


def _to_empty_then_load() -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = Llama(CONFIG)
    model, mesh = _build("fsdp", on_meta=True)
    objects = [id(p) for p in model.parameters()]
    with PeakMemoryMode() as memory:
        model.to_empty(device="cpu")
    same_objects = objects == [id(p) for p in model.parameters()]
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    model.load_state_dict(reference.state_dict(), strict=False)
    model.reset_parameters()  # the rotary tables (buffers)
    errors = [
        (full_value(p, mesh).reshape(q.shape) - q).abs().max().item()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    ]
    real, _ = _build("fsdp", on_meta=False)
    return {
        "same_objects": same_objects,
        "on_cpu": on_cpu,
        "errors": errors,
        "allocated": memory.end_bytes - memory.start_bytes,
        "sharded": _sharded_bytes(model),
        "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
        "losses": _losses(model, "fsdp"),
        "real_losses": _losses(real, "fsdp"),
    }


@pytest.mark.multiprocess
def test_to_empty_allocates_the_shards_only() -> None:
    for result in run_on_ranks(2, _to_empty_then_load, timeout=300):
        assert result["same_objects"]
        assert result["on_cpu"]
        assert max(result["errors"]) == 0.0
        # This rank's chunks and the (whole) buffers, nothing else.
        assert result["allocated"] == result["sharded"] + result["buffers"], result
        assert result["losses"] == result["real_losses"]

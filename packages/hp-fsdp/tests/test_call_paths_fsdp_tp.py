"""FSDP over tensor parallelism gives the single-device gradient on every call path it serves.

World 4: dp 2 x tp 2, hp-dtensor's production plan on tp, ``fully_shard`` on every block and
the root over dp, each dp rank on half the batch. The call paths of ``hp_testing.call_paths``
that reach the model through its root (the root's output, two forwards in one backward, two
backward passes into one gradient, activation checkpointing inside the blocks, non-reentrant
and reentrant) against one device, fp32, within 1e-5 of each gradient's largest entry. Paths
that call the root's own submodules without the root (a chain, a penalty on a root
parameter) need the root group's parameters gathered outside any forward, which FSDP2 does
not offer either.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import parallelize_module, transformer_tp_plan
from hp_dtensor.parallel.equivalence import full_value
from hp_fsdp import fully_shard
from hp_layout import Mesh
from hp_testing import run_on_ranks
from hp_testing.call_paths import PATHS, worst_gradient_error
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)
FSDP_PATHS = ["root", "twice", "accumulate", "checkpoint", "checkpoint_reentrant"]
BOUND = 1e-5


def _whole(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    def whole(p: torch.Tensor) -> torch.Tensor:
        assert p.grad is not None
        return full_value(p.grad, mesh, like=p)

    return whole


def _paths(paths: list[str]) -> dict[str, tuple[float, str]]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    reference = Llama(CONFIG)
    model = Llama(CONFIG)
    model.load_state_dict(reference.state_dict())
    mesh = DeviceMesh("cpu", Mesh((2, 2), ("dp", "tp")))
    parallelize_module(model, mesh, transformer_tp_plan(), tp_axis="tp")
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    replica = mesh.get_local_rank("dp")
    out: dict[str, tuple[float, str]] = {}
    for i, path in enumerate(paths):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, CONFIG.vocab_size, (4, 6), generator=g)
        targets = torch.randint(0, CONFIG.vocab_size, (4, 6), generator=g)
        reference.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        for loss in PATHS[path](reference, ids, targets):
            loss.backward()
        mine = ids.chunk(2)[replica], targets.chunk(2)[replica]
        for loss in PATHS[path](model, *mine):
            loss.backward()
        out[path] = worst_gradient_error(model, reference, _whole(mesh))
    assert dist.get_world_size() == 4
    return out


@pytest.mark.multiprocess
def test_fsdp_over_tp_call_paths_give_the_single_device_gradient() -> None:
    for per_rank in run_on_ranks(4, _paths, FSDP_PATHS, timeout=300):
        for path, (err, name) in per_rank.items():
            assert err < BOUND, f"path {path!r}: {name} off by {err:.2e}"

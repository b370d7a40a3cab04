"""hp-offload's activation wrappers around hp-dtensor production-TP blocks: the single-device
gradient on every call path.

The packages are siblings in the DAG (hp-offload imports no hp-* package), so their combination
is tested here. World 2, tensor parallelism 2 (hp-dtensor's Megatron plan on
``hp_testing.llama.Llama``); each block wrapped in place by ``checkpoint_wrapper`` (full
recompute, and a selective policy that saves the matmuls), by ``swap_wrapper``, or by both
through a policy with swap rules. The call paths of ``hp_testing.call_paths`` that go through
the blocks (the root's output, blocks called by the caller, an intermediate output, two
forwards, a penalty on replicated parameters, two backward passes) against one device, fp32,
within 1e-5 of each gradient's largest entry.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import parallelize_module, transformer_tp_plan
from hp_dtensor.parallel.equivalence import full_value
from hp_layout import Mesh
from hp_offload import (
    FULL_RECOMPUTE,
    ActivationPolicy,
    Swapper,
    checkpoint_wrapper,
    swap_wrapper,
)
from hp_testing import run_on_ranks
from hp_testing.call_paths import PATHS, worst_gradient_error
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)
WRAPPED_PATHS = ["root", "chain", "intermediate", "twice", "penalty", "accumulate"]
BOUND = 1e-5


def _wrap(kind: str) -> Callable[[nn.Module], None]:
    def wrap(block: nn.Module) -> None:
        if kind == "full":
            checkpoint_wrapper(block, policy=FULL_RECOMPUTE)
        elif kind == "selective":
            checkpoint_wrapper(block, policy=ActivationPolicy.build(save=["matmul"]))
        elif kind == "swap":
            swap_wrapper(block, Swapper(min_bytes=0))
        else:
            policy = ActivationPolicy.build(save=["attention"], swap=["matmul"])
            checkpoint_wrapper(block, policy=policy, swapper=Swapper(min_bytes=0))

    return wrap


def _paths(kinds: list[str], paths: list[str]) -> dict[str, tuple[float, str]]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("tp",)))
    out: dict[str, tuple[float, str]] = {}

    def whole(p: torch.Tensor) -> torch.Tensor:
        assert p.grad is not None
        return full_value(p.grad, mesh, like=p)

    for kind in kinds:
        torch.manual_seed(0)
        reference = Llama(CONFIG)
        model = Llama(CONFIG)
        model.load_state_dict(reference.state_dict())
        parallelize_module(model, mesh, transformer_tp_plan())
        for block in model.layers:
            _wrap(kind)(block)
        for i, path in enumerate(paths):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, CONFIG.vocab_size, (4, 6), generator=g)
            targets = torch.randint(0, CONFIG.vocab_size, (4, 6), generator=g)
            for m in (reference, model):
                m.zero_grad(set_to_none=True)
                for loss in PATHS[path](m, ids, targets):
                    loss.backward()
            out[f"{kind}/{path}"] = worst_gradient_error(model, reference, whole)
    return out


@pytest.mark.multiprocess
def test_offload_wrappers_around_tp_blocks_keep_every_call_path_exact() -> None:
    kinds = ["full", "selective", "swap", "selective+swap"]
    for per_rank in run_on_ranks(2, _paths, kinds, WRAPPED_PATHS, timeout=300):
        for case, (err, name) in per_rank.items():
            assert err < BOUND, f"{case}: {name} off by {err:.2e}"

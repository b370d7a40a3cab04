"""hp-train's own model under its tensor-parallel plan gives the single-device gradient on every
call path a caller can take (``hp_testing.call_paths``): the root, a chain of its blocks, an
intermediate output, two forwards, a penalty on replicated parameters, two backward passes and
activation checkpointing (non-reentrant and reentrant, inside the model and around the
caller's own block calls).

World 2, tensor parallelism 2 (``hp_train.parallel.parallelize.tp_plan``, production mode), on a
dense
model with grouped-query attention and qk-norms, a tied-embedding model (the head reads the
embedding's weight directly) and an MoE model (routed and shared experts replicated over tp,
the load-balancing loss seeded on tp rank 0 as the trainer does); fp32, every gradient within
1e-5 of its largest entry.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import parallelize_module
from hp_dtensor.parallel.equivalence import full_value
from hp_layout import Mesh
from hp_testing import run_on_ranks
from hp_testing.call_paths import PATHS, worst_gradient_error
from hp_train.config.schema import ModelConfig, MoEConfig
from hp_train.model.llama import Transformer
from hp_train.parallel.expert import seed_aux_loss_once
from hp_train.parallel.parallelize import tp_plan

MODELS = {
    "dense": ModelConfig(
        vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=24,
        max_seq_len=8, qk_norm=True,
    ),
    "tied": ModelConfig(
        vocab_size=32, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8,
        tie_embeddings=True,
    ),
    "moe": ModelConfig(
        vocab_size=32, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8,
        moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=12, every=1, n_shared_experts=1,
                      aux_loss_weight=0.1),
    ),
}  # fmt: skip
BOUND = 1e-5


def _whole(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    def whole(p: torch.Tensor) -> torch.Tensor:
        assert p.grad is not None
        return full_value(p.grad, mesh, like=p)

    return whole


def _paths(kind: str, paths: list[str]) -> dict[str, tuple[float, str]]:
    torch.set_num_threads(1)
    config = MODELS[kind]
    torch.manual_seed(0)
    reference = Transformer(config)
    model = Transformer(config)
    model.load_state_dict(reference.state_dict())
    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("tp",)))
    parallelize_module(model, mesh, tp_plan(config, model))
    seed_aux_loss_once(model, mesh)
    out: dict[str, tuple[float, str]] = {}
    for i, path in enumerate(paths):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, config.vocab_size, (4, 6), generator=g)
        targets = torch.randint(0, config.vocab_size, (4, 6), generator=g)
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
            for loss in PATHS[path](m, ids, targets):
                loss.backward()
        out[path] = worst_gradient_error(model, reference, _whole(mesh))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_call_path_of_the_trainers_model_gives_the_single_device_gradient(
    kind: str,
) -> None:
    for per_rank in run_on_ranks(2, _paths, kind, list(PATHS), timeout=300):
        for path, (err, name) in per_rank.items():
            assert err < BOUND, f"{kind}, path {path!r}: {name} off by {err:.2e}"

"""Upstream's optimizer quick start with the usual rule for Muon's parameters (``p.ndim == 2``)
after :func:`hyper_parallel.fully_shard`: Muon trains the matrices, at world 2 as in one process.

``hyper_parallel.fully_shard`` hands out DTensors of the global shape (hp-fsdp's
``param_layout="per_param"``), so the rule selects the three weight matrices, not nothing (the
flat layout's 1-d pieces, which would leave Muon empty and train every matrix with AdamW: 5e-2
away from the one-process run after 3 steps). ``get_hyper_optimizer`` refuses an empty Muon
group and a parameter that is not a matrix, naming it.

Tolerances of the world-2 run against one process (same model, seeds and data, fp32, 3 steps):

* every rank takes the whole batch: FSDP's average of two equal gradients is exact, so the
  optimizers see the one-process gradients bit for bit and any difference is the optimizer
  path's own: asserted equal (tolerance 0);
* each rank takes half of the batch (data parallelism proper): the gradients may differ from
  one process by fp32 rounding of the split, which can move a bf16 rounding of a Newton-Schulz
  input; asserted within one bf16 rounding of the orthogonalized update per step,
  ``STEPS * 2**-7 * lr_adj`` = 3.75e-4 (lr_adj = 0.02 * 0.2 * sqrt(16), the largest); measured
  0 on this project's machines. Muon falling back to AdamW moves parameters by 5e-2.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor as TorchDTensor

from hp_muon import ChainedOptimizer, Muon
from hp_testing import run_on_ranks

STEPS, BATCH = 3, 8
SPLIT_TOLERANCE = STEPS * 2**-7 * 0.02 * 0.2 * 16**0.5  # see the module doc


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))


def _reference_optimizer(model: nn.Module) -> ChainedOptimizer:
    """One process: upstream's numerics spelled out in hp-muon's and torch's terms (its 5
    Newton-Schulz triples, lr scaled by 0.2 sqrt(max(rows, cols)); AdamW on the rest)."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    return ChainedOptimizer(
        [
            torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.1),
            Muon(
                matrices,
                lr=0.02,
                momentum=0.95,
                ns_coefficients="you_5step",
                adjust_lr_fn="match_rms_adamw",
            ),
        ]
    )


def _quick_start_case(split: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    from hyper_parallel import fully_shard, get_hyper_optimizer, init_device_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _model()
    ref_optimizer = _reference_optimizer(reference)
    model = _model()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    # The first two layers on their own, the last with the root (as a head usually is).
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # The quick start's rule, as users write it.
    muon_params = [p for p in model.parameters() if p.ndim == 2]
    adamw_params = [p for p in model.parameters() if p.ndim != 2]
    optimizer = get_hyper_optimizer(
        model=model,
        muon_params=muon_params,
        adamw_params=adamw_params,
        muon_kwargs={"lr": 0.02, "momentum": 0.95},
        adamw_kwargs={"lr": 3e-4, "weight_decay": 0.1},
    )
    muon = optimizer.optimizers[-1]
    assert isinstance(muon, Muon)
    g = torch.Generator().manual_seed(1)
    worst, orthogonalized, runs = 0.0, [], []
    for _step in range(STEPS):
        x, y = torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 4, generator=g)
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        mine = (x.chunk(world)[rank], y.chunk(world)[rank]) if split else (x, y)
        F.mse_loss(model(mine[0]), mine[1]).backward()
        F.mse_loss(reference(x), y).backward()
        optimizer.step()
        ref_optimizer.step()
        stats = muon.last_step_stats
        assert stats is not None
        orthogonalized.append(stats.orthogonalized)
        runs.append(stats.newton_schulz_runs)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert isinstance(p, TorchDTensor)
            worst = max(worst, (p.full_tensor() - q.detach()).abs().max().item())
    return {
        "muon_shapes": [tuple(p.shape) for p in muon_params],
        "worst": worst,
        "orthogonalized": orthogonalized,
        "runs": runs,
        "total_runs": muon.newton_schulz_runs,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("split", [False, True], ids=["whole_batch", "half_batch"])
def test_ndim_rule_trains_muon_on_the_matrices_at_world_2(split: bool) -> None:
    results = run_on_ranks(2, _quick_start_case, split, timeout=120)
    worst = max(r["worst"] for r in results)
    print(
        f"world 2 ({'half' if split else 'whole'} batch per rank) against one process after "
        f"{STEPS} steps: max |diff| = {worst:.3g}"
    )
    for r in results:
        assert r["muon_shapes"] == [(16, 12), (8, 16), (4, 8)], r
        # Unfused on the CPU: one Newton-Schulz run per matrix this rank owns, every step.
        assert r["runs"] == r["orthogonalized"], r
        assert r["total_runs"] == sum(r["runs"]), r
    for step in range(STEPS):
        # Every matrix orthogonalized once in the job, each step.
        assert sum(r["orthogonalized"][step] for r in results) == 3, results
    assert worst <= (SPLIT_TOLERANCE if split else 0.0)


# Refusals ----------------------------------------------------------------------------------------


def _flat_layout_case() -> str:
    """hp-fsdp's flat layout (not the umbrella's): the rule selects nothing; the error says so."""
    torch.set_num_threads(1)
    from hp_fsdp import fully_shard as flat_fully_shard
    from hyper_parallel import get_hyper_optimizer

    model = _model()
    flat_fully_shard(model)
    assert all(p.ndim == 1 for p in model.parameters())
    with pytest.raises(ValueError, match="has no parameters") as caught:
        get_hyper_optimizer(
            model=model,
            muon_params=[p for p in model.parameters() if p.ndim == 2],
            adamw_params=[p for p in model.parameters() if p.ndim != 2],
        )
    return str(caught.value)


@pytest.mark.multiprocess
def test_empty_muon_params_of_a_flat_layout_are_refused_naming_per_param() -> None:
    for message in run_on_ranks(2, _flat_layout_case, timeout=120):
        assert "get_hyper_optimizer: muon_params has no parameters" in message
        # The rank's flat piece of the first weight (how much of it depends on the rank).
        assert re.search(r"'0.weight' of local shape \(\d+,\) and global shape \(16, 12\)", message)
        assert 'param_layout="per_param"' in message


def test_empty_group_and_vectors_are_refused_by_name() -> None:
    from hyper_parallel import get_hyper_optimizer

    model = _model()
    weights = [model[0].weight, model[2].weight]
    with pytest.raises(ValueError, match="muon_params group 1 has no parameters"):
        get_hyper_optimizer(model, [{"params": weights}, {"params": []}], [])
    with pytest.raises(ValueError, match="muon_params has no parameters"):
        get_hyper_optimizer(model, [], list(model.parameters()))
    with pytest.raises(ValueError, match=r"parameter '2.bias' has global shape \(8,\)"):
        get_hyper_optimizer(model, [{"params": [*weights, model[2].bias]}], [])
    # A generator in a group is read once and still reaches Muon whole.
    optimizer = get_hyper_optimizer(model, [{"params": iter(weights)}], [])
    assert optimizer.param_groups[0]["params"] == weights

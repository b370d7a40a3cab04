"""hp-train's optimizer and checkpoints on a model nobody here wrote: Hugging Face
``transformers``' ``LlamaForCausalLM`` (tiny random config, fp32, grouped-query attention, the
loss inside its ``ModelOutput``), laid out by hp-train's meshes (FSDP x TP and HSDP at world 4)
and trained with hp-train's Muon + AdamW, against the same optimizer on one device; then an
hp-train checkpoint saved under FSDP x TP at world 4 resumed under FSDP at world 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from hp_dtensor.parallel.equivalence import full_value
from hp_fsdp import fully_shard
from hp_testing import run_on_ranks
from hp_testing.hf import causal_lm, tp_plan_styles
from hp_train.checkpoint.dcp import load_checkpoint, save_checkpoint
from hp_train.config.schema import ParallelConfig, TrainConfig
from hp_train.optim import build_optimizer
from hp_train.parallel.parallelize import Layout3D, build_layout

BATCH, SEQ, STEPS = 4, 8, 4
TRAIN = TrainConfig(steps=STEPS, optimizer="muon", muon_lr=0.02, lr=3e-3)
_STYLES = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
PLAN: dict[str, ParallelStyle] = {k: _STYLES[v] for k, v in tp_plan_styles("llama").items()}
# Muon orthogonalizes in bf16, and Newton-Schulz sends every singular value towards 1, so
# gradients that differ in their last fp32 bits (sums in another order) can round to other bf16
# inputs and give updates that differ in places by a few percent: two runs drift apart by that
# chaos, not by error. So the check runs in lock step: before each step the single-device model
# takes the distributed model's parameters, both compute gradients at the same point (fp32
# sums in another order: measured within 5.0e-7 of each tensor's largest entry at every step),
# and their Muon + AdamW updates are compared (measured within 3.7e-2 of each update's largest
# entry; identical at steps where no bf16 input flipped). A free-running single-device run
# gives the loss curve the distributed run must follow (measured within 7.4e-5 over 4 steps).
GRAD_TOLERANCE = 2e-6
UPDATE_TOLERANCE = 0.1
LOSS_TOLERANCE = 3e-4


def _build(seed: int = 0) -> nn.Module:
    return causal_lm("llama", seed)


def _lay_out(model: nn.Module, parallel: ParallelConfig) -> Layout3D:
    """hp-train's meshes; TP with Hugging Face's names; FSDP per decoder layer and the root."""
    layout = build_layout(parallel, "cpu")
    if layout.tp_size > 1:
        parallelize_module(
            model, layout.mesh, PLAN, tp_axis="tp", dp_axes=("dp_replicate", "dp_shard")
        )
    layers = model.get_submodule("model.layers")
    assert isinstance(layers, nn.ModuleList)
    for layer in layers:
        fully_shard(layer, mesh=layout.dp_mesh)
    fully_shard(model, mesh=layout.dp_mesh)
    return layout


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(20 + step))


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.abs().max().item(), 1e-12)
    return (got.double() - want.double()).abs().max().item() / scale


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, layout: Layout3D) -> float:
    opt.zero_grad()
    local = _batch(step).chunk(layout.dp_size)[layout.dp_rank]
    loss = model(input_ids=local, labels=local).loss
    loss.backward()
    opt.step()
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def _reference_losses(steps: int) -> list[float]:
    model = _build()
    opt = build_optimizer(model, TRAIN)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        ids = _batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _muon_run(parallel: ParallelConfig) -> dict[str, float]:
    """Gradient and update errors in lock step, and the loss against a free-running run."""
    torch.set_num_threads(1)
    model, lockstep, free = _build(), _build(), _build()
    layout = _lay_out(model, parallel)
    opt, lock_opt = build_optimizer(model, TRAIN), build_optimizer(lockstep, TRAIN)
    free_opt = build_optimizer(free, TRAIN)
    loss_error = grad_error = update_error = 0.0
    for step in range(STEPS):
        with torch.no_grad():
            for p, q in zip(model.parameters(), lockstep.parameters(), strict=True):
                q.copy_(full_value(p, layout.mesh).reshape(q.shape))
        before = [q.detach().clone() for q in lockstep.parameters()]
        ids = _batch(step)
        lock_opt.zero_grad()
        lockstep(input_ids=ids, labels=ids).loss.backward()
        free_opt.zero_grad()
        want = free(input_ids=ids, labels=ids).loss
        want.backward()
        opt.zero_grad()
        local = ids.chunk(layout.dp_size)[layout.dp_rank]
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        for p, q in zip(model.parameters(), lockstep.parameters(), strict=True):
            assert p.grad is not None
            assert q.grad is not None
            got = full_value(p.grad, layout.mesh, like=p).reshape(q.shape)
            grad_error = max(grad_error, _relative(got, q.grad))
        for optimizer in (opt, lock_opt, free_opt):
            optimizer.step()
        for p, q, start in zip(model.parameters(), lockstep.parameters(), before, strict=True):
            got = full_value(p, layout.mesh).reshape(q.shape) - start
            update_error = max(update_error, _relative(got, q.detach() - start))
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        loss_error = max(loss_error, abs(float(total) / dist.get_world_size() - want.item()))
    return {"loss": loss_error, "grad": grad_error, "update": update_error}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "parallel",
    [ParallelConfig(dp_shard=2, tp=2), ParallelConfig(dp_replicate=2, dp_shard=2)],
    ids=["fsdp_x_tp", "hsdp"],
)
def test_muon_on_hf_llama_matches_one_device(parallel: ParallelConfig) -> None:
    for report in run_on_ranks(4, _muon_run, parallel, timeout=300):
        assert report["grad"] < GRAD_TOLERANCE, report
        assert report["update"] < UPDATE_TOLERANCE, report
        assert report["loss"] < LOSS_TOLERANCE, report


SAVED_AFTER = 2


def _save(root: str) -> list[float]:
    torch.set_num_threads(1)
    model = _build()
    layout = _lay_out(model, ParallelConfig(dp_shard=2, tp=2))
    opt = build_optimizer(model, TRAIN)
    losses = [_step(model, opt, step, layout) for step in range(SAVED_AFTER)]
    save_checkpoint(root, SAVED_AFTER, model, opt)
    return losses + [_step(model, opt, step, layout) for step in range(SAVED_AFTER, STEPS)]


def _resume(path: str) -> tuple[int, list[float]]:
    torch.set_num_threads(1)
    model = _build(seed=1)  # other values: everything must come from the checkpoint
    layout = _lay_out(model, ParallelConfig(dp_shard=2))
    opt = build_optimizer(model, TRAIN)
    start = load_checkpoint(path, model, opt)
    return start, [_step(model, opt, step, layout) for step in range(start, STEPS)]


@pytest.mark.multiprocess
def test_checkpoint_of_hf_llama_resumes_at_another_layout(tmp_path: Path) -> None:
    """Saved under FSDP x TP at world 4 with Muon's momentum and AdamW's moments, resumed
    under FSDP at world 2: the continuation follows the uninterrupted run."""
    saved = run_on_ranks(4, _save, str(tmp_path), timeout=300)[0]
    start, resumed = run_on_ranks(2, _resume, str(tmp_path / f"step_{SAVED_AFTER:06d}"))[0]
    assert start == SAVED_AFTER
    want = _reference_losses(STEPS)
    assert max(abs(a - b) for a, b in zip(saved, want, strict=True)) < LOSS_TOLERANCE
    # The resumed run continues the saving run's own trajectory: measured within 4.8e-7 (the
    # losses of both follow one device within 7.4e-5, as above).
    worst = max(abs(a - b) for a, b in zip(resumed, saved[SAVED_AFTER:], strict=True))
    assert worst < LOSS_TOLERANCE, (resumed, saved)

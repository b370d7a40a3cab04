"""The pipeline runtime: every schedule equal to single-device training and to the same
schedule in ``torch.distributed.pipelining``; bad input gets clear errors.

A tiny MLP of ``LAYERS`` linear+tanh blocks (uneven over the stages) trains for ``STEPS`` SGD
steps on fixed data; each rank compares its stages' gradients and, on the last stage, the
losses with a single-device run of the whole model on the same batch, and with torch's
pipelining runtime on the same stages (GPipe, 1F1B, interleaved 1F1B; torch has no ZB-H1 with
one stage per rank, so ZB-H1 is compared with single device only, as is DualPipeV, whose
action order here is hp-mpmd's own).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _reference import train_single_device
from hp_mpmd import (
    PipelineSchedule,
    PipelineStage,
    SchedulePlan,
    ShapeMismatchError,
    StageError,
    balanced_boundaries,
    build_stages,
    layers_of,
    parameter_costs,
)
from hp_mpmd.runtime import PipelineError
from hp_mpmd.schedules import dualpipev, gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1
from hp_testing import run_on_ranks

DIM, LAYERS, BATCH, STEPS, LR = 6, 7, 16, 2, 0.1
# fp32: microbatching changes only summation order. Largest measured against single device
# over every schedule, world 2 and 4, 4 and 8 microbatches (torch 2.13, x86 CPU, the same on
# every run): losses 1.5e-8 (absolute; the losses are 0.78 and 1.07), gradients 3.2e-7
# (relative to each tensor's largest entry). Gradients are asserted with 3x headroom for another
# CPU's summation order; the loss bound is one fp32 ulp of a loss in [1, 2) (2**-23, 8x the
# measured figure): the reference loss is one fp32 rounding, so a reduction order that moves it
# by one ulp must not fail. Against torch's runtime on the same stages: bit-identical (asserted).
LOSS_TOL, GRAD_TOL = 2**-23, 1e-6


def _mlp(layers: int = LAYERS) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(DIM, DIM), nn.Tanh()]
    return nn.Sequential(*blocks[:-1])


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _plan(name: str, world: int, microbatches: int) -> SchedulePlan:
    if name == "gpipe":
        return gpipe(world, microbatches)
    if name == "1f1b":
        return one_f_one_b(world, microbatches)
    if name == "interleaved":
        return interleaved_1f1b(world, 2, microbatches)
    if name == "dualpipev":
        return dualpipev(world, microbatches)
    return zero_bubble_h1(world, microbatches)


def _single_device(steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    return train_single_device(_mlp(), _data, _loss, steps, LR)


def _stage_modules(num_stages: int) -> list[nn.Sequential]:
    layers = layers_of(_mlp())
    # Parameter counts are equal per linear: the balanced split is uneven in layers.
    return build_stages(layers, balanced_boundaries(parameter_costs(layers), num_stages))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _train(
    modules: Mapping[int, nn.Module],
    step_fn: Callable[[torch.Tensor, torch.Tensor], list[float]],
    steps: int,
) -> tuple[list[list[float]], list[dict[str, torch.Tensor]]]:
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses, grads = [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = _data(step)
        losses.append(step_fn(x, y))
        grads.append(
            {n: p.grad.clone() for m in modules.values() for n, p in m.named_parameters()}  # type: ignore[union-attr]
        )
        opt.step()
    return losses, grads


def _errors(
    losses: list[list[float]],
    grads: list[dict[str, torch.Tensor]],
    ref_losses: Sequence[float | list[float]],  # single device: floats; torch: lists
    ref_grads: list[dict[str, torch.Tensor]],
) -> tuple[float, float]:
    loss_err = 0.0
    for mine, ref in zip(losses, ref_losses, strict=True):
        if mine:  # last stage only
            mean = sum(mine) / len(mine)
            target = sum(ref) / len(ref) if isinstance(ref, list) else ref
            loss_err = max(loss_err, abs(mean - target))
    grad_err = max(_rel(g[n], r[n]) for g, r in zip(grads, ref_grads, strict=True) for n in g)
    return loss_err, grad_err


def _torch_step_fn(
    name: str, modules: Mapping[int, nn.Module], num_stages: int, microbatches: int
) -> Callable[[torch.Tensor, torch.Tensor], list[float]]:
    from torch.distributed import pipelining as pp

    device = torch.device("cpu")
    stages = [pp.PipelineStage(m, i, num_stages, device) for i, m in sorted(modules.items())]
    kinds: dict[str, Any] = {
        "gpipe": pp.ScheduleGPipe,
        "1f1b": pp.Schedule1F1B,
        "interleaved": pp.ScheduleInterleaved1F1B,
    }
    if name == "interleaved":
        schedule = kinds[name](stages, microbatches, loss_fn=_loss)
    else:
        schedule = kinds[name](stages[0], microbatches, loss_fn=_loss)
    first, last = 0 in modules, num_stages - 1 in modules

    def step(x: torch.Tensor, y: torch.Tensor) -> list[float]:
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        if last:
            schedule.step(*args, target=y, losses=losses)
        else:
            schedule.step(*args)
        return [float(v.detach()) for v in losses]

    return step


def _equivalence(name: str, microbatches: int) -> dict[str, float]:
    torch.set_num_threads(1)
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    plan = _plan(name, world, microbatches)
    ref_losses, ref_grads = _single_device(STEPS)
    all_modules = _stage_modules(plan.num_stages)
    ours = {s: all_modules[s] for s in plan.stages_of(rank)}
    theirs = {s: copy.deepcopy(m) for s, m in ours.items()}
    stages = [PipelineStage(m, s, plan.num_stages) for s, m in ours.items()]
    schedule = PipelineSchedule(plan, stages, _loss)

    def our_step(x: torch.Tensor, y: torch.Tensor) -> list[float]:
        return [float(v) for v in schedule.step(x, y).losses]

    losses, grads = _train(ours, our_step, STEPS)
    ref_grads = [{n: r[f"{n}"] for n in g} for g, r in zip(grads, ref_grads, strict=True)]
    out: dict[str, float] = {}
    out["loss_vs_single"], out["grad_vs_single"] = _errors(losses, grads, ref_losses, ref_grads)
    if name not in ("zb_h1", "dualpipev"):
        t_losses, t_grads = _train(
            theirs, _torch_step_fn(name, theirs, plan.num_stages, microbatches), STEPS
        )
        out["loss_vs_torch"], out["grad_vs_torch"] = _errors(losses, grads, t_losses, t_grads)
        out["torch_loss_vs_single"], out["torch_grad_vs_single"] = _errors(
            t_losses, t_grads, ref_losses, ref_grads
        )
    return out


SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb_h1", "dualpipev"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("microbatches", [4, 8])
@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_equals_single_device_and_torch(name: str, world: int, microbatches: int) -> None:
    if name == "dualpipev" and microbatches < 2 * world:
        pytest.skip("dualpipev needs 2 microbatches per rank")
    results = run_on_ranks(world, _equivalence, name, microbatches, timeout=120)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print(f"{name} world={world} mb={microbatches}: {worst}")
    for key, value in worst.items():
        if key.endswith("_vs_torch"):
            # The same stages, microbatches and order of operations as torch's runtime.
            assert value == 0.0, (key, worst)
        tol = LOSS_TOL if key.startswith(("loss", "torch_loss")) else GRAD_TOL
        assert value < tol, (key, worst)


# ------------------------------------------------------------------------- bad input


def _errors_on_ranks() -> dict[str, str]:
    rank = torch.distributed.get_rank()
    messages: dict[str, str] = {}
    plan = gpipe(2, 4)
    modules = _stage_modules(2)

    # a stage count that does not match the ranks
    try:
        PipelineSchedule(gpipe(3, 4), [PipelineStage(modules[rank], rank, 3)], _loss)
    except StageError as exc:
        messages["ranks"] = str(exc)
    # stages the plan does not put on this rank
    try:
        PipelineSchedule(plan, [PipelineStage(modules[1 - rank], 1 - rank, 2)], _loss)
    except StageError as exc:
        messages["stages"] = str(exc)
    # a batch the microbatch count cannot split
    schedule = PipelineSchedule(plan, [PipelineStage(modules[rank], rank, 2)], _loss)
    try:
        schedule.step(torch.randn(6, DIM), torch.randn(6, DIM))
    except PipelineError as exc:
        messages["batch"] = str(exc)
    # mismatched shapes between stages: stage 1 expects DIM + 1 features
    wrong = nn.Linear(DIM + 1, DIM) if rank == 1 else modules[0]
    schedule = PipelineSchedule(plan, [PipelineStage(wrong, rank, 2)], _loss)
    try:
        x, y = _data(0)
        schedule.step(x, y)
    except ShapeMismatchError as exc:
        messages["shapes"] = str(exc)
    return messages


@pytest.mark.multiprocess
def test_bad_input_is_a_clear_error() -> None:
    for messages in run_on_ranks(2, _errors_on_ranks, timeout=60):
        assert "3 pipeline ranks" in messages["ranks"]
        assert "2 ranks" in messages["ranks"]
        assert "runs stages" in messages["stages"]
        assert "batch of 6" in messages["batch"]
        assert "num_microbatches=4" in messages["batch"]
        # both ranks raise, naming both stages and the shapes
        shapes = messages["shapes"]
        assert "stage 1 cannot take the output of stage 0 ([4, 6] float32)" in shapes, shapes


def test_schedule_builders_reject_bad_microbatch_counts() -> None:
    with pytest.raises(ValueError, match="microbatch"):
        interleaved_1f1b(2, 2, 3)


def test_split_boundaries() -> None:
    from hp_mpmd import SplitError, boundaries_by_names

    assert balanced_boundaries([1, 1, 1, 1, 1, 1, 1], 4)[-1] == 7
    costs = [4.0, 1.0, 1.0, 1.0, 1.0, 4.0]
    bounds = balanced_boundaries(costs, 3)
    assert max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)) == 4.0
    layers = layers_of(_mlp(3))
    assert boundaries_by_names([n for n, _ in layers], ["2"]) == (0, 2, 5)
    with pytest.raises(SplitError, match="no layer named 'x'"):
        boundaries_by_names([n for n, _ in layers], ["x"])
    with pytest.raises(SplitError, match="cannot split 2 layers into 3"):
        balanced_boundaries([1.0, 1.0], 3)
    with pytest.raises(SplitError, match=r"nn\.Sequential"):
        layers_of(nn.Linear(2, 2))


def _weight_gradient_calls(name: str) -> list[tuple[int, bool, bool]]:
    """(stage, last, whether the stage's gradients were already complete) for every call of
    the hook on this rank, over one step."""
    torch.set_num_threads(1)
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    plan = _plan(name, world, 4)
    all_modules = _stage_modules(plan.num_stages)
    stages = [PipelineStage(all_modules[s], s, plan.num_stages) for s in plan.stages_of(rank)]
    calls: list[tuple[int, bool, bool]] = []

    def hook(stage: PipelineStage, last: bool) -> None:
        first = next(iter(stage.module.parameters()))
        calls.append((stage.stage_index, last, first.grad is not None))

    schedule = PipelineSchedule(plan, stages, _loss, before_weight_gradients=hook)
    schedule.step(*_data(0))
    return calls


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SCHEDULES)
def test_weight_gradient_hook_marks_each_stages_last_backward(name: str) -> None:
    """The hook runs before each microbatch's weight-gradient pass of each local stage (4
    microbatches: 4 calls per stage), ``last`` on the final one only."""
    for rank, calls in enumerate(run_on_ranks(2, _weight_gradient_calls, name, timeout=60)):
        by_stage: dict[int, list[tuple[bool, bool]]] = {}
        for stage, last, had_grad in calls:
            by_stage.setdefault(stage, []).append((last, had_grad))
        assert by_stage, rank
        for stage, marks in by_stage.items():
            assert [last for last, _ in marks] == [False, False, False, True], (stage, marks)
            # Called before the pass: the first microbatch finds no gradient yet.
            assert [had for _, had in marks] == [False, True, True, True], (stage, marks)

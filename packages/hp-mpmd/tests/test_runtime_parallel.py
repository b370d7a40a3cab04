"""The pipeline runtime composed with other parallelism, equal to single-device training:

* tensor parallelism inside each stage (hp-dtensor production mode on a TP sub-mesh), world 4
  as 2 stages x TP 2;
* data parallelism across pipeline replicas, world 4 as 2 replicas x 2 stages;
* heterogeneous MPMD stages, world 3: stage 0 on one rank, stage 1 on two ranks with TP (the
  activation goes to both, its gradient comes back summed);
* an embedding tied with the LM head across stages, world 2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _reference import train_single_device
from hp_dtensor import DeviceMesh, layout_of
from hp_dtensor.device_mesh import ensure_groups, process_group
from hp_dtensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hp_layout import Mesh
from hp_mpmd import (
    PipelineSchedule,
    PipelineStage,
    StagePlacement,
    TiedParameter,
    all_reduce_gradients,
    build_stages,
    layers_of,
)
from hp_mpmd.schedules import one_f_one_b, zero_bubble_h1
from hp_testing import run_on_ranks

DIM, HID, BLOCKS, BATCH, STEPS, LR, MB = 6, 8, 3, 8, 2, 0.1, 4
VOCAB = 10
# fp32 against single device: losses absolutely (about 2.5 for the MLP, where an fp32 ulp is
# 2.4e-7, and 5.7 for the tied model, ulp 4.8e-7), gradients relative to each tensor's largest
# entry. Largest measured (torch 2.13, x86 CPU, the same on every run): PP x TP 2.4e-7 /
# 2.6e-7, DP x PP 2.4e-7 / 2.3e-7, heterogeneous 2.1e-7 / 1.9e-7, tied 6.0e-7 / 3.7e-7
# (loss / grad). Gradients asserted with 3-5x headroom for another CPU's summation order; the
# loss bound (four ulps of the MLP's loss, two of the tied model's) was already that tight and
# stays. The README quotes both.
LOSS_TOL, GRAD_TOL = 1e-6, 1e-6


class Block(nn.Module):
    """A residual MLP block (w1 column-parallel, w2 row-parallel with a bias under TP: a stage
    whose input gradient leaves it partial, so no backward all-reduce over the TP group runs
    before the bias gradient's reduction)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HID)
        self.w2 = nn.Linear(HID, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.w2(torch.tanh(self.w1(x)))
        return out


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def _data(step: int, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(batch, DIM, generator=g), torch.randn(batch, DIM, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _reference(steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    return train_single_device(_model(), _data, _loss, steps, LR)


def _local_part(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    layout = layout_of(p)
    if dist.get_rank() not in layout.mesh or layout.mesh.size == 1:
        return full
    out = full
    for d, (a, b) in enumerate(layout.local_region(dist.get_rank()).box):
        out = out.narrow(d, a, b - a)
    return out


def _compare(
    modules: list[nn.Module],
    losses: list[list[float]],
    grads: list[dict[str, torch.Tensor]],
    ref_losses: list[float],
    ref_grads: list[dict[str, torch.Tensor]],
) -> dict[str, float]:
    loss_err = max(
        (abs(sum(m) / len(m) - r) for m, r in zip(losses, ref_losses, strict=True) if m),
        default=0.0,
    )
    params = {n: p for m in modules for n, p in m.named_parameters()}
    grad_err = 0.0
    for mine, ref in zip(grads, ref_grads, strict=True):
        for n, g in mine.items():
            r = _local_part(params[n], ref[n])
            grad_err = max(grad_err, float((g - r).abs().max() / r.abs().max()))
    return {"loss": loss_err, "grad": grad_err}


def _train(
    schedule: PipelineSchedule,
    modules: list[nn.Module],
    after_backward: Any = None,
    data: Any = _data,
) -> tuple[list[list[float]], list[dict[str, torch.Tensor]]]:
    opt = torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR)
    losses, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data(step)
        losses.append([float(v) for v in schedule.step(x, y).losses])
        if after_backward is not None:
            after_backward()
        grads.append({n: p.grad.clone() for m in modules for n, p in m.named_parameters()})  # type: ignore[union-attr]
        opt.step()
    return losses, grads


def _tp_plan() -> dict[str, Any]:
    return {"*.w1": ColwiseParallel(), "*.w2": RowwiseParallel()}


def _pp_tp(schedule_name: str) -> dict[str, float]:
    """World 4: plan ranks (0, 1) and (2, 3), each a TP group of 2."""
    torch.set_num_threads(1)
    groups = ((0, 1), (2, 3))
    ensure_groups(groups)
    plan = one_f_one_b(2, MB) if schedule_name == "1f1b" else zero_bubble_h1(2, MB)
    # hp-dtensor hands a tensor-parallel stage's input gradient back whole on every rank.
    placement = StagePlacement(groups)
    me = dist.get_rank()
    s = placement.plan_rank_of(me)
    assert s is not None
    module: nn.Module = build_stages(layers_of(_model()), (0, 2, BLOCKS))[s]
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",), ranks=groups[s]))
    module = parallelize_module(module, mesh, _tp_plan(), mode="production")
    schedule = PipelineSchedule(plan, [PipelineStage(module, s, 2)], _loss, placement=placement)
    losses, grads = _train(schedule, [module])
    return _compare([module], losses, grads, *_reference(STEPS))


def _dp_pp() -> dict[str, float]:
    """World 4: replicas (0, 1) and (2, 3) of a 2-stage pipeline, each on half the batch."""
    torch.set_num_threads(1)
    ensure_groups([(0, 2), (1, 3)])
    me = dist.get_rank()
    replica, s = divmod(me, 2)
    placement = StagePlacement(((2 * replica,), (2 * replica + 1,)))
    module = build_stages(layers_of(_model()), (0, 2, BLOCKS))[s]
    stage = PipelineStage(module, s, 2)
    schedule = PipelineSchedule(one_f_one_b(2, MB), [stage], _loss, placement=placement)
    half = BATCH // 2

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _data(step)
        return x[replica * half : (replica + 1) * half], y[replica * half : (replica + 1) * half]

    dp_group = process_group((s, s + 2))
    losses, grads = _train(
        schedule, [module], lambda: all_reduce_gradients([stage], dp_group), data
    )
    # The replica's loss is the mean over its half: average the two replicas' losses.
    if losses[0]:
        t = torch.tensor([sum(v) / len(v) for v in losses])
        dist.all_reduce(t, group=dp_group)
        losses = [[float(v) / 2] for v in t]
    return _compare([module], losses, grads, *_reference(STEPS))


def _heterogeneous() -> dict[str, float]:
    """World 3: stage 0 on rank 0, stage 1 on ranks (1, 2) with TP 2."""
    torch.set_num_threads(1)
    groups = ((0,), (1, 2))
    ensure_groups([groups[1]])
    # hp-dtensor hands a tensor-parallel stage's input gradient back whole on every rank.
    placement = StagePlacement(groups)
    s = 0 if dist.get_rank() == 0 else 1
    module: nn.Module = build_stages(layers_of(_model()), (0, 1, BLOCKS))[s]
    if s == 1:
        mesh = DeviceMesh("cpu", Mesh((2,), ("tp",), ranks=groups[1]))
        module = parallelize_module(module, mesh, _tp_plan(), mode="production")
    schedule = PipelineSchedule(
        one_f_one_b(2, MB), [PipelineStage(module, s, 2)], _loss, placement=placement
    )
    losses, grads = _train(schedule, [module])
    return _compare([module], losses, grads, *_reference(STEPS))


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule_name", ["1f1b", "zb_h1"])
def test_tensor_parallel_stages(schedule_name: str) -> None:
    results = run_on_ranks(4, _pp_tp, schedule_name, timeout=120)
    print(max(r["grad"] for r in results), max(r["loss"] for r in results))
    for r in results:
        assert r["loss"] < LOSS_TOL, r
        assert r["grad"] < GRAD_TOL, r


@pytest.mark.multiprocess
def test_data_parallel_pipeline_replicas() -> None:
    results = run_on_ranks(4, _dp_pp, timeout=120)
    print(max(r["grad"] for r in results), max(r["loss"] for r in results))
    for r in results:
        assert r["loss"] < LOSS_TOL, r
        assert r["grad"] < GRAD_TOL, r


@pytest.mark.multiprocess
def test_heterogeneous_stage_meshes() -> None:
    results = run_on_ranks(3, _heterogeneous, timeout=120)
    print(max(r["grad"] for r in results), max(r["loss"] for r in results))
    for r in results:
        assert r["loss"] < LOSS_TOL, r
        assert r["grad"] < GRAD_TOL, r


# ------------------------------------------------------------------------- tied parameters


class Head(nn.Module):
    """The LM head, reusing the embedding matrix."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.linear(x, self.weight)
        return out


def _tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    emb = nn.Embedding(VOCAB, DIM)
    weight = emb.weight
    assert isinstance(weight, nn.Parameter)
    return nn.Sequential(emb, Block(), Block(), Head(weight))


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, VOCAB, (BATCH,), generator=g), torch.randint(
        0, VOCAB, (BATCH,), generator=g
    )


def _tied() -> dict[str, float]:
    torch.set_num_threads(1)
    model = _tied_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ref_losses, ref_grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _tokens(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        ref_losses.append(loss.item())
        ref_grads.append({n: p.grad.clone() for n, p in model.named_parameters()})  # type: ignore[union-attr]
        opt.step()
    s = dist.get_rank()
    module = build_stages(layers_of(_tied_model()), (0, 2, 4))[s]
    weight = module.get_parameter("0.weight" if s == 0 else "3.weight")
    tied = TiedParameter(weight, owners=(0, 1))
    tied.sync_values()
    schedule = PipelineSchedule(one_f_one_b(2, MB), [PipelineStage(module, s, 2)], F.cross_entropy)
    losses, grads = _train(schedule, [module], tied.reduce_grads, _tokens)
    # The head's weight is the embedding's: compare it with the reference's only copy.
    grads = [{("0.weight" if n == "3.weight" else n): g for n, g in d.items()} for d in grads]
    out = _compare([_tied_model()], losses, grads, ref_losses, ref_grads)
    out["drift"] = tied.max_drift()
    return out


@pytest.mark.multiprocess
def test_tied_embedding_and_head() -> None:
    results = run_on_ranks(2, _tied, timeout=120)
    print(max(r["grad"] for r in results), max(r["loss"] for r in results))
    for r in results:
        assert r["loss"] < LOSS_TOL, r
        assert r["grad"] < GRAD_TOL, r
        assert r["drift"] == 0.0, r

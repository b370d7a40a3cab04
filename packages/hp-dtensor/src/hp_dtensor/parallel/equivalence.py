"""``assert_equivalent``: a plan in one mode against a single-device run, step by step.

Every rank builds the model twice from the same seed: once whole (the single-device
reference, run on the whole batch), once parallelized by the plan in the given mode (run on the
rank's data-parallel part of the batch). Both train with the same optimizer for a few steps;
losses, every parameter's gradient (gathered) and the final parameters are compared. The report
names the worst parameter; tolerances are relative to each tensor's largest magnitude.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import hp_dtensor._comm as _comm
from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor import DTensor
from hp_dtensor.interop import layout_of
from hp_dtensor.parallel.api import Mode, parallelize_module
from hp_dtensor.parallel.init import materialize
from hp_dtensor.parallel.plan import ShardingPlan
from hp_dtensor.parallel.styles import ParallelStyle
from hp_dtensor.parallel.validation import check_gradients
from hp_dtensor.redistribute import redistribute_local
from hp_layout import Layout, ReduceOp, Replicate, Shard

__all__ = ["EquivalenceReport", "assert_equivalent", "full_value"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class EquivalenceReport:
    """Errors of one mode against the single-device run.

    Attributes:
        mode: ``"production"`` or ``"validation"``.
        losses: the mode's global loss per step.
        reference_losses: the single-device loss per step.
        loss_error: largest ``|loss - reference| / max(|reference|, 1)`` over steps.
        grad_error: largest relative gradient error over parameters and steps.
        worst_grad: the parameter (and step) with that error.
        param_error: largest relative parameter error after the last step.
        worst_param: the parameter with that error.
    """

    mode: str
    losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    loss_error: float
    grad_error: float
    worst_grad: str
    param_error: float
    worst_param: str


def full_value(t: torch.Tensor, mesh: DeviceMesh, like: torch.Tensor | None = None) -> torch.Tensor:
    """The whole value of a parameter (or of a gradient laid out ``like`` its parameter) in
    either mode (collective over the ranks of its layout's mesh, which may be a sub-mesh of
    ``mesh``)."""
    if isinstance(t, DTensor):
        return t.full_tensor().detach()
    layout = layout_of(like if like is not None else t)
    if layout.is_replicated:
        return t.detach()
    if layout.mesh != mesh.mesh:
        # Laid out on another mesh of the job (FSDP's data-parallel sub-mesh, say).
        mesh = DeviceMesh(mesh.device_type, layout.mesh)
    whole = Layout(layout.global_shape, mesh.mesh, [Replicate()] * mesh.ndim)
    return redistribute_local(t.detach(), layout, whole, mesh)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.abs().max().item() if want.numel() else 0.0, 1e-12)
    return (got.double() - want.double()).abs().max().item() / scale if want.numel() else 0.0


def _data_parallel_slice(
    batch: torch.Tensor, mesh: DeviceMesh, dp_axes: Sequence[str]
) -> torch.Tensor:
    out = batch
    for axis in dp_axes:
        out = out.chunk(mesh.size(axis), 0)[mesh.get_local_rank(axis)]
    return out


def _default_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def assert_equivalent(
    build: Callable[[], nn.Module],
    plan: Mapping[str, ParallelStyle | ShardingPlan],
    mesh: DeviceMesh,
    batches: Sequence[Batch],
    *,
    mode: Mode,
    tp_axis: str | None = None,
    dp_axes: Sequence[str] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _default_loss,
    parallel_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    seed: int = 0,
    deferred_init: bool = False,
    loss_tolerance: float = 1e-5,
    grad_tolerance: float = 1e-4,
) -> EquivalenceReport:
    """Train ``build()`` whole and parallelized by ``plan`` (in ``mode``) on ``batches``.

    Each batch is ``(inputs, targets)`` of the whole batch, identical on every rank. With
    ``deferred_init`` the parallelized model is built on ``meta`` and materialized shard by
    shard (:func:`hp_dtensor.parallel.materialize`). Both models train from the same RNG state
    each step, so dropout must give the same masks.
    ``parallel_loss_fn`` (default ``loss_fn``) computes the parallelized model's loss, e.g. a
    vocabulary-parallel loss under ``loss_parallel``. Raises
    AssertionError, naming the worst parameter, if an error exceeds its tolerance; returns the
    report otherwise. Every rank of ``mesh`` must call it.
    """
    names = mesh.mesh_dim_names
    tp = tp_axis if tp_axis is not None else names[0]
    data_axes = tuple(n for n in names if n != tp) if dp_axes is None else tuple(dp_axes)
    make_optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-2))
    reference, model = _build_pair(build, plan, mesh, mode, tp, data_axes, seed, deferred_init)
    torch.manual_seed(seed + 1)
    ref_opt, opt = make_optimizer(reference.parameters()), make_optimizer(model.parameters())
    losses: list[float] = []
    ref_losses: list[float] = []
    grad_error, worst_grad = 0.0, ""
    parallel_loss = parallel_loss_fn or loss_fn
    for step, batch in enumerate(batches):
        inputs, targets = batch
        rng_state = torch.get_rng_state()
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(inputs), targets)
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        torch.set_rng_state(rng_state)  # the same dropout draws for the parallelized model
        opt.zero_grad()
        local_inputs, local_targets = (_data_parallel_slice(t, mesh, data_axes) for t in batch)
        losses.append(
            _step_loss(model, mesh, mode, data_axes, local_inputs, local_targets, parallel_loss)
        )
        if mode == "validation":
            check_gradients(model)
        step_error, step_worst = _worst_grad_error(model, reference, mesh, step)
        if step_error > grad_error:
            grad_error, worst_grad = step_error, step_worst
        ref_opt.step()
        opt.step()
    param_error, worst_param = _worst_param_error(model, reference, mesh)
    loss_error = max(
        (abs(a - b) / max(abs(b), 1.0) for a, b in zip(losses, ref_losses, strict=True)),
        default=0.0,
    )
    report = EquivalenceReport(
        mode,
        tuple(losses),
        tuple(ref_losses),
        loss_error,
        grad_error,
        worst_grad,
        param_error,
        worst_param,
    )
    if loss_error > loss_tolerance or grad_error > grad_tolerance or param_error > grad_tolerance:
        raise AssertionError(f"{mode} mode differs from single device: {report}")
    return report


def _build_pair(
    build: Callable[[], nn.Module],
    plan: Mapping[str, ParallelStyle | ShardingPlan],
    mesh: DeviceMesh,
    mode: Mode,
    tp: str,
    data_axes: tuple[str, ...],
    seed: int,
    deferred_init: bool,
) -> tuple[nn.Module, nn.Module]:
    """The single-device reference and the parallelized model, both built from ``seed`` (the
    parallelized one on ``meta`` and materialized shard by shard with ``deferred_init``)."""
    torch.manual_seed(seed)
    reference = build()
    if deferred_init:
        with torch.device("meta"):
            model = build()
        model = parallelize_module(model, mesh, plan, mode=mode, tp_axis=tp, dp_axes=data_axes)
        materialize(model, seed=seed)
    else:
        torch.manual_seed(seed)
        model = parallelize_module(build(), mesh, plan, mode=mode, tp_axis=tp, dp_axes=data_axes)
    return reference, model


def _worst_grad_error(
    model: nn.Module, reference: nn.Module, mesh: DeviceMesh, step: int
) -> tuple[float, str]:
    """The largest relative gradient error of this step and where it is (the first parameter
    with it, and the step), or ``(0.0, "")``."""
    grad_error, worst_grad = 0.0, ""
    for (name, param), (_, ref_param) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert param.grad is not None, name
        assert ref_param.grad is not None, name
        error = _relative(full_value(param.grad, mesh, like=param), ref_param.grad)
        if error > grad_error:
            grad_error, worst_grad = error, f"{name} (step {step})"
    return grad_error, worst_grad


def _worst_param_error(
    model: nn.Module, reference: nn.Module, mesh: DeviceMesh
) -> tuple[float, str]:
    """The largest relative parameter error and the first parameter with it, or ``(0.0, "")``."""
    param_error, worst_param = 0.0, ""
    for (name, param), (_, ref_param) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        error = _relative(full_value(param, mesh), ref_param.detach())
        if error > param_error:
            param_error, worst_param = error, name
    return param_error, worst_param


def _step_loss(
    model: nn.Module,
    mesh: DeviceMesh,
    mode: Mode,
    data_axes: Sequence[str],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> float:
    """One forward and backward; the global loss (mean over the whole batch)."""
    out = model(inputs)
    if mode == "validation":
        placements: list[Any] = [Replicate()] * mesh.ndim
        for axis in data_axes:
            placements[mesh.mesh.axis_index(axis)] = Shard(0)
        dtargets = DTensor.from_local(targets, mesh, placements)
        loss = loss_fn(out, dtargets)
        loss.backward()
        assert isinstance(loss, DTensor)
        return float(loss.full_tensor().item())
    loss = loss_fn(out, targets)
    loss.backward()
    total = loss.detach().reshape(1)
    for axis in data_axes:
        total = _comm.all_reduce(total, ReduceOp.AVG, _comm.AxisGroup.of(mesh, axis))
    return float(total.item())

"""Validation mode runs the scripts production mode runs, against one device.

* A loss computed outside the model against plain tensors (``F.mse_loss(model(x), t)``,
  ``F.cross_entropy`` with plain labels and class weights, a plain temperature): plain tensors
  that meet the model's DTensors are taken as replicated, and a plain tensor that requires
  grad gets its true gradient on every rank (as on one device, never a per-rank share).
* Hugging Face's ``Qwen3MoeForCausalLM`` under its tensor-parallel plan: its sparse MoE block
  routes with ``softmax``, ``topk`` (and, as Mixtral's router does, renormalizes the top-k
  weights in place: the eager case), and runs the experts through either of transformers'
  implementations (``grouped_mm``: ``sort``, ``histc``, ``cumsum``, ``torch._grouped_mm``,
  ``x[perm] = arange``; ``eager``, Mixtral's and Qwen3's own forward: ``one_hot``,
  ``nonzero``, ``torch.where``, a loop over the hit experts, ``index_add_``), with the
  router's load-balancing loss (``histc`` again).

The oracle is the same script on one device (same initialization, same data).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh, DTensor, ShardingRuleError, distribute_tensor
from hp_dtensor._dispatch import replicate_plain_tensors_on
from hp_dtensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    check_gradients,
    parallelize_module,
)
from hp_dtensor.parallel.equivalence import full_value
from hp_layout import Mesh, Partial, Replicate, Shard
from hp_testing import run_on_ranks
from hp_testing.hf import causal_lm, tp_plan_styles


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.abs().max().item(), 1e-30)
    return (got.double() - want.double()).abs().max().item() / scale


def _as_dtensor(x: torch.Tensor) -> DTensor:
    assert isinstance(x, DTensor), type(x)
    return x


def _as_float(loss: torch.Tensor) -> float:
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss.detach())


# A loss outside the model ---------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))  # type: ignore[no-any-return]


def _data() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "x": torch.randn(6, 8, generator=g),
        "target": torch.randn(6, 5, generator=g),
        "labels": torch.tensor([0, 4, -100, 2, 2, 1]),
        "class_weight": torch.tensor([0.5, 2.0, 1.0, 0.25, 3.0]),
        "temperature": torch.tensor(1.5),
    }


def _script(model: nn.Module, data: dict[str, torch.Tensor]) -> torch.Tensor:
    """What a production training script writes: the loss outside the model, against plain
    tensors; ``target`` and ``temperature`` require grad (a learned target, a learned
    temperature)."""
    out = model(data["x"])
    regression = F.mse_loss(out, data["target"])
    classes = F.cross_entropy(
        out * data["temperature"],
        data["labels"],
        weight=data["class_weight"],
        label_smoothing=0.1,
    )
    loss = regression + 0.5 * classes
    loss.backward()
    return loss


def _leaves(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in data.items()}
    out["target"].requires_grad_()
    out["temperature"].requires_grad_()
    return out


def _loss_outside_the_model(mode: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    torch.manual_seed(0)
    reference, model = _MLP(), _MLP()
    model.load_state_dict(reference.state_dict())
    data = _data()
    want_data, got_data = _leaves(data), _leaves(data)
    want = _script(reference, want_data)
    plan: dict[str, ParallelStyle] = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    parallelize_module(model, mesh, plan, mode=mode)  # type: ignore[arg-type]
    got = _script(model, got_data)
    if mode == "validation":
        check_gradients(model)
    report: dict[str, Any] = {
        "loss": abs(_as_float(got) - want.item()),
        "logged": got.item(),  # a script logs loss.item(): a replicated loss allows it
        "plain_grads": all(
            type(got_data[k].grad) is torch.Tensor for k in ("target", "temperature")
        ),
    }
    for name in ("target", "temperature"):
        grad, reference_grad = got_data[name].grad, want_data[name].grad
        assert grad is not None
        assert reference_grad is not None
        report[name] = _relative(grad, reference_grad)
    report["params"] = max(
        _relative(full_value(p.grad, mesh, like=p), q.grad)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        if p.grad is not None and q.grad is not None
    )
    return report


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["validation", "production"])
def test_a_loss_outside_the_model_against_plain_tensors_gives_one_devices_gradients(
    mode: str,
) -> None:
    for report in run_on_ranks(2, _loss_outside_the_model, mode, timeout=120):
        assert report["plain_grads"], report
        # fp32; the row-parallel sum adds in another order than one device.
        assert report["loss"] < 1e-6, report
        assert report["params"] < 1e-6, report
        # A mesh-size factor (2.0) or a per-rank share (0.0 on some rank) would show here.
        assert report["target"] < 1e-6, report
        assert report["temperature"] < 1e-6, report


# Plain tensors and scalars among DTensors ----------------------------------------------------


def _plain_tensors() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    rank = mesh.get_local_rank("tp")
    out: dict[str, Any] = {}
    # A Partial value (2 everywhere: each rank holds 1) plus a 0-d scalar tensor: the scalar is
    # added once, not once per rank.
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
    out["partial_plus_scalar"] = _as_dtensor(partial + torch.tensor(1.0)).full_tensor().tolist()
    out["partial_plus_number"] = _as_dtensor(partial + 1.0).full_tensor().tolist()
    # A 0-d scalar that requires grad, times a sharded and a replicated tensor: d/ds of
    # sum(w * s) is sum(w) = 6 on every rank.
    w = torch.arange(4.0)
    for name, placement in (
        ("scalar_grad_shard", Shard(0)),
        ("scalar_grad_replicate", Replicate()),
    ):
        s = torch.tensor(3.0, requires_grad=True)
        (distribute_tensor(w, mesh, [placement]) * s).sum().backward()
        out[name] = float(s.grad) if s.grad is not None else None
    # Off a validated model's mesh, a plain tensor among DTensors is still an error.
    fresh = distribute_tensor(torch.ones(2, 2), mesh, [Shard(0)])
    try:
        fresh + torch.ones(2, 2)
        out["unmarked"] = "no error"
    except ShardingRuleError as exc:
        out["unmarked"] = str(exc)
    # On it (here marked by hand, as validation mode marks its model's), a plain tensor is
    # taken as replicated and its gradient is whole on every rank.
    replicate_plain_tensors_on(mesh)
    t = torch.tensor([1.0, -2.0, 0.5, 4.0], requires_grad=True)
    x = distribute_tensor(w, mesh, [Shard(0)])
    loss = ((x - t) ** 2).sum()
    loss.backward()
    out["vector_grad"] = t.grad.tolist() if t.grad is not None else None
    # A rank's own piece (half the batch) taken as the whole value: the error says so.
    try:
        x - torch.ones(2)
        out["local_piece"] = "no error"
    except RuntimeError as exc:
        out["local_piece"] = str(exc)
    out["rank"] = rank
    return out


@pytest.mark.multiprocess
def test_plain_tensors_and_scalars_among_dtensors_are_one_value_with_the_true_gradient() -> None:
    t = torch.tensor([1.0, -2.0, 0.5, 4.0])
    want = (2 * (t - torch.arange(4.0))).tolist()
    for report in run_on_ranks(2, _plain_tensors, timeout=60):
        assert report["partial_plus_scalar"] == [3.0] * 3, report
        assert report["partial_plus_number"] == [3.0] * 3, report
        assert report["scalar_grad_shard"] == 6.0, report
        assert report["scalar_grad_replicate"] == 6.0, report
        assert "make it a DTensor" in report["unmarked"], report
        assert report["vector_grad"] == want, report
        assert "plain tensors of shapes [(2,)] were taken as replicated" in report["local_piece"]


# Hugging Face Qwen3-MoE -------------------------------------------------------------------------


def _qwen3_moe(implementation: str) -> dict[str, float]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    reference, model = causal_lm("qwen3_moe"), causal_lm("qwen3_moe")
    for m in (reference, model):
        m.config._experts_implementation = implementation  # type: ignore[union-attr]
        for router in m.modules():
            if hasattr(router, "norm_topk_prob"):
                # Mixtral's form (the eager case): top-k weights renormalized in place.
                setattr(router, "norm_topk_prob", implementation == "eager")  # noqa: B010
    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
    plan = {name: styles[style] for name, style in tp_plan_styles("qwen3_moe").items()}
    parallelize_module(model, mesh, plan, mode="validation", tp_axis="tp")
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(5))
    want = reference(input_ids=ids, labels=ids, output_router_logits=True)
    want.loss.backward()
    got = model(input_ids=ids, labels=ids, output_router_logits=True)
    got.loss.backward()
    check_gradients(model)
    grads = [
        _relative(full_value(p.grad, mesh, like=p), q.grad)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        if p.grad is not None and q.grad is not None
    ]
    missing = sum(
        1
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        if (p.grad is None) != (q.grad is None)
    )
    return {
        "loss": abs(_as_float(got.loss) - want.loss.item()),
        "aux_loss": abs(_as_float(got.aux_loss) - want.aux_loss.item()),
        "grad": max(grads),
        "checked": float(len(grads)),
        "missing": float(missing),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_hugging_face_qwen3_moe_runs_in_validation_mode_with_one_devices_gradients(
    implementation: str,
) -> None:
    for report in run_on_ranks(2, _qwen3_moe, implementation, timeout=300):
        assert report["missing"] == 0, report
        assert report["checked"] > 20, report
        assert report["loss"] < 2e-6, report
        assert report["aux_loss"] < 2e-6, report
        assert report["grad"] < 5e-6, report

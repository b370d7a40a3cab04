"""A model nobody here wrote: Hugging Face ``transformers``' ``LlamaForCausalLM`` (tiny random
config, fp32: grouped-query attention through SDPA, rotary embeddings, the model's own loss
computed inside its forward and returned in a ``ModelOutput``) and a Qwen3-MoE model, under
hp-dtensor's tensor parallelism in both modes, against one device.

Gradients are compared, not only losses, and SGD runs beside AdamW: Adam divides a constant
gradient scale away, so a tensor-parallel run whose gradients were all ``tp`` times too large
(what production mode did with dict-like outputs) still showed the single-device loss curve.
Wrong plans are refused by name in both modes.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh, DTensor
from hp_dtensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PlanError,
    PlanMismatchError,
    RowwiseParallel,
    ShardingPlan,
    check_gradients,
    parallelize_module,
)
from hp_dtensor.parallel._structure import UnfollowableOutputError, map_tensors
from hp_dtensor.parallel.equivalence import full_value
from hp_dtensor.parallel.plan import lower_plan
from hp_dtensor.parallel.siblings import check_sibling_projections
from hp_layout import Mesh
from hp_testing import run_on_ranks
from hp_testing.hf import causal_lm, tp_plan_styles

BATCH, SEQ, STEPS = 4, 8, 3
# fp32 on CPU, 3 steps, tensor-parallel sums in another order than one device: measured loss
# differences up to 9.5e-7 (two fp32 ulps at a loss of 4.2; the bound is four) and, under SGD,
# gradient and parameter differences up to 2.1e-6 of each tensor's largest entry. AdamW
# divides by the root mean square of the gradients, which magnifies the rounding of tiny ones:
# 2.7e-5 (gradients) and 7.1e-5 (parameters) measured. The mean ratio of gradient norms to one
# device: 1 within 4.9e-8.
LOSS_TOLERANCE = 2e-6
GRAD_TOLERANCE = {"sgd": 5e-6, "adamw": 2e-4}


def tp_plan(kind: str = "llama") -> dict[str, ParallelStyle]:
    """Megatron-style tensor parallelism with Hugging Face's module names."""
    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
    return {name: styles[style] for name, style in tp_plan_styles(kind).items()}


def _build(kind: str) -> nn.Module:
    return causal_lm(kind)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.abs().max().item(), 1e-12)
    return (got.double() - want.double()).abs().max().item() / scale


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-2)


def _train_tp(
    kind: str, mode: str, mesh_shape: tuple[int, ...], optimizer: str, return_dict: bool
) -> dict[str, float]:
    """Train the model whole and under the plan from the same init on the same batches;
    the worst loss, gradient and parameter errors (relative to each tensor's largest entry),
    and the mean ratio of parallel to single-device gradient norms."""
    torch.set_num_threads(1)
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    dp_size = mesh.size("dp") if "dp" in names else 1
    dp = mesh.get_local_rank("dp") if "dp" in names else 0
    reference, model = _build(kind), _build(kind)
    # Qwen3-MoE's MLPs are expert blocks (stacked 3-D expert weights): replicated here.
    plan = tp_plan(kind)
    parallelize_module(model, mesh, plan, mode=mode, tp_axis="tp")  # type: ignore[arg-type]
    ref_opt, opt = (
        _optimizer(optimizer, reference.parameters()),
        _optimizer(optimizer, model.parameters()),
    )
    g = torch.Generator().manual_seed(1)
    loss_error = grad_error = 0.0
    norm_ratios: list[float] = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=g)
        ref_opt.zero_grad()
        want = reference(input_ids=ids, labels=ids).loss
        want.backward()
        opt.zero_grad()
        local = ids.chunk(dp_size)[dp]
        out = model(input_ids=local, labels=local, return_dict=return_dict)
        loss = out.loss if return_dict else out[0]
        loss.backward()
        if isinstance(loss, DTensor):
            check_gradients(model)
            got = float(loss.full_tensor())
        else:
            total = loss.detach().reshape(1).clone()
            dist.all_reduce(total)
            got = float(total) / dist.get_world_size()
        loss_error = max(loss_error, abs(got - want.item()))
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.grad is not None
            assert q.grad is not None
            grad = full_value(p.grad, mesh, like=p)
            grad_error = max(grad_error, _relative(grad, q.grad))
            norm_ratios.append(grad.norm().item() / max(q.grad.norm().item(), 1e-30))
        ref_opt.step()
        opt.step()
    param_error = max(
        _relative(full_value(p, mesh), q.detach())
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
    )
    return {
        "loss": loss_error,
        "grad": grad_error,
        "param": param_error,
        "norm_ratio": sum(norm_ratios) / len(norm_ratios),
    }


CASES = [
    ("llama", "production", (2,), "sgd", True),
    ("llama", "production", (2,), "adamw", False),
    ("llama", "validation", (2,), "sgd", True),
    ("llama", "production", (2, 2), "sgd", True),
    ("llama", "validation", (2, 2), "sgd", True),
    ("qwen3_moe", "production", (2,), "sgd", True),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "mode", "mesh_shape", "optimizer", "return_dict"), CASES)
def test_hf_model_under_tp_equals_one_device(
    kind: str, mode: str, mesh_shape: tuple[int, ...], optimizer: str, return_dict: bool
) -> None:
    world = 1
    for size in mesh_shape:
        world *= size
    for report in run_on_ranks(
        world, _train_tp, kind, mode, mesh_shape, optimizer, return_dict, timeout=300
    ):
        assert report["loss"] < LOSS_TOLERANCE, report
        assert report["grad"] < GRAD_TOLERANCE[optimizer], report
        assert report["param"] < GRAD_TOLERANCE[optimizer], report
        # The scale a constant factor would show (tp = 2 gave exactly 2.0 before the fix).
        assert abs(report["norm_ratio"] - 1.0) < 2e-7, report


# Wrong plans ------------------------------------------------------------------------------------


def _wrong_plan(mode: str, wrong: str) -> str:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    plan: dict[str, ParallelStyle | ShardingPlan] = dict(tp_plan())
    if wrong == "o_proj_colwise":
        plan["model.layers.*.self_attn.o_proj"] = ColwiseParallel()
    else:
        del plan["model.layers.*.self_attn.v_proj"]
    model = _build("llama")
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(2))
    try:
        parallelize_module(model, mesh, plan, mode=mode)  # type: ignore[arg-type]
        model(input_ids=ids, labels=ids)
    except (PlanError, PlanMismatchError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("mode", "wrong", "expected"),
    [
        # Validation mode: the boundary check names the module and the layouts.
        (
            "validation",
            "o_proj_colwise",
            r"PlanMismatchError: module 'model\.layers\.0\.self_attn\.o_proj' \(ColwiseParallel\)"
            r": input 0 is .*Shard\(2\).* but the plan says Replicate\(\)",
        ),
        # Validation mode: the op-level replay names the op and the module it runs in.
        (
            "validation",
            "v_proj_missing",
            r"PlanMismatchError: op 'scaled_dot_product_attention' in module "
            r"'model\.layers\.0\.self_attn'.*production mode would compute other local values",
        ),
        # Production mode: the first call finds the input width does not fit the weight.
        (
            "production",
            "o_proj_colwise",
            r"PlanError: module 'model\.layers\.0\.self_attn\.o_proj' \(ColwiseParallel\): its "
            r"input arrives with 16 features",
        ),
        # Production mode, before any forward: the replicated twin of a sharded projection
        # (this one trained silently, with wrong attention, before the check).
        (
            "production",
            "v_proj_missing",
            r"PlanError: module 'model\.layers\.0\.self_attn\.v_proj' \(Linear 32 -> 16\) is "
            r"not in the plan, but its twin 'model\.layers\.0\.self_attn\.k_proj' is "
            "ColwiseParallel",
        ),
    ],
)
def test_wrong_plans_are_refused_naming_the_module(mode: str, wrong: str, expected: str) -> None:
    import re

    for message in run_on_ranks(2, _wrong_plan, mode, wrong):
        assert re.search(expected, message), message


def test_sibling_check_is_pure_and_accepts_an_explicit_replicated_twin() -> None:
    model = _build("llama")
    plan: dict[str, ParallelStyle | ShardingPlan] = dict(tp_plan())
    check_sibling_projections(model, lower_plan(model, plan))
    del plan["model.layers.*.self_attn.v_proj"]
    with pytest.raises(PlanError, match=r"v_proj.*twin.*k_proj"):
        check_sibling_projections(model, lower_plan(model, plan))
    # Saying that it stays replicated is accepted.
    plan["model.layers.*.self_attn.v_proj"] = ShardingPlan()
    check_sibling_projections(model, lower_plan(model, plan))


# Output structures ------------------------------------------------------------------------------


Pair = collections.namedtuple("Pair", ["loss", "logits"])


@dataclasses.dataclass
class Result:
    loss: torch.Tensor
    extras: dict[str, torch.Tensor]


class Opaque:
    """An object that hides a tensor from every structure a boundary can follow."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _Head(nn.Module):
    """A column/row-parallel MLP whose loss is computed inside, returned in ``structure``."""

    def __init__(self, structure: str) -> None:
        super().__init__()
        self.structure = structure
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> Any:
        logits = self.down(torch.relu(self.up(x)))
        loss = logits.square().mean()
        if self.structure == "dict":
            return {"loss": loss, "logits": logits}
        if self.structure == "namedtuple":
            return Pair(loss, logits)
        if self.structure == "dataclass":
            return Result(loss, {"logits": logits})
        if self.structure == "nested":
            return [(loss,), {"logits": [logits]}]
        return Opaque(loss)


def _loss_of(structure: str, out: Any) -> torch.Tensor:
    if structure == "dict":
        return out["loss"]  # type: ignore[no-any-return]
    if structure in ("namedtuple", "dataclass"):
        return out.loss  # type: ignore[no-any-return]
    if structure == "nested":
        return out[0][0]  # type: ignore[no-any-return]
    return out.value  # type: ignore[no-any-return]


def _structured(structure: str) -> float | str:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    torch.manual_seed(0)
    reference = _Head(structure)
    model = _Head(structure)
    model.load_state_dict(reference.state_dict())
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    parallelize_module(model, mesh, plan, mode="production")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    _loss_of(structure, reference(x)).backward()
    try:
        out = model(x)
    except UnfollowableOutputError as exc:
        return str(exc)
    _loss_of(structure, out).backward()
    return max(
        _relative(full_value(p.grad, mesh, like=p), q.grad)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True)
        if p.grad is not None and q.grad is not None
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("structure", ["dict", "namedtuple", "dataclass", "nested"])
def test_gradients_follow_any_output_structure(structure: str) -> None:
    for error in run_on_ranks(2, _structured, structure):
        assert isinstance(error, float), error
        assert error < 1e-6, error


@pytest.mark.multiprocess
def test_an_output_the_boundaries_cannot_follow_is_refused() -> None:
    for message in run_on_ranks(2, _structured, "opaque"):
        assert isinstance(message, str)
        assert "the output of _Head: a Opaque holds tensors" in message, message


def test_map_tensors_reaches_every_tensor_once_and_keeps_the_structure() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    value = [(a, 1, "x"), {"k": Result(b, {"c": c})}, Pair(None, a)]
    seen: list[int] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.numel())
        return t + 1

    out = map_tensors(record, value, where="test")
    assert seen == [1, 2, 3, 1]
    assert isinstance(out[2], Pair)
    assert out[2].loss is None
    assert isinstance(out[1]["k"], Result)
    assert torch.equal(out[1]["k"].extras["c"], c + 1)
    assert out[0][1:] == (1, "x")
    with pytest.raises(UnfollowableOutputError, match="test: a Opaque holds tensors"):
        map_tensors(record, {"x": Opaque(a)}, where="test")

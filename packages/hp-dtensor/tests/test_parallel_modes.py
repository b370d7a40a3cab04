"""One plan, two modes: a Llama-style model under TP, TP+SP and DP x TP, in production and
validation mode, equal to single device over several optimizer steps; wrong plans caught.

The TP and TP+SP cases build the model on ``meta``, materialize each rank's shards (values of
the single-device init) and train with residual dropout (masks of the single-device run)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh, DTensor, _dispatch, layout_of
from hp_dtensor.parallel import (
    Boundary,
    ColwiseParallel,
    ParallelStyle,
    PlanError,
    PlanMismatchError,
    PrepareModuleOutput,
    RowwiseParallel,
    ShardingPlan,
    loss_parallel,
    lower_plan,
    parallelize_module,
    transformer_tp_plan,
)
from hp_dtensor.parallel.equivalence import EquivalenceReport, assert_equivalent
from hp_layout import Mesh, Replicate, Shard
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=30, dim=16, n_layers=2, n_heads=4, ffn_dim=24, max_seq_len=8)
# With residual dropout: single-device equality then also needs the distributed RNG.
DROPOUT_CONFIG = dataclasses.replace(CONFIG, dropout=0.1)


def tp_plan() -> dict[str, ParallelStyle]:
    return transformer_tp_plan()


def sp_plan() -> dict[str, ParallelStyle]:
    return transformer_tp_plan(sequence_parallel=True)


def _batches(batch: int, seq: int, steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, CONFIG.vocab_size, (batch, seq), generator=g),
            torch.randint(0, CONFIG.vocab_size, (batch, seq), generator=g),
        )
        for _ in range(steps)
    ]


def _build() -> nn.Module:
    return Llama(CONFIG)


def _build_with_dropout() -> nn.Module:
    return Llama(DROPOUT_CONFIG)


def _vocab_parallel_loss(
    mesh: DeviceMesh, mode: str
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        context = loss_parallel(mesh["tp"], "tp") if mode == "production" else loss_parallel()
        with context:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return loss


def _run(plan_name: str, mode: str, mesh_shape: tuple[int, ...]) -> EquivalenceReport:
    torch.set_num_threads(1)
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    plan = tp_plan() if plan_name in ("tp", "tp_loss_parallel") else sp_plan()
    parallel_loss = None
    if plan_name == "tp_loss_parallel":
        # Keep the logits sharded on the vocabulary: the loss is computed vocab-parallel.
        plan = transformer_tp_plan(vocab_parallel_logits=True)
        parallel_loss = _vocab_parallel_loss(mesh, mode)
    # Data parallelism draws dropout per replica batch: single-device equality needs no dropout.
    single_axis = len(mesh_shape) == 1
    return assert_equivalent(
        _build_with_dropout if single_axis else _build,
        plan,
        mesh,
        _batches(batch=4, seq=6),
        mode=mode,  # type: ignore[arg-type]
        tp_axis="tp",
        parallel_loss_fn=parallel_loss,
        deferred_init=single_axis and plan_name != "tp_loss_parallel",
        loss_tolerance=1e-6,
        grad_tolerance=1e-5,
    )


CASES = [
    ("tp", "production", (2,)),
    ("tp", "validation", (2,)),
    ("sp", "production", (2,)),
    ("sp", "validation", (2,)),
    ("tp_loss_parallel", "production", (2,)),
    ("tp_loss_parallel", "validation", (2,)),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("plan", "mode", "mesh_shape"), CASES)
def test_llama_equals_single_device(plan: str, mode: str, mesh_shape: tuple[int, ...]) -> None:
    for report in run_on_ranks(2, _run, plan, mode, mesh_shape, timeout=300):
        # fp32 over three AdamW steps: losses to 1e-6, gradients and parameters to 1e-5 of
        # each tensor's largest entry (assert_equivalent raises beyond that; measured: losses
        # equal, gradients within 1e-6).
        assert report.loss_error < 1e-6, report
        assert report.grad_error < 1e-5, report


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["production", "validation"])
def test_dp_x_tp_on_a_2x2_mesh(mode: str) -> None:
    for report in run_on_ranks(4, _run, "tp", mode, (2, 2), timeout=300):
        assert report.loss_error < 1e-6, report
        assert report.grad_error < 1e-5, report


def _wrong_plan() -> str:
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    plan = tp_plan()
    # Row-wise on q_proj, whose input is replicated: production would silently compute
    # garbage; validation must name the module.
    plan["layers.*.attn.q_proj"] = RowwiseParallel()
    torch.manual_seed(0)
    model = parallelize_module(Llama(CONFIG), mesh, plan, mode="validation")
    try:
        model(torch.randint(0, CONFIG.vocab_size, (2, 6)))
    except PlanMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
def test_validation_mode_catches_a_wrong_plan() -> None:
    message = run_on_ranks(2, _wrong_plan)[0]
    assert "layers.0.attn.q_proj" in message, message
    assert "RowwiseParallel" in message


def test_plan_errors_are_clear() -> None:
    model = Llama(CONFIG)
    with pytest.raises(PlanError, match=r"plan entry 'layers\.\*\.attn\.qproj' names no module"):
        lower_plan(model, {"layers.*.attn.qproj": ColwiseParallel()})
    with pytest.raises(PlanError, match=r"ColwiseParallel cannot shard module 'norm' \(RMSNorm\)"):
        lower_plan(model, {"norm": ColwiseParallel()})
    with pytest.raises(PlanError, match="matched by plan entries"):
        lower_plan(
            model, {"layers.*.ffn.w1": ColwiseParallel(), "layers.0.ffn.*": RowwiseParallel()}
        )
    lowered = dict(lower_plan(model, tp_plan()))
    assert lowered["layers.1.attn.o_proj"].style == "RowwiseParallel"
    assert len(lowered) == 2 + 7 * CONFIG.n_layers


def _production_steady_state() -> dict[str, object]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    torch.manual_seed(0)
    model = parallelize_module(Llama(CONFIG), mesh, tp_plan(), mode="production")
    ids = torch.randint(0, CONFIG.vocab_size, (2, 6))
    model(ids).sum().backward()  # first step plans the boundaries
    dispatched: list[str] = []

    def count(func: object, *rest: object) -> None:
        dispatched.append(getattr(func, "__name__", "?"))

    _dispatch.OBSERVERS.append(count)
    created_before = _count_dtensors()
    try:
        logits = model(ids)
        logits.sum().backward()
    finally:
        _dispatch.OBSERVERS.remove(count)
    q = model.get_parameter("layers.0.attn.q_proj.weight")
    return {
        "dispatched": dispatched,
        "new_dtensors": _count_dtensors() - created_before,
        "plain_params": all(not isinstance(p, DTensor) for p in model.parameters()),
        "q_layout": layout_of(q).placements,
        "q_global": layout_of(q).global_shape,
        "q_local": tuple(q.shape),
    }


def _count_dtensors() -> int:
    import gc

    return sum(1 for obj in gc.get_objects() if isinstance(obj, DTensor))


@pytest.mark.multiprocess
def test_production_steady_state_creates_no_dtensor_and_dispatches_nothing() -> None:
    out = run_on_ranks(2, _production_steady_state)[0]
    assert out["dispatched"] == []
    assert out["new_dtensors"] == 0
    assert out["plain_params"]
    assert out["q_layout"] == (Shard(0),)
    assert out["q_global"] == (CONFIG.dim, CONFIG.dim)
    assert out["q_local"] == (CONFIG.dim // 2, CONFIG.dim)


def _general_plan(mode: str) -> EquivalenceReport:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("tp",)))
    plan: dict[str, ParallelStyle | ShardingPlan] = dict(tp_plan())
    # The LM head written in the general form: column-sharded weight, replicated input,
    # output produced sharded on the vocabulary and gathered.
    plan["output"] = ShardingPlan(
        params={"weight": Shard(0)},
        inputs=(Boundary(Replicate(), Replicate()),),
        outputs=Boundary(Shard(-1), Replicate()),
    )
    # And the MLP's output explicitly kept replicated by PrepareModuleOutput.
    plan["layers.*.ffn"] = PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Replicate()
    )
    return assert_equivalent(
        _build,
        plan,
        mesh,
        _batches(batch=2, seq=6, steps=2),
        mode=mode,  # type: ignore[arg-type]
        loss_tolerance=1e-6,
        grad_tolerance=1e-5,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["production", "validation"])
def test_general_sharding_plan_and_prepare_module_output(mode: str) -> None:
    for report in run_on_ranks(2, _general_plan, mode):
        assert report.grad_error < 1e-5, report

"""1-d FSDP, HSDP and gradient accumulation equal to a single-device run (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel.equivalence import full_value
from hp_fsdp import MixedPrecisionPolicy, fully_shard
from hp_fsdp._state import FSDPState
from hp_fsdp.counting import CountingMode
from hp_layout import Mesh
from hp_testing import run_on_ranks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # Uneven sizes: 5x7, 7, 7x3, 3, 3x2, 2 elements over 2 or 4 shards.
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3), nn.ReLU(), nn.Linear(3, 2))


# How the micro-steps before an optimizer step's last one skip reduction: "gradient_sync"
# (set_requires_gradient_sync(False): no reduction at all, unsharded gradients kept),
# "all_reduce" (set_requires_all_reduce(False): reduce-scatter every micro-step, the HSDP
# replicate-axis all-reduce once per optimizer step), "none" (reduce every micro-step).
SYNC_MODES = ("gradient_sync", "all_reduce", "none")


def _train(
    mesh_shape: tuple[int, ...], accumulate: int, skip: str = "gradient_sync"
) -> dict[str, float]:
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    names = ("shard",) if len(mesh_shape) == 1 else ("replicate", "shard")
    mesh = DeviceMesh("cpu", Mesh(mesh_shape, names))
    ref, model = _model(), _model()
    for index in (0, 2, 4):
        fully_shard(model[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    calls: dict[str, int] = {}
    for step in range(3):
        ref_opt.zero_grad()
        opt.zero_grad()
        for micro in range(accumulate):
            x = torch.randn(
                4 * world, 5, generator=torch.Generator().manual_seed(10 * step + micro)
            )
            (ref(x).pow(2).mean() / accumulate).backward()
            last = micro == accumulate - 1
            if skip == "gradient_sync":
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
            elif skip == "all_reduce":
                model.set_requires_all_reduce(last)  # type: ignore[operator]
            with CountingMode() as counts:
                (model(x.chunk(world)[rank]).pow(2).mean() / accumulate).backward()
            for call in counts.collectives:
                if call.purpose is not None:
                    key = f"{call.purpose}_{'last' if last else 'early'}"
                    calls[key] = calls.get(key, 0) + 1
        ref_opt.step()
        opt.step()
    errors = {}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        errors[name] = (full_value(p, mesh).reshape(q.shape) - q).abs().max().item()
    state: FSDPState = model._hp_fsdp_state  # type: ignore[assignment]
    assert state.root is not None
    assert state.root.arena is not None
    errors["slow_collectives"] = float(state.root.arena.slow_collectives)
    return {**errors, **{f"calls.{k}": float(v) for k, v in calls.items()}}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("world", "mesh_shape", "accumulate"),
    # Accumulation under HSDP: test_hsdp_accumulation_all_reduces_once_per_optimizer_step.
    [(2, (2,), 1), (4, (4,), 1), (4, (2, 2), 1)],
)
def test_fsdp_matches_single_device(
    world: int, mesh_shape: tuple[int, ...], accumulate: int
) -> None:
    for errors in run_on_ranks(world, _train, mesh_shape, accumulate):
        slow = errors.pop("slow_collectives")
        errors = {k: v for k, v in errors.items() if not k.startswith("calls.")}
        # fp32, 3 AdamW steps: parameters equal to rounding. Measured (torch 2.13 CPU): at most
        # 5.0e-8 (world 2) and 3.7e-8 (world 4), about one fp32 ulp of the largest weights
        # (~0.5); bound 4x that.
        assert max(errors.values()) < 2e-7, errors
        if len(mesh_shape) == 2:
            # Four groups, one fused slow-tier all-reduce per step.
            assert slow == 3


@pytest.mark.multiprocess
def test_hsdp_accumulation_all_reduces_once_per_optimizer_step() -> None:
    """HSDP 2x2, 3 micro-steps per optimizer step, 3 steps: with set_requires_all_reduce the
    shard-axis reduce-scatters run every micro-step and the slow-tier all-reduce only in the
    last; the parameters still equal the single-device run's."""
    by_mode = {mode: run_on_ranks(4, _train, (2, 2), 3, mode) for mode in SYNC_MODES}
    for mode, results in by_mode.items():
        for result in results:
            errors = {k: v for k, v in result.items() if not k.startswith(("calls.", "slow"))}
            # As test_fsdp_matches_single_device (fp32, 3 AdamW steps): within 2e-7.
            assert max(errors.values()) < 2e-7, (mode, errors)
    calls = {mode: results[0] for mode, results in by_mode.items()}
    # Three groups (the root holds no parameters) in one fused all-reduce bucket per backward.
    assert calls["all_reduce"]["slow_collectives"] == 3  # one per optimizer step
    assert calls["none"]["slow_collectives"] == 9  # one per micro-step
    assert calls["gradient_sync"]["slow_collectives"] == 3
    # Reduce-scatters: 3 groups x 3 steps, every micro-step unless gradient sync is off.
    assert calls["all_reduce"]["calls.grad_reduce_scatter_early"] == 2 * 9
    assert calls["all_reduce"]["calls.grad_reduce_scatter_last"] == 9
    assert "calls.grad_all_reduce_early" not in calls["all_reduce"]
    assert calls["none"]["calls.grad_all_reduce_early"] == 2 * 3
    assert "calls.grad_reduce_scatter_early" not in calls["gradient_sync"]


def _mixed_precision() -> dict[str, Any]:
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = DeviceMesh("cpu", Mesh((world,), ("shard",)))
    ref, model = _model(), _model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for index in (0, 2, 4):
        fully_shard(model[index], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    x = torch.randn(4 * world, 5, generator=torch.Generator().manual_seed(0))
    ref_loss = ref(x).pow(2).mean()
    ref_loss.backward()
    with CountingMode() as counting:
        out = model(x.chunk(world)[rank])
        out.float().pow(2).mean().backward()
    wire: dict[str, set[torch.dtype | None]] = {}
    for call in counting.collectives:
        wire.setdefault(str(call.purpose), set()).add(call.dtype)
    grads = [p.grad for p in model.parameters()]
    errors = [
        (
            (full_value(g, mesh, like=p).reshape(q.shape) - q.grad).abs().max() / q.grad.abs().max()
        ).item()
        for g, p, q in zip(grads, model.parameters(), ref.parameters(), strict=True)
        if g is not None and q.grad is not None
    ]
    return {
        "output_dtype": out.dtype,
        "param_dtypes": {p.dtype for p in model.parameters()},
        "grad_dtypes": {g.dtype for g in grads if g is not None},
        "grad_error": max(errors),
        "wire_dtypes": wire,
    }


@pytest.mark.multiprocess
def test_bf16_mixed_precision_keeps_fp32_main_parameters() -> None:
    out = run_on_ranks(2, _mixed_precision)[0]
    assert out["output_dtype"] == torch.bfloat16
    assert out["param_dtypes"] == {torch.float32}
    assert out["grad_dtypes"] == {torch.float32}
    # On the wire: parameters gathered in the param dtype, gradients reduced in the reduce
    # dtype (a bf16 reduction would add one rounding, within the error bound below).
    assert out["wire_dtypes"] == {
        "param_all_gather": {torch.bfloat16},
        "grad_reduce_scatter": {torch.float32},
    }, out["wire_dtypes"]
    # bf16 compute (8 significant bits: one rounding is up to 2**-8 = 3.9e-3 relative) against
    # the fp32 single-device run, relative to each parameter's largest gradient. Measured
    # (torch 2.13 CPU): 3.2e-3; bound 2**-7 (two bf16 roundings, 2.4x the measurement).
    assert out["grad_error"] < 2.0**-7, out


def _freed() -> bool:
    import gc
    import weakref

    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("shard",)))
    model = _model()
    for index in (0, 2, 4):
        fully_shard(model[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(3, 5)).sum().backward()
    ref = weakref.ref(model)
    del model
    gc.collect()
    return ref() is None


@pytest.mark.multiprocess
def test_a_sharded_model_is_freed() -> None:
    # Autograd keeps parameter hooks in C++; they must not keep the model alive.
    assert all(run_on_ranks(2, _freed))


def _train_by(primitive: str, mesh_shape: tuple[int, ...]) -> dict[str, float]:
    from hp_fsdp._collectives import ReduceScatterPrimitive, reduce_scatter_by

    with reduce_scatter_by(ReduceScatterPrimitive(primitive)):
        return _train(mesh_shape, 1, "none")


@pytest.mark.multiprocess
@pytest.mark.parametrize(("world", "mesh_shape"), [(2, (2,)), (4, (4,)), (4, (2, 2))])
def test_all_to_all_reduce_scatter_equals_the_native_one(
    world: int, mesh_shape: tuple[int, ...]
) -> None:
    """The all-to-all reduce-scatter (``HP_FSDP_REDUCE_SCATTER=all_to_all``) trains like the
    backend's: within the single-device bound, and bit for bit at two ranks (a + b == b + a)."""
    native = run_on_ranks(world, _train_by, "native", mesh_shape)
    a2a = run_on_ranks(world, _train_by, "all_to_all", mesh_shape)
    for ours, theirs in zip(a2a, native, strict=True):
        assert ours["calls.grad_reduce_scatter_last"] == theirs["calls.grad_reduce_scatter_last"]
        errors = {k: v for k, v in ours.items() if not k.startswith(("calls.", "slow"))}
        assert max(errors.values()) < 2e-7, errors  # as test_fsdp_matches_single_device
        if world == 2:
            assert ours == theirs  # the same errors against the same reference: equal weights

"""``hp_mpmd.torch_compat`` side by side with ``torch.distributed.pipelining``.

Every scenario runs the same code twice on each rank, once with torch's classes and once with
hp-mpmd's (only the module the names come from differs), on the same stage modules and data:
losses, returned outputs and gradients must be bit-identical (hp-mpmd's runtime does torch's
operations in torch's order: unscaled backward per microbatch, one division of the gradients
by the microbatch count at the end). Each run is also checked against a single-device oracle
written here (the whole model on the whole batch), and refusals against torch's exception
types.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_mpmd import torch_compat
from hp_testing import run_on_ranks

DIM, LINEARS, BATCH, STEPS, LR = 5, 8, 12, 2, 0.1
# Against the single-device oracle only summation order differs (fp32). Measured (torch 2.13,
# x86 CPU, the same on every run): gradients 7.1e-7 relative to each tensor's largest entry,
# asserted at 2e-6 (2.8x); losses 2.4e-7 absolute (one ulp of the weighted loss in [2, 4)),
# asserted at 1e-6 (a few ulps of losses below 8, so one rounding step more still passes).
LOSS_TOL, GRAD_TOL = 1e-6, 2e-6


# The kinds with two stages per rank.
MULTI = ("interleaved", "bfs", "dualpipev")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LINEARS):
        # Non-zero biases of different scales, so a dropped or doubled bias gradient shows.
        lin = nn.Linear(DIM, DIM)
        with torch.no_grad():
            lin.bias.add_(0.1 * (i + 1))
        layers += [lin, nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _stage_module(model: nn.Sequential, stage: int, num_stages: int) -> nn.Sequential:
    """Stage ``stage`` of ``num_stages``: ``LINEARS // num_stages`` linears (with the tanh
    after each, but not after the model's last), split by hand (no hp code)."""
    per = LINEARS // num_stages
    mods = list(model.children())
    return nn.Sequential(*mods[2 * stage * per : min(2 * (stage + 1) * per, len(mods))])


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    return weight * F.mse_loss(out, target)


def _api(name: str) -> ModuleType:
    if name == "torch":
        from torch.distributed import pipelining

        return pipelining
    return torch_compat


def _build(
    api: ModuleType, kind: str, n_mb: int, loss_fn: Callable[..., torch.Tensor] | None, **kw: Any
) -> tuple[Any, dict[int, nn.Module]]:
    """This rank's stages and schedule of ``kind`` (``gpipe``, ``1f1b``: one stage per rank;
    ``zb``: one, passed as a list; ``interleaved``, ``bfs``: two, looped; ``dualpipev``: two,
    in a V)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    multi = kind in MULTI
    num_stages = 2 * world if multi else world
    model = _model()
    indices = [rank, rank + world] if multi else [rank]
    if kind == "dualpipev":
        indices = [rank, 2 * world - 1 - rank]
    modules: dict[int, nn.Module] = {
        s: copy.deepcopy(_stage_module(model, s, num_stages)) for s in indices
    }
    cpu = torch.device("cpu")
    stages = [api.PipelineStage(modules[s], s, num_stages, cpu) for s in indices]
    cls = {
        "gpipe": api.ScheduleGPipe,
        "1f1b": api.Schedule1F1B,
        "interleaved": api.ScheduleInterleaved1F1B,
        "bfs": api.ScheduleLoopedBFS,
        "zb": api.ScheduleInterleavedZeroBubble,
        "dualpipev": api.ScheduleDualPipeV,
    }[kind]
    schedule = cls(stages if multi or kind == "zb" else stages[0], n_mb, loss_fn=loss_fn, **kw)
    return schedule, modules


def _train(api_name: str, kind: str, n_mb: int, scale_grads: bool, weight: float) -> dict[str, Any]:
    """STEPS SGD steps: per step the ``losses`` list, the returned output and the gradients."""
    torch.set_num_threads(1)
    api = _api(api_name)
    schedule, modules = _build(api, kind, n_mb, _loss, scale_grads=scale_grads)
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    world = dist.get_world_size()
    first, last = 0 in modules, max(modules) == len(modules) * world - 1
    record: dict[str, Any] = {"losses": [], "outputs": [], "grads": [], "last": last}
    # Which hp plan runs (torch's schedules have no such attribute): the numbers cannot tell
    # apart schedules that accumulate every gradient in the same microbatch order.
    plan = getattr(schedule, "plan", None)
    record["plan"] = None if plan is None else plan.name
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _data(step)
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        out = schedule.step(
            *args,
            target=y if last else None,
            losses=losses if last else None,
            loss_kwargs=None if weight == 1.0 else {"weight": weight},
        )
        record["losses"].append([v.detach().clone() for v in losses])
        record["outputs"].append(None if out is None else out.detach().clone())
        grads = {}
        for s, m in modules.items():
            for n, p in m.named_parameters():
                assert p.grad is not None, (s, n)
                grads[f"{s}.{n}"] = p.grad.clone()
        record["grads"].append(grads)
        opt.step()
    return record


def _single_device(
    scale: float, weight: float
) -> list[tuple[float, torch.Tensor, dict[str, torch.Tensor]]]:
    """The oracle: the whole model on the whole batch, SGD; gradients times ``scale``."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: list[tuple[float, torch.Tensor, dict[str, torch.Tensor]]] = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _data(step)
        pred = model(x)
        loss = _loss(pred, y, weight)
        loss.backward()
        grads = {n: p.grad.clone() * scale for n, p in model.named_parameters()}  # type: ignore[union-attr]
        out.append((loss.item(), pred.detach(), grads))
        # SGD must follow the mean gradients in both modes: the pipelined runs step with the
        # gradients they got (scaled by ``scale`` there as well), so do the same here.
        for p in model.parameters():
            p.grad.mul_(scale)  # type: ignore[union-attr]
        opt.step()
    return out


def _both(kind: str, n_mb: int, scale_grads: bool, weight: float) -> dict[str, dict[str, Any]]:
    return {api: _train(api, kind, n_mb, scale_grads, weight) for api in ("torch", "hp")}


def _global_name(key: str, kind: str, world: int) -> str:
    """``"<stage>.<i>.weight"`` of a stage module as the whole model's parameter name."""
    stage, index, what = key.split(".")
    num_stages = 2 * world if kind in MULTI else world
    per = LINEARS // num_stages
    return f"{2 * int(stage) * per + int(index)}.{what}"


CASES = [
    ("gpipe", 2, 3, True),  # 3 microbatches: dividing by 3 is not exact, torch's order matters
    ("gpipe", 4, 4, True),
    ("1f1b", 2, 6, True),
    ("1f1b", 4, 4, False),
    ("interleaved", 2, 6, True),
    ("interleaved", 4, 4, True),
    ("bfs", 2, 3, True),
    ("bfs", 2, 4, False),
    ("zb", 2, 3, True),  # ZB-H1: split backward, weight passes deferred
    ("zb", 4, 4, True),
    # DualPipeV: stage 2p - 1 on rank 0 too (rank 0 is first and last), split backward.
    ("dualpipev", 2, 4, True),
    ("dualpipev", 4, 12, False),
]
PLAN_NAMES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved": "interleaved_1f1b",
    "bfs": "looped_bfs",
    "zb": "zb_h1",
    "dualpipev": "dualpipev",
}
# loss_kwargs reach the loss function: weight 3 on one case (the others pass none).
WEIGHT = {("1f1b", 2, 6, True): 3.0}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "world", "n_mb", "scale_grads"), CASES)
def test_step_bit_identical_to_torch_and_equal_to_one_device(
    kind: str, world: int, n_mb: int, scale_grads: bool
) -> None:
    weight = WEIGHT.get((kind, world, n_mb, scale_grads), 1.0)
    results = run_on_ranks(world, _both, kind, n_mb, scale_grads, weight, timeout=240)
    scale = 1.0 if scale_grads else float(n_mb)
    oracle = _single_device(scale, weight)
    worst_loss = worst_grad = 0.0
    for rank, res in enumerate(results):
        mine, theirs = res["hp"], res["torch"]
        assert mine["last"] == theirs["last"]
        assert mine["plan"] == PLAN_NAMES[kind]
        for step in range(STEPS):
            # Bit-identical to torch: losses, returned outputs, every gradient.
            assert len(mine["losses"][step]) == len(theirs["losses"][step])
            for a, b in zip(mine["losses"][step], theirs["losses"][step], strict=True):
                assert torch.equal(a, b), (rank, step, a, b)
            if theirs["outputs"][step] is None:
                assert mine["outputs"][step] is None
            else:
                assert torch.equal(mine["outputs"][step], theirs["outputs"][step])
            assert mine["grads"][step].keys() == theirs["grads"][step].keys()
            for name, g in mine["grads"][step].items():
                assert torch.equal(g, theirs["grads"][step][name]), (rank, step, name)
            # Against one device.
            loss, pred, grads = oracle[step]
            if mine["last"]:
                assert len(mine["losses"][step]) == n_mb
                mean = float(torch.stack(mine["losses"][step]).mean())
                worst_loss = max(worst_loss, abs(mean - loss))
                assert torch.allclose(mine["outputs"][step], pred, rtol=0, atol=1e-6)
            for name, g in mine["grads"][step].items():
                ref = grads[_global_name(name, kind, world)]
                worst_grad = max(worst_grad, float((g - ref).abs().max() / ref.abs().max()))
    print(f"{kind} world={world} n_mb={n_mb}: loss {worst_loss:.2e}, grad {worst_grad:.2e}")
    assert worst_loss < LOSS_TOL
    assert worst_grad < GRAD_TOL


# ------------------------------------------------------------------ forward-only passes


def _forward_only(api_name: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    api = _api(api_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    first, last = rank == 0, rank == world - 1
    x, y = _data(0)
    args = (x,) if first else ()
    out: dict[str, Any] = {}
    # eval() of a training schedule: outputs and losses, no gradients.
    schedule, modules = _build(api, "1f1b", 4, _loss)
    losses: list[torch.Tensor] = []
    res = schedule.eval(*args, target=y if last else None, losses=losses if last else None)
    out["eval_out"] = res
    out["eval_losses"] = [v.detach() for v in losses]
    out["eval_grads"] = [p.grad for m in modules.values() for p in m.parameters()]
    # A schedule without loss_fn: step() runs forwards only.
    schedule, modules = _build(api, "gpipe", 2, None)
    out["noloss_out"] = schedule.step(*args)
    out["noloss_grads"] = [p.grad for m in modules.values() for p in m.parameters()]
    # Interleaved eval (two stages per rank)
    schedule, _ = _build(api, "interleaved", world, _loss)
    out["interleaved_eval"] = schedule.eval(*args, target=y if last else None)
    return out


def _forward_both() -> dict[str, dict[str, Any]]:
    return {api: _forward_only(api) for api in ("torch", "hp")}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_eval_and_forward_only_steps_match_torch(world: int) -> None:
    model = _model()
    x, y = _data(0)
    with torch.no_grad():
        pred = model(x)
    chunks = pred.split(BATCH // 4)
    ref_losses = [_loss(c, t) for c, t in zip(chunks, y.split(BATCH // 4), strict=True)]
    for rank, res in enumerate(run_on_ranks(world, _forward_both, timeout=240)):
        mine, theirs = res["hp"], res["torch"]
        last = rank == world - 1
        for key in ("eval_out", "noloss_out", "interleaved_eval"):
            if last:
                assert torch.equal(mine[key], theirs[key]), key
                assert torch.allclose(mine[key], pred, rtol=0, atol=1e-6), key
            else:
                assert mine[key] is None, key
                assert theirs[key] is None, key
        assert len(mine["eval_losses"]) == len(theirs["eval_losses"]) == (4 if last else 0)
        for a, b, r in zip(mine["eval_losses"], theirs["eval_losses"], ref_losses, strict=False):
            assert torch.equal(a, b)
            assert abs(float(a) - float(r)) < 1e-6
        for key in ("eval_grads", "noloss_grads"):
            assert all(g is None for g in mine[key]), key
            assert all(g is None for g in theirs[key]), key


# ------------------------------------------------------------------ bad input and refusals


def _outcome(fn: Callable[[], object]) -> tuple[str, str]:
    """``("ok", "")`` or the exception's type name and message."""
    try:
        fn()
    except Exception as exc:  # the test compares the type with torch's
        return type(exc).__name__, str(exc)
    return "ok", ""


def _errors(api_name: str) -> dict[str, tuple[str, str]]:
    """Bad input that both implementations see on every rank (so no rank is left waiting)."""
    torch.set_num_threads(1)
    api = _api(api_name)
    world, rank = dist.get_world_size(), dist.get_rank()
    cpu = torch.device("cpu")
    mod = _stage_module(_model(), rank, world)
    x, y = _data(0)
    args = (x,) if rank == 0 else ()
    target = y if rank == world - 1 else None
    out: dict[str, tuple[str, str]] = {}
    out["stage_index"] = _outcome(lambda: api.PipelineStage(mod, world, world, cpu))
    out["group_larger"] = _outcome(lambda: api.PipelineStage(mod, 0, 1, cpu))
    stage = api.PipelineStage(mod, rank, world, cpu)
    out["1f1b_few"] = _outcome(lambda: api.Schedule1F1B(stage, world - 1, loss_fn=_loss))
    # 5 microbatches on 2 ranks make 2 rounds of zero bubble, which 5 is not a multiple of.
    out["zb_count"] = _outcome(lambda: api.ScheduleInterleavedZeroBubble([stage], 5, _loss))
    v_pair = [
        api.PipelineStage(_stage_module(_model(), s, 2 * world), s, 2 * world, cpu)
        for s in (rank, 2 * world - 1 - rank)
    ]
    out["dualpipev_few"] = _outcome(lambda: api.ScheduleDualPipeV(v_pair, 2 * world - 1, _loss))
    out["dualpipev_one_stage"] = _outcome(lambda: api.ScheduleDualPipeV([stage], 8, _loss))
    schedule = api.ScheduleGPipe(stage, 2, loss_fn=_loss)
    out["losses_tuple"] = _outcome(lambda: schedule.step(*args, target=target, losses=()))
    with torch.no_grad():
        out["no_grad"] = _outcome(lambda: schedule.step(*args, target=target))
    if api_name == "hp":
        # Uneven microbatches: torch splits 12 rows into 5 chunks of 3, 3, 2, 2, 2 and its
        # last stage then fails on the smaller chunk while stage 0 waits (seen with torch
        # 2.13: not run here); hp-mpmd refuses on every rank before any transfer.
        odd = api.ScheduleGPipe(api.PipelineStage(copy.deepcopy(mod), rank, world, cpu), 5, _loss)
        out["uneven"] = _outcome(lambda: odd.step(*args, target=target))
        looped = [
            api.PipelineStage(_stage_module(_model(), s, 2 * world), s, 2 * world, cpu)
            for s in (rank, rank + world)
        ]
        out["dualpipev_looped"] = _outcome(lambda: api.ScheduleDualPipeV(looped, 8, _loss))
    return out


def _errors_both() -> dict[str, dict[str, tuple[str, str]]]:
    return {api: _errors(api) for api in ("torch", "hp")}


@pytest.mark.multiprocess
def test_bad_input_raises_torchs_exception_types() -> None:
    for res in run_on_ranks(2, _errors_both, timeout=240):
        mine, theirs = res["hp"], res["torch"]
        for key in (
            "stage_index",
            "group_larger",
            "1f1b_few",
            "zb_count",
            "dualpipev_few",
            "dualpipev_one_stage",
            "losses_tuple",
            "no_grad",
        ):
            assert theirs[key][0] != "ok", (key, theirs[key])
            assert mine[key][0] == theirs[key][0], (key, mine[key], theirs[key])
        assert "out of range" in mine["stage_index"][1]
        assert "cannot be larger than number of stages" in mine["group_larger"][1]
        assert "must be greater than or equal to the number of stages" in mine["1f1b_few"][1]
        assert "losses must be a list" in mine["losses_tuple"][1]
        assert "multiple of the number of rounds (2)" in mine["zb_count"][1]
        assert "at least as many microbatches as stages" in mine["dualpipev_few"][1]
        assert "exactly 2 stages per rank" in mine["dualpipev_one_stage"][1]
        assert mine["dualpipev_looped"][0] == "ValueError"
        assert "places stages in a V" in mine["dualpipev_looped"][1]
        assert "eval()" in mine["no_grad"][1]
        assert mine["uneven"][0] == "ValueError"
        assert "divisible by n_microbatches=5" in mine["uneven"][1]


def _refusals() -> dict[str, tuple[str, str]]:
    """hp-mpmd's refusals of what torch supports, raised on every rank."""
    from torch.distributed.pipelining.microbatch import TensorChunkSpec

    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    cpu = torch.device("cpu")
    model = _model()
    mod = _stage_module(model, rank, world)
    x, y = _data(0)
    api = torch_compat
    out: dict[str, tuple[str, str]] = {}
    two = (torch.zeros(3, DIM), torch.zeros(3, DIM))
    out["two_inputs"] = _outcome(lambda: api.PipelineStage(mod, rank, world, cpu, input_args=two))
    out["dw_builder"] = _outcome(
        lambda: api.PipelineStage(mod, rank, world, cpu, dw_builder=lambda: print)
    )
    stage = api.PipelineStage(mod, rank, world, cpu)
    spec = (TensorChunkSpec(0),)
    out["chunk_spec"] = _outcome(lambda: api.ScheduleGPipe(stage, 2, _loss, args_chunk_spec=spec))
    schedule = api.ScheduleGPipe(stage, 2, _loss)
    target = y if rank == world - 1 else None
    out["kwargs"] = _outcome(lambda: schedule.step(x, target=target, mask=x))
    # Every rank passes two inputs here (only stage 0 reads them), so every rank refuses.
    out["two_args"] = _outcome(lambda: schedule.step(x, x, target=target))
    multi = [
        api.PipelineStage(copy.deepcopy(m), s, 2 * world, cpu)
        for s, m in ((rank, mod), (rank + world, mod))
    ]
    out["interleaved_count"] = _outcome(
        lambda: api.ScheduleInterleaved1F1B(multi, world + 1, _loss)
    )
    out["zb_two_stages"] = _outcome(lambda: api.ScheduleInterleavedZeroBubble(multi, 4, _loss))
    # Shape metadata that does not match what flows: every rank raises.
    wrong = torch.zeros(BATCH // 2, DIM + 1)
    bad_in = api.PipelineStage(
        copy.deepcopy(mod), rank, world, cpu, input_args=wrong if rank == 1 else None
    )
    s_in = api.ScheduleGPipe(bad_in, 2, _loss)
    out["input_args"] = _outcome(lambda: s_in.step(*((x,) if rank == 0 else ()), target=target))
    bad_out = api.PipelineStage(
        copy.deepcopy(mod), rank, world, cpu, output_args=wrong if rank == 0 else None
    )
    s_out = api.ScheduleGPipe(bad_out, 2, _loss)
    out["output_args"] = _outcome(lambda: s_out.step(*((x,) if rank == 0 else ()), target=target))
    return out


@pytest.mark.multiprocess
def test_unsupported_torch_features_are_refused_naming_the_alternative() -> None:
    from torch.distributed.pipelining._utils import PipeliningMetadataError

    for res in run_on_ranks(2, _refusals, timeout=240):
        for key in ("two_inputs", "dw_builder", "chunk_spec", "kwargs", "two_args"):
            kind, message = res[key]
            assert kind == "NotImplementedError", (key, res[key])
            assert "torch.distributed.pipelining" in message, (key, message)
        assert "one tensor" in res["two_inputs"][1]
        assert "zero_bubble_h1" in res["dw_builder"][1]
        assert "dim 0" in res["chunk_spec"][1]
        assert "['mask']" in res["kwargs"][1]
        assert res["interleaved_count"][0] == "ValueError"
        assert "use 2 or 4, or ScheduleLoopedBFS" in res["interleaved_count"][1]
        assert res["zb_two_stages"][0] == "NotImplementedError"
        assert "one stage per rank" in res["zb_two_stages"][1]
        assert "ScheduleInterleaved1F1B" in res["zb_two_stages"][1]
        # torch raises PipeliningMetadataError, a RuntimeError; hp-mpmd's ShapeMismatchError
        # is one too, and on every rank, naming both stages.
        assert issubclass(PipeliningMetadataError, RuntimeError)
        for key, expected in (
            ("input_args", "stage 1 expects inputs of shape [6, 6] but stage 0 sends [6, 5]"),
            ("output_args", "stage 0 declares outputs of shape [6, 6] but returns [6, 5]"),
        ):
            kind, message = res[key]
            assert kind == "ShapeMismatchError", (key, res[key])
            assert expected in message, (key, message)


def test_schedules_without_an_hp_plan_are_refused() -> None:
    from torch.distributed import pipelining

    assert hasattr(pipelining, "ScheduleZBVZeroBubble")  # torch offers it
    with pytest.raises(NotImplementedError, match=r"zero_bubble_h1.*ScheduleInterleaved1F1B"):
        torch_compat.ScheduleZBVZeroBubble([], 4)


def test_compat_stage_is_an_hp_stage() -> None:
    """torch's positional signature on a subclass of hp_mpmd.PipelineStage, whose own
    keyword signature is unchanged (hp-train and hyper-parallel build it)."""
    import inspect

    from torch.distributed import pipelining

    from hp_mpmd import PipelineStage as HpStage

    assert issubclass(torch_compat.PipelineStage, HpStage)
    ours = list(inspect.signature(torch_compat.PipelineStage).parameters)
    theirs = list(inspect.signature(pipelining.PipelineStage).parameters)
    assert ours == theirs
    for cls in (
        "ScheduleGPipe",
        "Schedule1F1B",
        "ScheduleInterleaved1F1B",
        "ScheduleLoopedBFS",
        "ScheduleInterleavedZeroBubble",
    ):
        ours = list(inspect.signature(getattr(torch_compat, cls)).parameters)
        theirs = list(inspect.signature(getattr(pipelining, cls)).parameters)
        assert ours == theirs, cls
    hp_params = inspect.signature(HpStage).parameters
    assert hp_params["device"].kind is inspect.Parameter.KEYWORD_ONLY

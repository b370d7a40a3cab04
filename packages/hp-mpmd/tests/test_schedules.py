"""Builders: every plan over a grid passes the checker and meets its documented postconditions."""

from __future__ import annotations

import itertools

import pytest

from hp_mpmd.actions import COMM_KINDS, COMPUTE_KINDS, Action, ActionKind, SchedulePlan
from hp_mpmd.check import check_plan
from hp_mpmd.schedules import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # noqa: E741
SENDS = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

STAGES = range(1, 7)
MICROBATCHES = range(1, 13)
GRID = list(itertools.product(STAGES, MICROBATCHES))
INTERLEAVED = [(p, v, m) for p in STAGES for v in range(1, 4) for m in MICROBATCHES if m % p == 0]


def _all_plans() -> list[SchedulePlan]:
    plans = [b(p, m) for p, m in GRID for b in (gpipe, one_f_one_b, zero_bubble_h1)]
    return plans + [interleaved_1f1b(p, v, m) for p, v, m in INTERLEAVED]


PLANS = _all_plans()


def _compute(plan: SchedulePlan, rank: int) -> list[Action]:
    return [a for a in plan.actions[rank] if a.kind in COMPUTE_KINDS]


def test_every_builder_plan_passes_the_checker() -> None:
    for plan in PLANS:
        check_plan(plan)


def test_plans_are_frozen_tuples() -> None:
    plan = one_f_one_b(3, 4)
    assert isinstance(plan.actions, tuple)
    assert all(isinstance(row, tuple) for row in plan.actions)
    with pytest.raises(AttributeError):
        plan.name = "x"  # type: ignore[misc]


def test_sends_follow_their_compute_directly() -> None:
    """Between a compute action and its send there are only other sends."""
    for plan in PLANS:
        for actions in plan.actions:
            for pos, act in enumerate(actions):
                if act.kind not in SENDS:
                    continue
                q = pos - 1
                while actions[q].kind in SENDS:
                    q -= 1
                producer = actions[q]
                assert producer.kind in COMPUTE_KINDS, (plan.name, act)
                assert (producer.stage, producer.microbatch) == (act.stage, act.microbatch)


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b, zero_bubble_h1])
def test_receives_sit_right_before_their_consumer(builder: object) -> None:
    """Without a ring of stages no hoisting is needed: each receive is in the last batch."""
    assert callable(builder)
    for p, m in GRID:
        plan = builder(p, m)
        assert isinstance(plan, SchedulePlan)
        for actions in plan.actions:
            for pos, act in enumerate(actions):
                if act.kind not in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                    continue
                q = pos + 1
                while actions[q].kind in COMM_KINDS:
                    q += 1
                consumer = actions[q]
                assert (consumer.stage, consumer.microbatch) == (act.stage, act.microbatch)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_order(p: int, m: int) -> None:
    plan = gpipe(p, m)
    assert plan.stage_to_rank == tuple(range(p))
    for r in range(p):
        want = [Action(F, r, mb) for mb in range(m)] + [Action(B, r, mb) for mb in range(m)]
        assert _compute(plan, r) == want


@pytest.mark.parametrize(("p", "m"), GRID)
def test_one_f_one_b_order(p: int, m: int) -> None:
    plan = one_f_one_b(p, m)
    for r in range(p):
        kinds = "".join(a.kind.value for a in _compute(plan, r))
        w = min(p - 1 - r, m)
        assert kinds == "F" * w + "FB" * (m - w) + "B" * w
        alive = peak = 0
        for a in _compute(plan, r):
            alive += 1 if a.kind is F else -1
            peak = max(peak, alive)
        assert peak == min(p - r, m)


@pytest.mark.parametrize(("p", "v", "m"), INTERLEAVED)
def test_interleaved_placement_and_order(p: int, v: int, m: int) -> None:
    plan = interleaved_1f1b(p, v, m)
    assert plan.num_stages == p * v
    assert plan.stage_to_rank == tuple(s % p for s in range(p * v))
    for r in range(p):
        compute = _compute(plan, r)
        forwards = [a for a in compute if a.kind is F]
        # groups of p microbatches cycle through the chunks together
        for k, a in enumerate(forwards):
            assert a.stage == ((k // p) % v) * p + r
            assert a.microbatch == (k // (p * v)) * p + k % p
        w = min(2 * (p - 1 - r) + (v - 1) * p, m * v)
        assert all(a.kind is F for a in compute[:w])
        assert len(compute) == 2 * m * v


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zero_bubble_h1_order_and_memory(p: int, m: int) -> None:
    plan = zero_bubble_h1(p, m)
    for r in range(p):
        compute = _compute(plan, r)
        assert {a.kind for a in compute} <= {F, I, W}
        for kind in (F, I, W):
            assert [a.microbatch for a in compute if a.kind is kind] == list(range(m))
        done_i: set[int] = set()
        alive = peak = 0
        for a in compute:
            if a.kind is I:
                done_i.add(a.microbatch)
            if a.kind is W:
                assert a.microbatch in done_i
            alive += {F: 1, I: 0, W: -1}[a.kind]
            peak = max(peak, alive)
        assert peak <= min(p, m)
        # rank r defers k = min(r, m - warm-up) weight passes to after its last input pass
        k = min(r, m - min(p - 1 - r, m))
        kinds = "".join(a.kind.value for a in compute)
        after_last_i = kinds[kinds.rindex("I") + 1 :]
        assert after_last_i == "W" * (k + (1 if k < m else 0))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gpipe(0, 4), "num_stages must be a positive integer, got 0"),
        (lambda: one_f_one_b(2, -1), "num_microbatches must be a positive integer, got -1"),
        (lambda: zero_bubble_h1(2, True), "num_microbatches must be a positive integer"),
        (
            lambda: one_f_one_b(2.0, 4),  # type: ignore[arg-type]
            "num_stages must be a positive integer, got 2.0",
        ),
        (lambda: interleaved_1f1b(0, 2, 4), "num_ranks must be a positive integer"),
        (lambda: interleaved_1f1b(2, 0, 4), "stages_per_rank must be a positive integer"),
        (
            lambda: interleaved_1f1b(4, 2, 6),
            "multiple of num_ranks: got 6 microbatches for 4 ranks; use 4 or 8",
        ),
        (lambda: interleaved_1f1b(4, 2, 3), "got 3 microbatches for 4 ranks; use 4"),
    ],
)
def test_bad_input_is_rejected_clearly(call: object, message: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=r"must|multiple") as info:
        call()
    assert message in str(info.value)


LOOPED = [(p, v, m) for p in range(1, 5) for v in range(1, 4) for m in range(1, 7)]


@pytest.mark.parametrize(("p", "v", "m"), LOOPED)
def test_looped_bfs_order_and_checker(p: int, v: int, m: int) -> None:
    """Breadth-first: per rank, forwards stage by stage (microbatches ascending), then
    backwards stage by stage from the last (microbatches descending); written out here."""
    from hp_mpmd.schedules import looped_bfs

    plan = looped_bfs(p, v, m)
    check_plan(plan)
    assert plan.stage_to_rank == tuple(s % p for s in range(p * v))
    for r in range(p):
        stages = [r + c * p for c in range(v)]
        expected = [Action(F, s, mb) for s in stages for mb in range(m)]
        expected += [Action(B, s, mb) for s in stages[::-1] for mb in range(m - 1, -1, -1)]
        assert _compute(plan, r) == expected


@pytest.mark.parametrize("plan", PLANS[:: max(1, len(PLANS) // 40)], ids=lambda p: p.name)
def test_forward_only_plan_keeps_forwards_in_data_order(plan: SchedulePlan) -> None:
    """Every (stage, microbatch) forward once on its rank, ordered by (microbatch, stage),
    with only activation transfers, each send matched by one receive."""
    from hp_mpmd.schedules import forward_only

    fwd = forward_only(plan)
    assert (fwd.num_stages, fwd.num_microbatches) == (plan.num_stages, plan.num_microbatches)
    assert fwd.stage_to_rank == plan.stage_to_rank
    sends, recvs = set(), set()
    for r, actions in enumerate(fwd.actions):
        kinds = {a.kind for a in actions}
        assert kinds <= {F, ActionKind.SEND_ACT, ActionKind.RECV_ACT}, kinds
        expected = sorted((mb, s) for s in plan.stages_of(r) for mb in range(plan.num_microbatches))
        assert [(a.microbatch, a.stage) for a in _compute(fwd, r)] == expected
        sends |= {(a.stage, a.microbatch) for a in actions if a.kind is ActionKind.SEND_ACT}
        recvs |= {(a.stage - 1, a.microbatch) for a in actions if a.kind is ActionKind.RECV_ACT}
    remote = {
        (s, mb)
        for s in range(plan.num_stages - 1)
        for mb in range(plan.num_microbatches)
        if plan.stage_to_rank[s] != plan.stage_to_rank[s + 1]
    }
    assert sends == recvs == remote


def test_forward_only_runtime_refuses_a_training_plan() -> None:
    import torch

    from hp_mpmd import PipelineSchedule, PipelineStage, StageError, StagePlacement

    stage = PipelineStage(torch.nn.Linear(2, 2), 0, 2)
    placement = StagePlacement(((0,), (1,)))
    with pytest.raises(StageError, match=r"forward_only\(plan\)"):
        PipelineSchedule(
            gpipe(2, 2),
            [stage],
            torch.nn.functional.mse_loss,
            placement=placement,
            forward_only=True,
        )

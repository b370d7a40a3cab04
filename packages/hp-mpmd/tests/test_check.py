"""The checker: hand-broken plans are rejected with a message naming rank, position, action."""

from __future__ import annotations

import dataclasses

import pytest

from hp_mpmd.actions import COMPUTE_KINDS, Action, ActionKind, SchedulePlan
from hp_mpmd.check import PlanCheckError, check_plan, match_of, replay
from hp_mpmd.schedules import gpipe, interleaved_1f1b, one_f_one_b, with_transfers

K = ActionKind


def _edit(plan: SchedulePlan, rank: int, actions: list[Action]) -> SchedulePlan:
    rows = list(plan.actions)
    rows[rank] = tuple(actions)
    return dataclasses.replace(plan, actions=tuple(rows))


def _fails(plan: SchedulePlan, *fragments: str) -> PlanCheckError:
    with pytest.raises(PlanCheckError) as info:
        check_plan(plan)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return info.value


def test_the_error_is_a_value_error_with_location() -> None:
    plan = one_f_one_b(2, 2)
    acts = [a for a in plan.actions[1] if a != Action(K.RECV_ACT, 1, 0, 0)]
    err = _fails(_edit(plan, 1, acts), "rank 1: RECV_F1.0->0 is missing")
    assert isinstance(err, ValueError)
    assert err.rank == 1
    assert err.action == Action(K.RECV_ACT, 1, 0, 0)


def test_dropped_send_is_reported() -> None:
    plan = gpipe(3, 2)
    acts = [a for a in plan.actions[1] if a != Action(K.SEND_GRAD, 1, 1, 0)]
    _fails(_edit(plan, 1, acts), "rank 1: SEND_B1.1->0 is missing")


def test_forward_before_its_receive() -> None:
    plan = one_f_one_b(2, 2)
    acts = list(plan.actions[1])
    assert acts[:2] == [Action(K.RECV_ACT, 1, 0, 0), Action(K.FORWARD, 1, 0)]
    acts[0], acts[1] = acts[1], acts[0]
    _fails(
        _edit(plan, 1, acts),
        "rank 1, position 0: F1.0 runs before its input RECV_F1.0->0 (position 1)",
    )


def test_backward_before_its_forward() -> None:
    plan = gpipe(1, 2)
    acts = [Action(K.BACKWARD, 0, 0), *(a for a in plan.actions[0] if a.kind is not K.BACKWARD)]
    acts.append(Action(K.BACKWARD, 0, 1))
    _fails(_edit(plan, 0, acts), "rank 0, position 0: B0.0 runs before its own forward F0.0")


def test_weight_before_input_pass() -> None:
    plan = SchedulePlan(
        "zb",
        1,
        1,
        (0,),
        (
            (
                Action(K.FORWARD, 0, 0),
                Action(K.BACKWARD_WEIGHT, 0, 0),
                Action(K.BACKWARD_INPUT, 0, 0),
            ),
        ),
    )
    _fails(plan, "rank 0, position 1: W0.0 runs before its input-gradient pass I0.0")


def test_send_before_its_compute() -> None:
    plan = one_f_one_b(2, 1)
    acts = [Action(K.SEND_ACT, 0, 0, 1), Action(K.FORWARD, 0, 0), *plan.actions[0][2:]]
    _fails(_edit(plan, 0, acts), "rank 0, position 0: SEND_F0.0->1 runs before the forward")


def test_send_to_a_stage_on_the_same_rank() -> None:
    plan = interleaved_1f1b(1, 2, 1)  # stages 0 and 1 both on rank 0
    acts = list(plan.actions[0])
    acts.insert(1, Action(K.SEND_ACT, 0, 0, 1))
    _fails(
        _edit(plan, 0, acts),
        "rank 0, position 1: SEND_F0.0->1: stages 0 and 1 both run on rank 0",
    )


def test_wrong_peer_wrong_rank_and_ranges() -> None:
    plan = gpipe(3, 1)
    acts = list(plan.actions[0])
    acts[1] = Action(K.SEND_ACT, 0, 0, 2)
    _fails(_edit(plan, 0, acts), "rank 0, position 1: SEND_F0.0->2: the peer of a SEND_ACT")
    acts = [*plan.actions[0], Action(K.FORWARD, 1, 0)]
    _fails(_edit(plan, 0, acts), "F1.0: stage 1 runs on rank 1, not on rank 0")
    acts = [*plan.actions[0], Action(K.FORWARD, 0, 5)]
    _fails(_edit(plan, 0, acts), "F0.5: microbatch 5 does not exist")
    acts = [*plan.actions[0], Action(K.FORWARD, 0, 0)]
    _fails(_edit(plan, 0, acts), "F0.0: appears twice (first at position 0)")


def test_mixed_backward_styles_and_missing_compute() -> None:
    plan = gpipe(1, 1)
    acts = [*plan.actions[0], Action(K.BACKWARD_INPUT, 0, 0)]
    _fails(_edit(plan, 0, acts), "I0.0: stage 0 microbatch 0 already has a full backward B0.0")
    acts = [Action(K.FORWARD, 0, 0)]
    _fails(_edit(plan, 0, acts), "rank 0: B0.0 is missing")


def test_bad_shape() -> None:
    plan = gpipe(2, 1)
    _fails(dataclasses.replace(plan, stage_to_rank=(0,)), "stage_to_rank has 1 entries")
    _fails(dataclasses.replace(plan, stage_to_rank=(0, 2)), "stage 1 is placed on rank 2")
    _fails(dataclasses.replace(plan, num_microbatches=0), "positive stage and microbatch")


def test_deadlock_of_two_blocking_sends() -> None:
    """Interleaved 1F1B without receive hoisting: rank 0 and rank 1 both block on sends."""
    good = interleaved_1f1b(2, 2, 4)
    compute = [[a for a in row if a.kind in COMPUTE_KINDS] for row in good.actions]
    bad = with_transfers("bad", 4, good.stage_to_rank, compute, resolve_deadlocks=False)
    err = _fails(
        bad,
        "rank 0, position 14: SEND_B2.0->1: deadlock",
        "batch [SEND_B2.0->1] waits for RECV_B1.0->2 (rank 1, position 17)",
        "rank 1, position 13: batch [SEND_B3.1->2, RECV_F1.2->0] waits for RECV_B2.1->3",
    )
    assert err.action == Action(K.SEND_GRAD, 2, 0, 1)


def test_deadlock_of_swapped_receives() -> None:
    plan = one_f_one_b(2, 2)
    # rank 1 receives microbatch 1 before microbatch 0; rank 0 sends them in order.
    rank1 = [
        Action(K.RECV_ACT, 1, 1, 0),
        Action(K.FORWARD, 1, 1),
        Action(K.RECV_ACT, 1, 0, 0),
        Action(K.FORWARD, 1, 0),
        Action(K.BACKWARD, 1, 0),
        Action(K.BACKWARD, 1, 1),
        Action(K.SEND_GRAD, 1, 0, 0),
        Action(K.SEND_GRAD, 1, 1, 0),
    ]
    _fails(
        _edit(plan, 1, rank1),
        "deadlock",
        "rank 0, position 1: batch [SEND_F0.0->1] waits for RECV_F1.0->0 (rank 1, position 2)",
        "rank 1, position 0: batch [RECV_F1.1->0] waits for SEND_F0.1->1",
    )


def test_match_of_pairs_and_rejects_compute() -> None:
    assert match_of(Action(K.SEND_ACT, 2, 3, 3)) == Action(K.RECV_ACT, 3, 3, 2)
    assert match_of(Action(K.SEND_GRAD, 2, 3, 1)) == Action(K.RECV_GRAD, 1, 3, 2)
    with pytest.raises(ValueError, match="not a communication action"):
        match_of(Action(K.FORWARD, 0, 0))


def test_replay_of_a_good_plan_finishes() -> None:
    result = replay(one_f_one_b(3, 4))
    assert result.stuck == ()

"""DualPipeV: the V placement, every action once, the documented phase order and memory bound."""

from __future__ import annotations

import pytest

from hp_mpmd.actions import COMPUTE_KINDS, Action, ActionKind, SchedulePlan
from hp_mpmd.check import check_plan
from hp_mpmd.schedules import dualpipev, interleaved_1f1b
from hp_mpmd.simulate import simulate

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
I, W = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT  # noqa: E741

GRID = [(p, m) for p in range(1, 6) for m in range(2 * p, 2 * p + 7)]


def _compute(plan: SchedulePlan, rank: int) -> list[Action]:
    return [a for a in plan.actions[rank] if a.kind in COMPUTE_KINDS]


def _phases(p: int, m: int, r: int) -> str:
    """The compute kinds of rank ``r`` by chunk, spelled out from the DualPipeV phases
    (``f``/``b``/``i`` chunk 0, ``F``/``B``/``I`` chunk 1, ``w`` a weight pass)."""
    out = "f" * (2 * (p - 1 - r)) + "fF" * (r + 1) + "IwF" * (p - 1 - r)
    out += "fBFb" * (m - 2 * p + r + 1) + "BFb" * (p - 1 - r)
    for i in range(r + 1):
        half = (r + 1) // 2
        out += "I" if i > half or (i == half and r % 2) else "B"
        out += "i" if i >= half else "b"
    return out + "wi" * (p - 1 - r) + "w" * (r + 1)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_dualpipev_placement_order_and_memory(p: int, m: int) -> None:
    plan = dualpipev(p, m)
    check_plan(plan)
    assert plan.num_stages == 2 * p
    assert plan.stage_to_rank == tuple(list(range(p)) + list(reversed(range(p))))
    seen: set[tuple[ActionKind, int, int]] = set()
    for r in range(p):
        compute = _compute(plan, r)
        way_out, way_back = r, 2 * p - 1 - r
        assert {a.stage for a in compute} == {way_out, way_back}
        letters = {(F, way_out): "f", (F, way_back): "F", (B, way_out): "b"}
        letters |= {(B, way_back): "B", (I, way_out): "i", (I, way_back): "I"}
        spelled = "".join("w" if a.kind is W else letters[(a.kind, a.stage)] for a in compute)
        assert spelled == _phases(p, m, r)
        for stage in (way_out, way_back):
            for kind in (F,):
                assert [
                    a.microbatch for a in compute if (a.kind, a.stage) == (kind, stage)
                ] == list(range(m))
            backwards = [a.microbatch for a in compute if a.stage == stage and a.kind in (B, I)]
            assert backwards == list(range(m))
        done_input: set[tuple[int, int]] = set()
        alive = peak = 0
        for a in compute:
            key = (a.kind, a.stage, a.microbatch)
            assert key not in seen
            seen.add(key)
            if a.kind is I:
                done_input.add((a.stage, a.microbatch))
            if a.kind is W:
                assert (a.stage, a.microbatch) in done_input
                done_input.remove((a.stage, a.microbatch))
            alive += {F: 1, B: -1, I: 0, W: -1}[a.kind]
            peak = max(peak, alive)
        assert not done_input  # every deferred weight pass ran
        assert peak <= 2 * p + 1
    forwards = {(s, mb) for k, s, mb in seen if k is F}
    assert forwards == {(s, mb) for s in range(2 * p) for mb in range(m)}


def test_dualpipev_two_ranks_beats_interleaved_bubble() -> None:
    """With unit forward and input/weight passes (B = 2), DualPipeV on two ranks idles less
    than interleaved 1F1B with the same two stages per rank. Rank 0 computes 2m(F + B) = 6m
    and its makespan (the simulator's) is m-independent overhead plus that."""
    m = 8
    dual = simulate(dualpipev(2, m))
    interleaved = simulate(interleaved_1f1b(2, 2, m))
    assert dual.busy == (6.0 * m, 6.0 * m)
    assert dual.bubble_fraction < interleaved.bubble_fraction
    assert dual.makespan < 6.0 * m + 2.0


def test_dualpipev_four_ranks_bubble_below_one_f_one_b() -> None:
    """At p = 4, m = 16 (unit costs) DualPipeV idles less than 1F1B's textbook
    ``(p - 1) / (m + p - 1)`` and than interleaved 1F1B at two stages per rank."""
    p, m = 4, 16
    dual = simulate(dualpipev(p, m)).bubble_fraction
    assert dual < (p - 1) / (m + p - 1)
    assert dual < simulate(interleaved_1f1b(p, 2, m)).bubble_fraction


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: dualpipev(0, 4), "num_ranks must be a positive integer, got 0"),
        (lambda: dualpipev(2, 0), "num_microbatches must be a positive integer, got 0"),
        (lambda: dualpipev(4, 7), "got 7 microbatches for 4 ranks; use at least 8"),
    ],
)
def test_dualpipev_bad_input(call: object, message: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=r"dualpipev|must be") as info:
        call()
    assert message in str(info.value)

"""The simulator: textbook bubble fractions, timing models, and the ASCII timeline."""

from __future__ import annotations

import itertools

import pytest

from hp_mpmd.actions import ActionKind
from hp_mpmd.check import PlanCheckError
from hp_mpmd.schedules import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1
from hp_mpmd.simulate import format_timeline, simulate

GRID = list(itertools.product(range(1, 7), range(1, 13)))
EXACT = 1e-12


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_and_1f1b_bubble(p: int, m: int) -> None:
    want = (p - 1) / (m + p - 1)
    for builder in (gpipe, one_f_one_b):
        for rendezvous in (False, True):
            sim = simulate(builder(p, m), rendezvous=rendezvous)
            assert abs(sim.bubble_fraction - want) < EXACT
            assert sim.makespan == 3 * (m + p - 1)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_interleaved_bubble_shrinks_by_v(p: int, m: int) -> None:
    if m % p:
        return
    for v in (1, 2, 3):
        sim = simulate(interleaved_1f1b(p, v, m))
        assert abs(sim.bubble_fraction - (p - 1) / (v * m + p - 1)) < EXACT
        assert sim.makespan == 3 * (v * m + p - 1)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zero_bubble_h1_beats_1f1b(p: int, m: int) -> None:
    zb = simulate(zero_bubble_h1(p, m))
    ref = simulate(one_f_one_b(p, m))
    if p == 1:
        assert zb.bubble_fraction == ref.bubble_fraction == 0.0
        return
    assert zb.bubble_fraction < ref.bubble_fraction
    if m >= p:  # (p-1)(F+B-W) idle per rank against 1F1B's (p-1)(F+B+W)
        assert abs(zb.bubble_fraction - (p - 1) / (3 * m + p - 1)) < EXACT
        assert zb.makespan == 3 * m + p - 1
    # 1F1B's peak activation memory (its rank 0) is never exceeded
    assert max(zb.peak_in_flight) <= max(ref.peak_in_flight) == min(p, m)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_in_flight_counts_forward_to_last_backward(p: int, m: int) -> None:
    """Written here: +1 at a forward, -1 at the pass that frees the microbatch (the full
    backward, or the weight pass of a split one: its input pass still needs the graph)."""
    plans = [gpipe(p, m), one_f_one_b(p, m), zero_bubble_h1(p, m)]
    plans += [interleaved_1f1b(p, v, m) for v in (1, 2) if m % p == 0]
    free = {ActionKind.FORWARD: 1, ActionKind.BACKWARD: -1, ActionKind.BACKWARD_WEIGHT: -1}
    for plan in plans:
        peaks = []
        for actions in plan.actions:
            alive = peak = 0
            for a in actions:
                alive += free.get(a.kind, 0)
                peak = max(peak, alive)
            peaks.append(peak)
        assert simulate(plan).peak_in_flight == tuple(peaks), plan.name


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 5), (4, 4), (4, 9), (6, 7)])
@pytest.mark.parametrize(("f", "i", "w"), [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 0.5)])
def test_zero_bubble_h1_makespan_with_unequal_passes(
    p: int, m: int, f: float, i: float, w: float
) -> None:
    """ZB-H1 (m >= p, W <= F and W <= I): each rank computes m (F + I + W) and idles
    (p - 1)(F + I - W), the paper's figure; 1F1B with B = I + W idles (p - 1)(F + B)."""
    zb = simulate(zero_bubble_h1(p, m), forward=f, backward_input=i, backward_weight=w)
    assert abs(zb.makespan - (m * (f + i + w) + (p - 1) * (f + i - w))) < EXACT
    assert zb.busy == (m * (f + i + w),) * p
    ref = simulate(one_f_one_b(p, m), forward=f, backward=i + w)
    assert abs(ref.makespan - (m + p - 1) * (f + i + w)) < EXACT
    # The last rank starts after p - 1 forwards and runs its first input pass right away.
    first, then = zb.compute[p - 1][:2]
    assert (first.action.kind, first.start) == (ActionKind.FORWARD, (p - 1) * f)
    assert (then.action.kind, then.end) == (ActionKind.BACKWARD_INPUT, p * f + i)
    first, then = ref.compute[p - 1][:2]
    assert (first.start, then.action.kind) == ((p - 1) * f, ActionKind.BACKWARD)
    assert then.end == p * f + i + w


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_makespan_with_transfer_time(p: int, m: int) -> None:
    """GPipe with eager sends and transfer time c: the first microbatch crosses p - 1
    boundaries forward and p - 1 back; everything else overlaps. 3 (m + p - 1) + 2 c (p - 1)."""
    for c in (0.25, 1.0):
        sim = simulate(gpipe(p, m), comm=c)
        assert abs(sim.makespan - (3 * (m + p - 1) + 2 * c * (p - 1))) < EXACT


def test_rendezvous_transfers_cost_time() -> None:
    """gpipe(2, 2), c = 0.5, blocking batches, worked by hand: rank 0's F0 [0, 1], its send
    completes at 1.5 (F1 [1.5, 2.5]); rank 1 F0 [1.5, 2.5], F1 [3, 4], B0 [4, 6], B1 [6.5, 8.5];
    rank 0 B0 [6.5, 8.5], B1 [9, 11]. Eager sends: 10."""
    plan = gpipe(2, 2)
    sim = simulate(plan, comm=0.5, rendezvous=True)
    assert sim.makespan == 11.0
    starts = [[t.start for t in row] for row in sim.compute]
    assert starts == [[0.0, 1.5, 6.5, 9.0], [1.5, 3.0, 4.0, 6.5]]
    assert simulate(plan, comm=0.5).makespan == 10.0


def test_measured_values_p4_m8() -> None:
    """The figures quoted in the docs (p = 4, m = 8, F = 1, B = 2, I = W = 1)."""
    eager = {
        "gpipe": simulate(gpipe(4, 8)).bubble_fraction,
        "1f1b": simulate(one_f_one_b(4, 8)).bubble_fraction,
        "interleaved v=2": simulate(interleaved_1f1b(4, 2, 8)).bubble_fraction,
        "zb_h1": simulate(zero_bubble_h1(4, 8)).bubble_fraction,
    }
    assert {k: round(x, 4) for k, x in eager.items()} == {
        "gpipe": 0.2727,
        "1f1b": 0.2727,
        "interleaved v=2": 0.1579,
        "zb_h1": 0.1111,
    }
    rendezvous = simulate(interleaved_1f1b(4, 2, 8), rendezvous=True).bubble_fraction
    assert round(rendezvous, 4) == 0.5897
    assert round(simulate(zero_bubble_h1(4, 8), rendezvous=True).bubble_fraction, 4) == 0.2727


def test_compute_times_are_sequential_and_comm_costs_time() -> None:
    plan = one_f_one_b(3, 4)
    sim = simulate(plan, comm=0.5)
    for row in sim.compute:
        for a, b in itertools.pairwise(row):
            assert b.start >= a.end
    assert sim.busy == (12.0, 12.0, 12.0)
    assert sim.makespan > simulate(plan).makespan
    assert sim.num_ranks == 3
    first = sim.compute[1][0]
    assert first.action.kind is ActionKind.FORWARD
    assert first.start == 1.5  # rank 0's forward (1) plus one transfer (0.5)


def test_costs_are_validated_and_bad_plans_refused() -> None:
    with pytest.raises(ValueError, match="forward must be a finite, positive number"):
        simulate(gpipe(2, 2), forward=0.0)
    with pytest.raises(ValueError, match="comm must be a finite, non-negative number"):
        simulate(gpipe(2, 2), comm=-1.0)
    with pytest.raises(ValueError, match="backward must be"):
        simulate(gpipe(2, 2), backward=float("inf"))
    plan = gpipe(2, 1)
    broken = type(plan)(plan.name, 2, 1, (0, 1), (plan.actions[0][:1], plan.actions[1]))
    with pytest.raises(PlanCheckError, match="missing"):
        simulate(broken)


def test_timeline_renders() -> None:
    text = format_timeline(one_f_one_b(4, 8))
    lines = text.splitlines()
    assert lines[0] == ("1f1b: 4 ranks, 4 stages, 8 microbatches, makespan 33, bubble 27.3%")
    assert len(lines) == 5
    assert lines[1].startswith("rank 0 |F0 F1 F2 F3 ......")
    assert lines[4].startswith("rank 3 |.........F0 B0    F1 B1")
    assert len({len(line) for line in lines[1:]}) == 1  # one cell per time unit, aligned


def test_timeline_of_interleaved_and_zero_bubble() -> None:
    text = format_timeline(interleaved_1f1b(2, 2, 2), width=4)
    for label in ("F0a ", "F0b ", "B1a "):
        assert label in text
    zb = format_timeline(zero_bubble_h1(3, 3))
    assert "I0" in zb
    assert "W2" in zb
    sim = simulate(gpipe(2, 2), backward=1.0)
    assert format_timeline(gpipe(2, 2), sim, width=1).splitlines()[1] == "rank 0 |FF..BB|"
    with pytest.raises(ValueError, match="width must be a positive integer"):
        format_timeline(gpipe(2, 2), width=0)

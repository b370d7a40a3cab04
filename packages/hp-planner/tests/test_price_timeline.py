"""``hp_planner.price.timeline`` (its postconditions over generated programs, its errors) and
``hp_planner.price.runtime_order`` (hp-fsdp's order of gathers, prefetches and reduce-scatters
on a small tree of units)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from hp_planner.price.runtime_order import SWAP_KIND, SWAP_TIER, Runtime, Unit, microbatch_program
from hp_planner.price.timeline import Compute, Issue, Mark, Op, Wait, simulate

KINDS = ("fsdp_all_gather", "fsdp_reduce_scatter", "hsdp_all_reduce")
TIERS = ("fast", "slow")


def _program(rng: random.Random) -> list[Op]:
    """A random valid program: computes, issues on two tiers, waits (each issued collective
    waited for once, some at once, some later, the rest at the end)."""
    ops: list[Op] = []
    pending: list[str] = []
    for index in range(rng.randint(0, 30)):
        choice = rng.random()
        if choice < 0.4:
            ops.append(Compute(rng.choice([0.0, rng.random()])))
        elif choice < 0.75:
            name = f"c{index}"
            ops.append(Issue(name, rng.choice(KINDS), rng.choice(TIERS), rng.random()))
            pending.append(name)
        elif pending:
            ops.append(Wait(pending.pop(rng.randrange(len(pending)))))
        else:
            ops.append(Mark(f"m{index}"))
    ops += [Wait(name) for name in pending]
    return ops


@pytest.mark.parametrize("seed", range(200))
def test_postconditions_hold_on_generated_programs(seed: int) -> None:
    program = _program(random.Random(seed))
    line = simulate(program)
    issues = [op for op in program if isinstance(op, Issue)]
    total_exposed = sum(seconds for _, seconds in line.exposed)
    # The compute stream computes or waits.
    assert line.makespan == pytest.approx(line.compute + total_exposed, abs=1e-12)
    assert line.compute == pytest.approx(
        sum(op.seconds for op in program if isinstance(op, Compute))
    )
    for kind, seconds in line.exposed:
        assert seconds >= 0
        # At most its own collectives plus everything queued on the tiers before them.
        assert seconds <= sum(op.seconds for op in issues) + 1e-12
        assert kind in {op.kind for op in issues}
    assert line.issued == tuple(op.name for op in issues)
    for tier, busy in line.busy:
        assert busy == pytest.approx(sum(op.seconds for op in issues if op.tier == tier))
        assert busy <= line.makespan + 1e-12


def test_a_collective_waited_at_once_is_exposed_in_full() -> None:
    line = simulate([Compute(1.0), Issue("a", "fsdp_all_gather", "fast", 0.5), Wait("a")])
    assert line.exposed_of("fsdp_all_gather") == 0.5
    assert line.makespan == 1.5


def test_overlap_queueing_and_tiers() -> None:
    # Hidden behind compute; queued on one tier; side by side on two.
    hidden = simulate([Issue("a", "k", "t", 1.0), Compute(2.0), Wait("a")])
    assert hidden.exposed_of("k") == 0.0
    assert hidden.makespan == 2.0
    queued = simulate(
        [Issue("a", "k", "t", 1.0), Issue("b", "k", "t", 1.0), Compute(1.5), Wait("b"), Wait("a")]
    )
    assert queued.exposed_of("k") == 0.5
    apart = simulate(
        [Issue("a", "k", "t", 1.0), Issue("b", "k", "u", 1.0), Compute(1.5), Wait("b"), Wait("a")]
    )
    assert apart.exposed_of("k") == 0.0
    after = simulate(
        [Issue("a", "k", "t", 1.0), Issue("b", "j", "u", 1.0, after="a"), Wait("b"), Wait("a")]
    )
    assert after.exposed_of("j") == 2.0
    assert after.exposed_of("k") == 0.0


@pytest.mark.parametrize(
    ("program", "message"),
    [
        ([Compute(-1.0)], "durations are >= 0"),
        ([Issue("a", "k", "t", 1.0), Issue("a", "k", "t", 1.0)], "issued twice"),
        ([Wait("a")], "not issued before"),
        ([Issue("b", "k", "t", 1.0, after="a")], "not issued before"),
        ([Issue("a", "k", "t", 1.0)], "never waited for"),
    ],
)
def test_bad_programs_are_named(program: list[Op], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(program)


def _tree(replicate: float = 0.0) -> Unit:
    """A root around two blocks, the second with a nested expert group."""

    def unit(
        name: str,
        forward: tuple[float, ...],
        children: tuple[Unit, ...] = (),
        regather: float = 1.0,
    ) -> Unit:
        return Unit(
            name, forward, children, gather=1.0, regather=regather, scatter=1.0,
            replicate=replicate, chunk_bytes=1 << 20, tier="fast", replicate_tier="slow",
        )  # fmt: skip

    experts = unit("layers.1.ffn", (3.0,))
    blocks = (unit("layers.0", (2.0,)), unit("layers.1", (1.0, 0.0), (experts,)))
    return unit("root", (0.0, 0.0, 1.0), blocks, regather=0.0)


def _issued(program: list[Op]) -> list[str]:
    return [op.name for op in program if isinstance(op, Issue)]


def test_hp_order_of_collectives() -> None:
    """hp-fsdp's order: forward prefetches in the order forwards start, backward in the reverse
    of the order they finish (the root's backward start gathers the last block, a block's its
    nested experts); without HSDP, the first reduce-scatter of the backward is waited for as it
    is issued, every later one is held until the next unit's reduction starts (or the end)."""
    program = microbatch_program(_tree())
    assert _issued(program) == [
        "forward gather root",
        "forward gather layers.0",
        "forward gather layers.1",
        "forward gather layers.1.ffn",
        "backward gather layers.1",
        "backward gather layers.1.ffn",
        "backward gather layers.0",
        "reduce-scatter layers.1.ffn",
        "reduce-scatter layers.1",
        "reduce-scatter layers.0",
        "reduce-scatter root",
    ]
    scatters = [
        (i, op.name)
        for i, op in enumerate(program)
        if isinstance(op, Issue) and "reduce-" in op.name
    ]
    (first, first_name), *held = scatters
    assert program[first + 1] == Wait(first_name)
    for (_, name), after in zip(held, [*(i for i, _ in held[1:]), len(program)], strict=True):
        # Waited for after the compute that follows its issue, right before the next issue.
        waits = [i for i, op in enumerate(program) if op == Wait(name)]
        assert waits == [after - 1], (name, waits, after)
    line = simulate(program)
    # The first one exposed whole (1 s); layers.1's hides behind layers.0's 4 s of backward;
    # layers.0's and the root's have no compute after them before the next reduction: 1 s each.
    assert line.exposed_of("fsdp_reduce_scatter") == 3.0
    assert line.compute == 3 * (2.0 + 1.0 + 3.0 + 1.0)


def test_without_prefetch_every_gather_waits_at_once() -> None:
    program = microbatch_program(_tree(), prefetch_forward=False, prefetch_backward=False)
    gathers = [op for op in program if isinstance(op, Issue) and op.kind == "fsdp_all_gather"]
    assert len(gathers) == 7  # root once, three units twice
    line = simulate(program)
    # Each of the 7 seconds of gathers, and layers.0's backward gather waits on its tier
    # behind the reduce-scatter of layers.1, held in flight: 8.
    assert line.exposed_of("fsdp_all_gather") == 8.0
    prefetched = simulate(microbatch_program(_tree()))
    assert prefetched.exposed_of("fsdp_all_gather") < 7.0


def test_recompute_reruns_the_forward_in_backward() -> None:
    tree = _tree()
    blocks = tuple(replace(b, recompute=1.0) for b in tree.children)
    checkpointed = replace(tree, children=blocks)
    plain, redo = simulate(microbatch_program(tree)), simulate(microbatch_program(checkpointed))
    assert redo.compute == pytest.approx(plain.compute + 2.0 + 1.0 + 3.0)
    # Recompute prefetches nothing: the same collectives in the same order.
    assert redo.issued == plain.issued


def test_hsdp_all_reduces_once_per_bucket_on_the_microbatch_that_reduces() -> None:
    tree = _tree(replicate=2.0)
    skipped = microbatch_program(tree, all_reduce=False)
    reduced = microbatch_program(tree, all_reduce=True)
    assert not [n for n in _issued(skipped) if n.startswith("all-reduce")]
    # Four chunks of 1 MiB: one bucket below the default 25 MiB, fired at the root's
    # reduce-scatter.
    assert [n for n in _issued(reduced) if n.startswith("all-reduce")] == [
        "all-reduce layers.1.ffn"
    ]
    # Its four chunks' all-reduce, issued after the last reduce-scatter: nothing to hide behind.
    assert simulate(reduced).exposed_of("hsdp_all_reduce") == pytest.approx(4 * 2.0)
    # hp-fsdp's cap at 2 MiB (two 1 MiB chunks a bucket, backward order ffn, layers.1,
    # layers.0, root): the first bucket's all-reduce runs behind the backward of layers.0.
    split = microbatch_program(tree, all_reduce=True, hsdp_bucket_bytes=2 << 20)
    assert [n for n in _issued(split) if n.startswith("all-reduce")] == [
        "all-reduce layers.1.ffn",
        "all-reduce layers.0",
    ]
    assert simulate(split).exposed_of("hsdp_all_reduce") < simulate(reduced).exposed_of(
        "hsdp_all_reduce"
    )


def test_torch_fsdp2_keeps_a_reduce_scatter_in_flight() -> None:
    line = simulate(microbatch_program(_tree(), Runtime.TORCH_FSDP2))
    hp = simulate(microbatch_program(_tree()))
    assert line.exposed_of("fsdp_reduce_scatter") < hp.exposed_of("fsdp_reduce_scatter")


def test_units_need_one_segment_more_than_children_and_their_own_names() -> None:
    with pytest.raises(ValueError, match="one more segment than children"):
        Unit("root", (1.0,), (Unit("a", (1.0,)),))
    twice = Unit("root", (0.0, 0.0, 0.0), (Unit("a", (1.0,)), Unit("a", (1.0,))))
    with pytest.raises(ValueError, match="names repeat"):
        microbatch_program(twice)


def test_swap_copies_in_the_swappers_order() -> None:
    """A block's offload is issued at its forward end and waited for at the next block's;
    its backward start fetches it and the previous block's and waits for its own; the copies
    share the host stream, so a copy longer than the compute it overlaps is exposed."""
    tree = _tree()
    blocks = tuple(replace(b, swap=0.5) for b in tree.children)
    swapped = replace(tree, children=blocks)
    program = microbatch_program(swapped)
    swaps = [op for op in program if getattr(op, "name", "").startswith(("offload", "fetch"))]
    assert swaps == [
        Issue("offload layers.0", SWAP_KIND, SWAP_TIER, 0.5),
        Issue("offload layers.1", SWAP_KIND, SWAP_TIER, 0.5),
        Wait("offload layers.0"),
        Wait("offload layers.1"),
        Issue("fetch layers.1", SWAP_KIND, SWAP_TIER, 0.5),
        Issue("fetch layers.0", SWAP_KIND, SWAP_TIER, 0.5),
        Wait("fetch layers.1"),
        Wait("fetch layers.0"),
    ]
    # The offloads run under the head's forward and backward; the last block's fetch is
    # waited for at once; the first block's hides behind the second's backward.
    line = simulate(program)
    assert line.exposed_of(SWAP_KIND) == pytest.approx(0.5)
    assert line.makespan >= simulate(microbatch_program(tree)).makespan
    slow = replace(tree, children=tuple(replace(b, swap=10.0) for b in tree.children))
    assert simulate(microbatch_program(slow)).exposed_of(SWAP_KIND) > 10.0

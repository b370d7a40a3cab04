"""Schedule builders: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV as pure
:class:`SchedulePlan` s.

Every builder first fixes each rank's *compute* order and then inserts the communication with
one rule (:func:`with_transfers`): right before a compute action, the receive it needs (if its
producer stage runs on another rank); right after it, the send it produces (if its consumer
stage runs on another rank). The sends of one compute action and the receives of the next are
consecutive, so the runtime posts them as one batch (Megatron's ``send_forward_recv_backward``
pairing). Where that order would deadlock under rendezvous semantics (interleaved schedules,
whose stages form a ring over the ranks), the receive a blocked send waits for is hoisted into
the batch its rank is blocked in, until the plan runs through: receives stay as late as
deadlock freedom allows and sends right after their compute. Every plan
built here passes :func:`hp_mpmd.check.check_plan`, deadlock check included (property-tested
over stages 1..6, microbatches 1..12, 1..3 stages per rank).

Conventions (shared with the checker): ``SEND_ACT(s, mb, s + 1)`` after ``FORWARD(s, mb)``
matches ``RECV_ACT(s + 1, mb, s)`` before ``FORWARD(s + 1, mb)``; ``SEND_GRAD(s, mb, s - 1)``
after the backward (or input-gradient pass) of ``(s, mb)`` matches ``RECV_GRAD(s - 1, mb, s)``
before the backward of ``(s - 1, mb)``.
"""

from __future__ import annotations

from collections.abc import Sequence

from hp_mpmd.actions import Action, ActionKind, SchedulePlan
from hp_mpmd.check import Replay, match_of, posted_until, replay
from hp_mpmd.simulate import simulate

__all__ = [
    "dualpipev",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "looped_bfs",
    "one_f_one_b",
    "with_transfers",
    "zero_bubble_h1",
]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 - the schedule letter used by the paper
W = ActionKind.BACKWARD_WEIGHT


def _positive(name: str, value: object) -> int:
    """``value`` as an int, or a ValueError saying it must be a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def with_transfers(
    name: str,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    compute: Sequence[Sequence[Action]],
    *,
    resolve_deadlocks: bool = True,
) -> SchedulePlan:
    """Build a plan from per-rank compute orders by inserting every cross-rank transfer.

    Postconditions: each rank's actions are its compute actions in the given order; directly
    before a ``FORWARD(s, mb)`` whose stage ``s - 1`` runs on another rank sits
    ``RECV_ACT(s, mb, s - 1)``, directly after a ``FORWARD(s, mb)`` whose stage ``s + 1`` runs
    on another rank sits ``SEND_ACT(s, mb, s + 1)``; likewise ``RECV_GRAD(s, mb, s + 1)``
    before and ``SEND_GRAD(s, mb, s - 1)`` after each ``BACKWARD`` / ``BACKWARD_INPUT``.
    ``BACKWARD_WEIGHT`` moves nothing. Between two compute actions the sends come before the
    receives. With ``resolve_deadlocks`` (default), receives are then hoisted as described in
    the module docstring until the plan cannot deadlock. No other validation happens here: run
    :func:`hp_mpmd.check.check_plan`.
    """
    num_stages = len(stage_to_rank)
    ranks = tuple(stage_to_rank)
    per_rank: list[tuple[Action, ...]] = []
    for rank, order in enumerate(compute):
        out: list[Action] = []
        for act in order:
            s, mb = act.stage, act.microbatch
            prev_remote = s > 0 and ranks[s - 1] != rank
            next_remote = s < num_stages - 1 and ranks[s + 1] != rank
            if act.kind is F:
                if prev_remote:
                    out.append(Action(ActionKind.RECV_ACT, s, mb, s - 1))
                out.append(act)
                if next_remote:
                    out.append(Action(ActionKind.SEND_ACT, s, mb, s + 1))
            elif act.kind in (B, I):
                if next_remote:
                    out.append(Action(ActionKind.RECV_GRAD, s, mb, s + 1))
                out.append(act)
                if prev_remote:
                    out.append(Action(ActionKind.SEND_GRAD, s, mb, s - 1))
            else:
                out.append(act)
        per_rank.append(tuple(out))
    plan = SchedulePlan(
        name=name,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        stage_to_rank=ranks,
        actions=tuple(per_rank),
    )
    return _hoist_receives(plan) if resolve_deadlocks else _replace_actions(plan, per_rank)


def _hoist_receives(plan: SchedulePlan) -> SchedulePlan:
    """Move receives earlier until ``plan`` cannot deadlock; sort each batch sends-first.

    While the replay of :mod:`hp_mpmd.check` gets stuck, pick a blocked batch that waits for a
    *receive* its peer has not posted yet, and move that receive to the end of the batch the
    peer is blocked in (a receive has no local predecessor, so moving it earlier never breaks a
    dependency). Each move strictly advances one receive, so this terminates.

    Raises:
        AssertionError: a deadlock that no receive hoist can break (a builder bug).
    """
    plan = _replace_actions(plan, [list(a) for a in plan.actions])
    while True:
        result = replay(plan)
        if not result.stuck:
            return plan
        move = _hoistable(plan, result)
        if move is None:  # pragma: no cover - would be a builder bug
            raise AssertionError(f"{plan.name}: unresolvable deadlock at {result.stuck}")
        rank, old, new = move
        actions = [list(a) for a in plan.actions]
        actions[rank].insert(new, actions[rank].pop(old))
        plan = _replace_actions(plan, actions)


def _hoistable(plan: SchedulePlan, result: Replay) -> tuple[int, int, int] | None:
    """``(rank, from, to)`` for one receive to hoist into its rank's blocked batch, or None."""
    where = {a: (r, p) for r, acts in enumerate(plan.actions) for p, a in enumerate(acts)}
    for rank, head in result.stuck:
        for q in range(head, posted_until(plan, result, rank)):
            peer = match_of(plan.actions[rank][q])
            if peer.kind not in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
                continue
            peer_rank, peer_pos = where[peer]
            reached = posted_until(plan, result, peer_rank)
            if peer_pos >= reached:
                return peer_rank, peer_pos, reached
    return None


def _replace_actions(plan: SchedulePlan, actions: Sequence[Sequence[Action]]) -> SchedulePlan:
    """``plan`` with the given per-rank actions, each batch ordered sends first."""
    return SchedulePlan(
        name=plan.name,
        num_stages=plan.num_stages,
        num_microbatches=plan.num_microbatches,
        stage_to_rank=plan.stage_to_rank,
        actions=tuple(tuple(_sends_first(list(a))) for a in actions),
    )


def _sends_first(actions: list[Action]) -> list[Action]:
    """Within each run of consecutive comm actions, put sends before receives (stable)."""
    sends = (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)
    recvs = (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)
    out: list[Action] = []
    run: list[Action] = []
    for act in [*actions, None]:
        if act is not None and act.kind in (*sends, *recvs):
            run.append(act)
            continue
        out.extend(a for a in run if a.kind in sends)
        out.extend(a for a in run if a.kind in recvs)
        run = []
        if act is not None:
            out.append(act)
    return out


def gpipe(num_stages: int, num_microbatches: int) -> SchedulePlan:
    """GPipe: every forward, then every backward.

    Stage ``s`` runs on rank ``s``. Postconditions: rank ``r`` runs
    ``FORWARD(r, 0..m-1)`` then ``BACKWARD(r, 0..m-1)``, both in microbatch order, with the
    transfers of :func:`with_transfers`. Peak activations: ``m`` microbatches on every rank.
    Any ``num_stages >= 1`` and ``num_microbatches >= 1`` work.

    Raises:
        ValueError: a count that is not a positive integer.
    """
    p = _positive("num_stages", num_stages)
    m = _positive("num_microbatches", num_microbatches)
    compute = [
        [Action(F, r, mb) for mb in range(m)] + [Action(B, r, mb) for mb in range(m)]
        for r in range(p)
    ]
    return with_transfers("gpipe", m, range(p), compute)


def one_f_one_b(num_stages: int, num_microbatches: int) -> SchedulePlan:
    """1F1B (PipeDream-flush / Megatron's non-interleaved schedule).

    Stage ``s`` runs on rank ``s``. Postconditions: rank ``r`` runs ``w = min(p - 1 - r, m)``
    warm-up forwards, then ``m - w`` pairs ``FORWARD(r, w + i), BACKWARD(r, i)``, then the
    ``w`` remaining backwards; forwards and backwards each in microbatch order. At most
    ``min(p - r, m)`` microbatches are in flight (forward done, backward not) on rank ``r``.
    Any ``num_microbatches >= 1`` works (with ``m < p`` there is no steady phase).

    Raises:
        ValueError: a count that is not a positive integer.
    """
    p = _positive("num_stages", num_stages)
    m = _positive("num_microbatches", num_microbatches)
    compute: list[list[Action]] = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [Action(F, r, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            order += [Action(F, r, warmup + i), Action(B, r, i)]
        order += [Action(B, r, mb) for mb in range(m - warmup, m)]
        compute.append(order)
    return with_transfers("1f1b", m, range(p), compute)


def interleaved_1f1b(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> SchedulePlan:
    """Megatron's interleaved 1F1B: ``v = stages_per_rank`` virtual stages (model chunks) per rank.

    Stage ``s`` runs on rank ``s % p`` (rank ``r`` holds chunks ``r, r + p, ..., r + (v-1)p``).
    Microbatches go in groups of ``p``. Forward number ``k`` (``0 <= k < m v``) of a rank is
    chunk ``c = (k // p) % v`` of microbatch ``(k // (p v)) p + k % p``; backward number ``k``
    is the same microbatch of chunk ``v - 1 - c``. Postconditions: rank ``r`` runs
    ``w = min(2 (p - 1 - r) + (v - 1) p, m v)`` warm-up forwards, then ``m v - w`` pairs
    (forward ``w + i``, backward ``i``), then the remaining backwards. With ``v = 1`` this is
    Megatron's interleaved code path, whose warm-up is longer than :func:`one_f_one_b`'s.

    Raises:
        ValueError: a count that is not a positive integer, or ``num_microbatches`` not a
            multiple of ``num_ranks`` (each group of ``p`` microbatches cycles through the
            chunks together).
    """
    p = _positive("num_ranks", num_ranks)
    v = _positive("stages_per_rank", stages_per_rank)
    m = _positive("num_microbatches", num_microbatches)
    if m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"interleaved_1f1b needs num_microbatches to be a multiple of num_ranks: got "
            f"{m} microbatches for {p} ranks; use {hint}"
        )
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    compute: list[list[Action]] = []
    for r in range(p):
        warmup = min(2 * (p - 1 - r) + (v - 1) * p, total)
        order: list[Action] = []

        def fwd(k: int, r: int = r, order: list[Action] = order) -> None:
            c, mb = unit(k, backward=False)
            order.append(Action(F, c * p + r, mb))

        def bwd(k: int, r: int = r, order: list[Action] = order) -> None:
            c, mb = unit(k, backward=True)
            order.append(Action(B, c * p + r, mb))

        for k in range(warmup):
            fwd(k)
        for i in range(total - warmup):
            fwd(warmup + i)
            bwd(i)
        for k in range(total - warmup, total):
            bwd(k)
        compute.append(order)
    stage_to_rank = [s % p for s in range(p * v)]
    return with_transfers("interleaved_1f1b", m, stage_to_rank, compute)


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> SchedulePlan:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with a split backward.

    Stage ``s`` runs on rank ``s``. Each backward is split into ``BACKWARD_INPUT`` (``I``: the
    gradient the previous stage waits for; what ``SEND_GRAD`` carries) and
    ``BACKWARD_WEIGHT`` (``W``), and rank ``r`` defers ``r`` weight passes to the end, where
    1F1B would leave rank ``r`` idle. Postconditions: rank ``r`` runs, with
    ``m = num_microbatches``, forwards, input passes and weight passes each in microbatch
    order, as

    1. ``min(p - 1 - r, m)`` warm-up forwards (as 1F1B);
    2. up to ``r`` pairs ``F, I`` (weight passes deferred);
    3. triples ``F, I, W`` until every forward ran;
    4. pairs ``I, W`` until every input pass ran;
    5. the deferred weight passes.

    Every weight pass follows its input pass; at most ``min(p, m)`` microbatches are in flight
    (forward done, weight pass not) on any rank, 1F1B's peak (its rank 0 holds ``p``). With
    unit costs (F = I = W) the bubble is ``(p - 1) / (3 m + p - 1)`` against 1F1B's
    ``(p - 1) / (m + p - 1)`` (F = 1, B = 2) once ``m >= p``. Any ``num_microbatches >= 1``
    works.

    Raises:
        ValueError: a count that is not a positive integer.
    """
    p = _positive("num_stages", num_stages)
    m = _positive("num_microbatches", num_microbatches)
    compute: list[list[Action]] = []
    for r in range(p):
        order: list[Action] = []
        nf = nb = nw = 0
        for _ in range(min(p - 1 - r, m)):
            order.append(Action(F, r, nf))
            nf += 1
        for _ in range(r):
            if nf == m:
                break
            order += [Action(F, r, nf), Action(I, r, nb)]
            nf, nb = nf + 1, nb + 1
        while nf < m:
            order += [Action(F, r, nf), Action(I, r, nb), Action(W, r, nw)]
            nf, nb, nw = nf + 1, nb + 1, nw + 1
        while nb < m:
            order += [Action(I, r, nb), Action(W, r, nw)]
            nb, nw = nb + 1, nw + 1
        order += [Action(W, r, mb) for mb in range(nw, m)]
        compute.append(order)
    return with_transfers("zb_h1", m, range(p), compute)


class _DualPipeVOrder:
    """One rank's compute order of :func:`dualpipev`, built phase by phase.

    Chunk 0 of rank ``r`` is stage ``r`` (the V's way out), chunk 1 stage ``2p - 1 - r`` (its
    way back). Each of the four passes (forward / backward of either chunk) takes its
    microbatches in order; deferred weight passes leave in the order their input passes ran.
    """

    def __init__(self, p: int, r: int) -> None:
        self.stage = (r, 2 * p - 1 - r)
        self.forwards = [0, 0]
        self.backwards = [0, 0]
        self.deferred: list[tuple[int, int]] = []
        self.units: list[list[Action]] = []

    @property
    def order(self) -> list[Action]:
        """The compute actions in order."""
        return [a for unit in self.units for a in unit]

    def pair(self) -> None:
        """Run the last two actions as one unit (DualPipe's overlapped forward-backward
        pair): the receives of both before it, the sends of both after it."""
        second = self.units.pop()
        self.units[-1].extend(second)

    def forward(self, chunk: int) -> None:
        self.units.append([Action(F, self.stage[chunk], self.forwards[chunk])])
        self.forwards[chunk] += 1

    def backward(self, chunk: int, split: bool = False) -> None:
        """A full backward, or (``split``) an input pass whose weight pass is deferred."""
        s, mb = self.stage[chunk], self.backwards[chunk]
        self.backwards[chunk] += 1
        if split:
            self.units.append([Action(I, s, mb)])
            self.deferred.append((s, mb))
        else:
            self.units.append([Action(B, s, mb)])

    def weight(self) -> None:
        s, mb = self.deferred.pop(0)
        self.units.append([Action(W, s, mb)])


def _dualpipev_units(p: int, m: int, r: int) -> list[list[Action]]:
    """Rank ``r``'s compute units of :func:`dualpipev` (its phases 1 to 8, in order)."""
    o = _DualPipeVOrder(p, r)
    for _ in range(2 * (p - 1 - r)):
        o.forward(0)
    for _ in range(r + 1):
        o.forward(0)
        o.forward(1)
    for _ in range(p - 1 - r):
        o.backward(1, split=True)
        o.weight()
        o.forward(1)
    for _ in range(m - 2 * p + r + 1):
        o.forward(0)
        o.backward(1)
        o.pair()
        o.forward(1)
        o.backward(0)
        o.pair()
    for _ in range(p - 1 - r):
        o.backward(1)
        o.forward(1)
        o.backward(0)
        o.pair()
    middle = (r + 1) // 2
    for i in range(r + 1):
        # From the middle of this phase on, input passes defer their weight passes (the odd
        # ranks one backward earlier), filling the drain's wait for gradients.
        o.backward(1, split=i > middle or (i == middle and r % 2 == 1))
        o.backward(0, split=i >= middle)
    for _ in range(p - 1 - r):
        o.weight()
        o.backward(0, split=True)
    while o.deferred:
        o.weight()
    return o.units


def dualpipev(num_ranks: int, num_microbatches: int) -> SchedulePlan:
    """DualPipeV (DeepSeek's "cut-in-half" DualPipe; torch's ``ScheduleDualPipeV``).

    ``2p`` stages on ``p = num_ranks`` ranks in a V: stage ``s`` runs on rank ``s`` for
    ``s < p`` and on rank ``2p - 1 - s`` after, so rank 0 holds the first and the last stage
    and rank ``p - 1`` the two middle ones (their hand-over stays on the rank). With
    ``m = num_microbatches``, rank ``r`` runs (``F0``/``F1``: forward of its way-out / way-back
    stage, ``B``: full backward, ``I``: input pass whose weight pass ``W`` is deferred,
    ``W``: the oldest deferred weight pass):

    1. ``2 (p - 1 - r)`` times ``F0``;
    2. ``r + 1`` times ``F0, F1``;
    3. ``p - 1 - r`` times ``I1, W, F1`` (zero bubble: the weight pass fills the wait);
    4. ``m - 2p + r + 1`` times ``F0, B1, F1, B0`` (the steady phase; DualPipe overlaps each
       forward with the other chunk's backward: the pairs ``F0 B1`` and ``F1 B0``);
    5. ``p - 1 - r`` times ``B1``, then the pair ``F1, B0``;
    6. ``r + 1`` times ``B1, B0``, the input passes from the middle on split (their weight
       passes deferred);
    7. ``p - 1 - r`` times ``W, I0``;
    8. the ``r + 1`` deferred weight passes left.

    Postconditions: every ``(stage, microbatch)`` has one forward and either one ``B`` or one
    ``I`` followed later by its ``W``; each of a rank's four passes takes microbatches in
    order; the plan passes :func:`hp_mpmd.check.check_plan`. Activations alive at once (forward
    done, backward or weight pass not) on rank ``r``: at most ``2p + 1`` (property-tested; the
    DualPipe report's ``2 x PP + 1`` chunks), against interleaved 1F1B's ``2 (p - 1 - r) + p + 1``
    at two stages per rank.

    Communication: either :func:`with_transfers`' placement, or DualPipe's, where each pair
    posts the receives of both its actions before it and their sends after it; both are made
    deadlock-free by hoisting receives, whose waits then sit on the critical path. The plan is
    the one with the shorter simulated makespan at unit costs (:func:`hp_mpmd.simulate.simulate`
    eager, F = I = W = 1, B = 2): bubble 4.0 % at p = 2, m = 4 (interleaved 1F1B at v = 2:
    11.1 %), 6.8 % at p = 4, m = 16 (interleaved 8.6 %, 1F1B 15.8 %, ZB-H1 5.9 %); the compute
    order alone, with receives never hoisted, would reach 3.0 % there.

    Raises:
        ValueError: a count that is not a positive integer, or ``num_microbatches < 2 x
            num_ranks`` (the warm-up alone runs ``2p - 1`` way-out forwards on rank 0).
    """
    p = _positive("num_ranks", num_ranks)
    m = _positive("num_microbatches", num_microbatches)
    if m < 2 * p:
        raise ValueError(
            f"dualpipev needs num_microbatches >= 2 x num_ranks: got {m} microbatches for "
            f"{p} ranks; use at least {2 * p}"
        )
    units = [_dualpipev_units(p, m, r) for r in range(p)]
    stage_to_rank = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    paired = _unit_transfers("dualpipev", m, stage_to_rank, units)
    single = with_transfers(
        "dualpipev", m, stage_to_rank, [[a for unit in u for a in unit] for u in units]
    )
    # Both placements are deadlock-free under rendezvous; the receives hoisted to get there
    # cost waits on the critical path, fewer with the paired placement from p = 3 on (e.g.
    # p = 4, m = 16: 6.8 % against 47 % bubble) and more at p = 2 (m = 8: 4.0 % against 2.0 %).
    return min((paired, single), key=lambda plan: simulate(plan).makespan)


def _unit_transfers(
    name: str,
    num_microbatches: int,
    stage_to_rank: Sequence[int],
    units: Sequence[Sequence[Sequence[Action]]],
) -> SchedulePlan:
    """:func:`with_transfers` over units of compute actions run back to back: every receive
    a unit's actions need sits right before the unit, every send they produce right after it
    (so one batch pairs a unit's sends with the next unit's receives, as DualPipe posts
    them); receives hoisted as in :func:`with_transfers` where that would deadlock."""
    plain = with_transfers(
        name,
        num_microbatches,
        stage_to_rank,
        [[a for unit in rank_units for a in unit] for rank_units in units],
        resolve_deadlocks=False,
    )
    per_rank: list[list[Action]] = []
    for rank, rank_units in enumerate(units):
        own = _transfers_by_compute(plain.actions[rank])
        out: list[Action] = []
        for unit in rank_units:
            out += [c for a in unit for c in own[a][0]]
            out += list(unit)
            out += [c for a in unit for c in own[a][1]]
        per_rank.append(out)
    return _hoist_receives(_replace_actions(plain, per_rank))


def _transfers_by_compute(
    actions: Sequence[Action],
) -> dict[Action, tuple[list[Action], list[Action]]]:
    """For each compute action of a :func:`with_transfers` list (no hoisting), the receives
    right before it and the sends right after it."""
    out: dict[Action, tuple[list[Action], list[Action]]] = {}
    pending: list[Action] = []
    last: Action | None = None
    for a in actions:
        if a.kind in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD):
            pending.append(a)
        elif a.kind in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD):
            assert last is not None
            out[last][1].append(a)
        else:
            out[a] = (pending, [])
            pending, last = [], a
    return out


def looped_bfs(num_ranks: int, stages_per_rank: int, num_microbatches: int) -> SchedulePlan:
    """Breadth-first looping (Lamy-Poirier 2022, torch's ``ScheduleLoopedBFS``).

    Stage ``s`` runs on rank ``s % p``. Postconditions: rank ``r`` runs, for each of its
    stages in ascending order, ``FORWARD`` of microbatches ``0..m-1``; then, for each of its
    stages in descending order, ``BACKWARD`` of microbatches ``m-1..0`` (the reverse order of
    the forwards, so the last microbatch's backward starts first). Peak activations: ``m``
    microbatches per local stage. Any counts work.

    Raises:
        ValueError: a count that is not a positive integer.
    """
    p = _positive("num_ranks", num_ranks)
    v = _positive("stages_per_rank", stages_per_rank)
    m = _positive("num_microbatches", num_microbatches)
    compute: list[list[Action]] = []
    for r in range(p):
        local = [c * p + r for c in range(v)]
        order = [Action(F, s, mb) for s in local for mb in range(m)]
        order += [Action(B, s, mb) for s in reversed(local) for mb in reversed(range(m))]
        compute.append(order)
    return with_transfers("looped_bfs", m, [s % p for s in range(p * v)], compute)


def forward_only(plan: SchedulePlan) -> SchedulePlan:
    """The forward half of ``plan``: the same stages, ranks and microbatches, each rank running
    its stages' forwards ordered by (microbatch, stage) with their activation transfers, and no
    backward (evaluation; torch pipelining's ``eval()``). That order follows the data: a
    forward only waits for the same microbatch's previous stage, which every rank runs
    earlier in this order, so no rank waits on a later action of another.

    The result is not a training plan (:func:`hp_mpmd.check.check_plan` wants backwards): run
    it with ``PipelineSchedule(..., forward_only=True)``.
    """
    compute = [
        sorted(
            (Action(F, s, mb) for s in plan.stages_of(r) for mb in range(plan.num_microbatches)),
            key=lambda a: (a.microbatch, a.stage),
        )
        for r in range(plan.num_ranks)
    ]
    return with_transfers(
        f"{plan.name}_forward_only", plan.num_microbatches, plan.stage_to_rank, compute
    )

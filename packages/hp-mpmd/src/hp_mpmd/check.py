"""Validate any :class:`SchedulePlan`: structure, dependencies, communication, deadlock freedom.

Execution model (shared with :mod:`hp_mpmd.simulate` through :func:`replay`): each rank runs
its actions in order. A compute action never blocks (its inputs were received or produced
earlier on the same rank: the dependency check proves that). A maximal run of consecutive
communication actions of one rank is one *batch* (one ``batch_isend_irecv``): the rank
*reaches* (posts) it when all earlier actions are done, and the batch *completes* once, for
every action in it, the rank holding the matching peer action has reached the batch that
contains it (posted, or already completed). This is rendezvous semantics: no send is assumed
to be buffered, so a plan that passes is safe on backends that block sends until the
receive is posted. A plan deadlocks when some rank cannot complete a batch and no rank can
make progress; since positions only grow, whether that happens does not depend on timing.

Matching: ``SEND_ACT(s, mb, s + 1)`` <-> ``RECV_ACT(s + 1, mb, s)`` and
``SEND_GRAD(s, mb, s - 1)`` <-> ``RECV_GRAD(s - 1, mb, s)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hp_mpmd.actions import COMM_KINDS, COMPUTE_KINDS, Action, ActionKind, SchedulePlan

__all__ = [
    "PlanCheckError",
    "Replay",
    "batch_heads",
    "check_plan",
    "match_of",
    "posted_until",
    "replay",
]

F = ActionKind.FORWARD
B = ActionKind.BACKWARD
I = ActionKind.BACKWARD_INPUT  # noqa: E741 - the schedule letter used by the paper
W = ActionKind.BACKWARD_WEIGHT
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD

# The stage a comm action's peer must be, relative to its own stage.
_PEER_OFFSET = {SEND_ACT: 1, RECV_ACT: -1, SEND_GRAD: -1, RECV_GRAD: 1}
_SENDS = frozenset({SEND_ACT, SEND_GRAD})
_PARTNER = {SEND_ACT: RECV_ACT, RECV_ACT: SEND_ACT, SEND_GRAD: RECV_GRAD, RECV_GRAD: SEND_GRAD}


class PlanCheckError(ValueError):
    """A plan that cannot run as written.

    Attributes:
        rank: the offending rank, when one is to blame.
        position: the index in that rank's action list, when an action is to blame.
        action: the offending (or missing) action.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        position: int | None = None,
        action: Action | None = None,
    ) -> None:
        where = ""
        if rank is not None:
            where = f"rank {rank}" + (f", position {position}" if position is not None else "")
            where += ": "
        super().__init__(where + message)
        self.rank = rank
        self.position = position
        self.action = action


def match_of(action: Action) -> Action:
    """The peer action a communication action pairs with (see the module docstring).

    Raises:
        ValueError: ``action`` is not a communication action or has no peer stage.
    """
    if action.kind not in COMM_KINDS or action.peer_stage is None:
        raise ValueError(f"{action} is not a communication action with a peer stage")
    return Action(_PARTNER[action.kind], action.peer_stage, action.microbatch, action.stage)


def check_plan(plan: SchedulePlan) -> None:
    """Raise :class:`PlanCheckError` unless ``plan`` can run correctly to completion.

    Checks, in this order (the first failure is reported, naming rank, position and action):

    1. shape: positive counts, ``len(stage_to_rank) == num_stages``, ranks in range;
    2. each action: stage and microbatch in range, on its stage's rank, compute actions with no
       peer, comm actions with the adjacent peer stage (``+1`` for ``SEND_ACT`` /
       ``RECV_GRAD``, ``-1`` for ``RECV_ACT`` / ``SEND_GRAD``) on *another* rank, no action
       twice;
    3. completeness: each ``(stage, microbatch)`` has one ``FORWARD`` and either one
       ``BACKWARD`` or one ``BACKWARD_INPUT`` plus one ``BACKWARD_WEIGHT`` (never both styles),
       and every transfer between stages on different ranks is present on both sides (so every
       send is matched by exactly one receive);
    4. order on each rank: a forward after its input (previous stage's forward on this rank,
       or the ``RECV_ACT``); a backward / input pass after its own forward and after its output
       gradient (next stage's backward / input pass on this rank, or the ``RECV_GRAD``); a
       weight pass after its input pass; a send after the compute that produces it;
    5. deadlock freedom under the batch semantics of the module docstring.
    """
    _check_shape(plan)
    index = _check_actions(plan)
    _check_complete(plan, index)
    _check_order(plan, index)
    result = replay(plan)
    if result.stuck:
        raise _deadlock_error(plan, result)


def _check_shape(plan: SchedulePlan) -> None:
    if plan.num_ranks < 1:
        raise PlanCheckError(f"plan {plan.name!r} has no ranks")
    if plan.num_stages < 1 or plan.num_microbatches < 1:
        raise PlanCheckError(
            f"plan {plan.name!r} needs positive stage and microbatch counts, got "
            f"num_stages={plan.num_stages}, num_microbatches={plan.num_microbatches}"
        )
    if len(plan.stage_to_rank) != plan.num_stages:
        raise PlanCheckError(
            f"plan {plan.name!r}: stage_to_rank has {len(plan.stage_to_rank)} entries for "
            f"{plan.num_stages} stages"
        )
    for s, r in enumerate(plan.stage_to_rank):
        if not 0 <= r < plan.num_ranks:
            raise PlanCheckError(
                f"plan {plan.name!r}: stage {s} is placed on rank {r}, but the plan has "
                f"{plan.num_ranks} ranks (0..{plan.num_ranks - 1})"
            )


def _check_actions(plan: SchedulePlan) -> dict[Action, tuple[int, int]]:
    """Validate each action on its own; return where each action sits (rank, position)."""
    index: dict[Action, tuple[int, int]] = {}
    where = plan.stage_to_rank
    for rank, actions in enumerate(plan.actions):
        for pos, act in enumerate(actions):

            def fail(msg: str, rank: int = rank, pos: int = pos, act: Action = act) -> None:
                raise PlanCheckError(f"{act}: {msg}", rank=rank, position=pos, action=act)

            if not 0 <= act.stage < plan.num_stages:
                fail(f"stage {act.stage} does not exist (stages 0..{plan.num_stages - 1})")
            if not 0 <= act.microbatch < plan.num_microbatches:
                fail(
                    f"microbatch {act.microbatch} does not exist "
                    f"(microbatches 0..{plan.num_microbatches - 1})"
                )
            if where[act.stage] != rank:
                fail(f"stage {act.stage} runs on rank {where[act.stage]}, not on rank {rank}")
            if act.kind in COMPUTE_KINDS and act.peer_stage is not None:
                fail("a compute action has no peer stage")
            if act.kind in COMM_KINDS:
                want = act.stage + _PEER_OFFSET[act.kind]
                if act.peer_stage != want:
                    fail(f"the peer of a {act.kind.name} of stage {act.stage} is stage {want}")
                if not 0 <= want < plan.num_stages:
                    fail(f"stage {act.stage} has no stage {want} to communicate with")
                if where[want] == rank:
                    fail(
                        f"stages {act.stage} and {want} both run on rank {rank}; stages on "
                        "the same rank hand tensors over without communication actions"
                    )
            if act in index:
                fail(f"appears twice (first at position {index[act][1]})")
            index[act] = (rank, pos)
    return index


def _check_complete(plan: SchedulePlan, index: dict[Action, tuple[int, int]]) -> None:
    where = plan.stage_to_rank

    def need(act: Action) -> None:
        if act not in index:
            raise PlanCheckError(
                f"{act} is missing (stage {act.stage} runs here)",
                rank=where[act.stage],
                action=act,
            )

    last = plan.num_stages - 1
    for s in range(plan.num_stages):
        for mb in range(plan.num_microbatches):
            need(Action(F, s, mb))
            full, split_i, split_w = (Action(k, s, mb) for k in (B, I, W))
            if full in index and (split_i in index or split_w in index):
                other = split_i if split_i in index else split_w
                rank, pos = index[other]
                raise PlanCheckError(
                    f"{other}: stage {s} microbatch {mb} already has a full backward {full} "
                    f"(position {index[full][1]}); use either B or I + W",
                    rank=rank,
                    position=pos,
                    action=other,
                )
            if full not in index:
                if split_i not in index and split_w not in index:
                    need(full)
                need(split_i)
                need(split_w)
            if s < last and where[s + 1] != where[s]:
                need(Action(SEND_ACT, s, mb, s + 1))
                need(Action(RECV_ACT, s + 1, mb, s))
                need(Action(SEND_GRAD, s + 1, mb, s))
                need(Action(RECV_GRAD, s, mb, s + 1))


def _check_order(plan: SchedulePlan, index: dict[Action, tuple[int, int]]) -> None:
    where = plan.stage_to_rank
    last = plan.num_stages - 1

    def backward_of(s: int, mb: int) -> Action:
        full = Action(B, s, mb)
        return full if full in index else Action(I, s, mb)

    for rank, actions in enumerate(plan.actions):
        for pos, act in enumerate(actions):
            s, mb = act.stage, act.microbatch
            before: list[tuple[Action, str]] = []
            if act.kind is F and s > 0:
                src = (
                    Action(F, s - 1, mb) if where[s - 1] == rank else Action(RECV_ACT, s, mb, s - 1)
                )
                before.append((src, "its input"))
            elif act.kind in (B, I):
                before.append((Action(F, s, mb), "its own forward"))
                if s < last:
                    src = (
                        backward_of(s + 1, mb)
                        if where[s + 1] == rank
                        else Action(RECV_GRAD, s, mb, s + 1)
                    )
                    before.append((src, "its output gradient"))
            elif act.kind is W:
                before.append((Action(I, s, mb), "its input-gradient pass"))
            elif act.kind is SEND_ACT:
                before.append((Action(F, s, mb), "the forward that produces it"))
            elif act.kind is SEND_GRAD:
                before.append((backward_of(s, mb), "the backward that produces it"))
            for dep, what in before:
                dep_pos = index[dep][1]
                if dep_pos > pos:
                    raise PlanCheckError(
                        f"{act} runs before {what} {dep} (position {dep_pos})",
                        rank=rank,
                        position=pos,
                        action=act,
                    )


@dataclass(frozen=True)
class Replay:
    """The outcome of :func:`replay`.

    Attributes:
        start: per rank, per position, when the action started (a batch's comm actions: when
            the batch was posted); ``nan`` for actions never reached.
        end: per rank, per position, when it finished; ``nan`` if it never did.
        stuck: ``(rank, position)`` of the first action of each batch some rank is blocked in;
            empty when every rank finished.
    """

    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    stuck: tuple[tuple[int, int], ...]


def batch_heads(actions: tuple[Action, ...]) -> list[int]:
    """For each position, the position where its comm batch starts (itself for compute).

    A batch is a maximal run of consecutive communication actions.
    """
    head: list[int] = []
    for pos, act in enumerate(actions):
        if act.kind in COMM_KINDS and pos > 0 and actions[pos - 1].kind in COMM_KINDS:
            head.append(head[-1])
        else:
            head.append(pos)
    return head


def replay(
    plan: SchedulePlan,
    duration: Callable[[Action], float] = lambda _action: 0.0,
    comm: float = 0.0,
    *,
    eager_sends: bool = False,
) -> Replay:
    """Run ``plan`` under the execution model of the module docstring and time it.

    Compute actions take ``duration(action)``; a matched send/receive pair completes ``comm``
    after the later of the two batches was posted, and a batch completes with its last pair.
    With ``eager_sends`` a send completes when posted and a receive ``comm`` after its send's
    batch was posted (a timing model only: deadlock freedom is judged without it).
    Preconditions: checks 1-4 of :func:`check_plan` passed (every comm action has its match).
    Postconditions: ``stuck`` is empty iff every rank ran every action; the result does not
    depend on the order in which ranks are advanced.
    """
    heads = [batch_heads(actions) for actions in plan.actions]
    where: dict[Action, tuple[int, int]] = {
        act: (rank, pos)
        for rank, actions in enumerate(plan.actions)
        for pos, act in enumerate(actions)
    }
    nan = float("nan")
    start = [[nan] * len(a) for a in plan.actions]
    end = [[nan] * len(a) for a in plan.actions]
    posted: dict[tuple[int, int], float] = {}
    pos = [0] * plan.num_ranks
    clock = [0.0] * plan.num_ranks
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(plan.actions):
            while pos[rank] < len(actions):
                p = pos[rank]
                act = actions[p]
                if act.kind in COMPUTE_KINDS:
                    start[rank][p] = clock[rank]
                    clock[rank] += duration(act)
                    end[rank][p] = clock[rank]
                    pos[rank] += 1
                    progress = True
                    continue
                if (rank, p) not in posted:
                    posted[rank, p] = clock[rank]
                    progress = True
                stop = p
                while stop < len(actions) and heads[rank][stop] == p:
                    stop += 1
                done = clock[rank]
                for q in range(p, stop):
                    if eager_sends and actions[q].kind in _SENDS:
                        continue
                    peer_rank, peer_pos = where[match_of(actions[q])]
                    peer_posted = posted.get((peer_rank, heads[peer_rank][peer_pos]))
                    if peer_posted is None:
                        break
                    if eager_sends:  # a receive: the data left when the send was posted
                        done = max(done, peer_posted + comm)
                    else:
                        done = max(done, max(clock[rank], peer_posted) + comm)
                else:
                    for q in range(p, stop):
                        start[rank][q], end[rank][q] = clock[rank], done
                    clock[rank] = done
                    pos[rank] = stop
                    progress = True
                    continue
                break
    stuck = tuple(
        (rank, pos[rank]) for rank in range(plan.num_ranks) if pos[rank] < len(plan.actions[rank])
    )
    return Replay(
        start=tuple(tuple(r) for r in start), end=tuple(tuple(r) for r in end), stuck=stuck
    )


def _deadlock_error(plan: SchedulePlan, result: Replay) -> PlanCheckError:
    """Describe every blocked batch and which peer actions it waits for."""
    where = {
        act: (rank, pos)
        for rank, actions in enumerate(plan.actions)
        for pos, act in enumerate(actions)
    }
    lines: list[str] = []
    for rank, head in result.stuck:
        actions = plan.actions[rank]
        heads = batch_heads(actions)
        batch = [a for q, a in enumerate(actions) if heads[q] == head]
        waits = []
        for act in batch:
            peer = match_of(act)
            peer_rank, peer_pos = where[peer]
            if peer_pos >= posted_until(plan, result, peer_rank):
                waits.append(f"{peer} (rank {peer_rank}, position {peer_pos})")
        lines.append(
            f"rank {rank}, position {head}: batch [{', '.join(map(str, batch))}] waits for "
            + (", ".join(waits) if waits else "nothing (peers are blocked with it)")
        )
    first_rank, first_pos = result.stuck[0]
    first = plan.actions[first_rank][first_pos]
    return PlanCheckError(
        f"{first}: deadlock, no rank can make progress:\n  " + "\n  ".join(lines),
        rank=first_rank,
        position=first_pos,
        action=first,
    )


def posted_until(plan: SchedulePlan, result: Replay, rank: int) -> int:
    """How far ``rank`` got in ``result``: its first position not posted or run.

    For a blocked rank that is the end of the batch it is blocked in (that batch is posted);
    for a rank that finished, the length of its action list.
    """
    for stuck_rank, head in result.stuck:
        if stuck_rank == rank:
            heads = batch_heads(plan.actions[rank])
            stop = head
            while stop < len(heads) and heads[stop] == head:
                stop += 1
            return stop
    return len(plan.actions[rank])

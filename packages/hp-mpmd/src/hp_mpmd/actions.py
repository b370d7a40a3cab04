"""The vocabulary of pipeline schedules: actions, and a plan as one action list per rank.

A schedule is pure data. Builders (:mod:`hp_mpmd.schedules`) produce a :class:`SchedulePlan`;
the checker (:mod:`hp_mpmd.check`) validates any plan and the simulator
(:mod:`hp_mpmd.simulate`) replays it; the runtime (:mod:`hp_mpmd.runtime`) executes it. Stages
are *virtual* stages (an interleaved schedule runs several per rank); ``stage_to_rank`` places
them.

Communication is explicit: a forward's output reaches the next stage by a ``SEND_ACT`` on the
producer's rank matched by a ``RECV_ACT`` on the consumer's; gradients travel back by
``SEND_GRAD`` / ``RECV_GRAD``. Stages on the same rank hand tensors over without actions.
Consecutive communication actions of one rank form one batch (one ``batch_isend_irecv``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "Action", "ActionKind", "SchedulePlan"]


class ActionKind(Enum):
    """What an action does.

    Attributes:
        FORWARD: run the stage's forward on one microbatch.
        BACKWARD: the full backward of one microbatch (input and weight gradients).
        BACKWARD_INPUT: only the input gradient (zero-bubble schedules), which the previous
            stage waits for.
        BACKWARD_WEIGHT: the weight gradient of a microbatch whose input gradient is done.
        SEND_ACT: send the forward output of ``(stage, microbatch)`` to ``peer_stage``.
        RECV_ACT: receive the forward input of ``(stage, microbatch)`` from ``peer_stage``.
        SEND_GRAD: send the input gradient of ``(stage, microbatch)`` to ``peer_stage``.
        RECV_GRAD: receive the output gradient of ``(stage, microbatch)`` from ``peer_stage``.
    """

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "SEND_F"
    RECV_ACT = "RECV_F"
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"


COMPUTE_KINDS = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
    }
)
COMM_KINDS = frozenset(
    {ActionKind.SEND_ACT, ActionKind.RECV_ACT, ActionKind.SEND_GRAD, ActionKind.RECV_GRAD}
)


@dataclass(frozen=True)
class Action:
    """One step of one rank.

    Attributes:
        kind: what it does.
        stage: the (virtual) stage it belongs to.
        microbatch: the microbatch index.
        peer_stage: for communication, the stage on the other side; None for compute.
    """

    kind: ActionKind
    stage: int
    microbatch: int
    peer_stage: int | None = None

    def __str__(self) -> str:
        peer = "" if self.peer_stage is None else f"->{self.peer_stage}"
        return f"{self.kind.value}{self.stage}.{self.microbatch}{peer}"


@dataclass(frozen=True)
class SchedulePlan:
    """A whole schedule: every rank's actions, in order.

    Attributes:
        name: the schedule's name (for messages and timelines).
        num_stages: virtual stages (``num_ranks x stages per rank``).
        num_microbatches: microbatches per step.
        stage_to_rank: the rank running each stage.
        actions: per rank, its actions in execution order.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks."""
        return len(self.actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, ascending."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

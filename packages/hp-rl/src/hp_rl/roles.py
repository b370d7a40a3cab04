"""Which ranks train and which roll out, and the grids of both layouts.

Pure: :func:`plan_roles` turns the job's size and the two layouts' degrees into a frozen
:class:`JobRoles`; nothing here touches a process group.

* colocated: every rank trains and rolls out (the training state waits while the engine
  generates); the rollout groups are the training ranks regrouped;
* disaggregated: the first ``world - rollout_ranks`` ranks train, the last ``rollout_ranks``
  roll out.

The training grid is hp-train's ``(dp_replicate, dp_shard, tp)``, ``tp`` innermost; the rollout
grid is ``(rollout, tp)``: ``rollout`` engine replicas of ``rollout_tp`` ranks each, ``tp``
innermost (neighbouring ranks, the fastest links).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hp_layout import Mesh

__all__ = ["PLACEMENTS", "JobRoles", "RolesError", "plan_roles"]

Placement = Literal["colocated", "disaggregated"]
#: Where the rollout engine runs.
PLACEMENTS: tuple[str, ...] = ("colocated", "disaggregated")

#: The rollout grid's axes: engine replicas, then tensor parallelism inside one.
ROLLOUT_AXES = ("rollout", "tp")
#: The training grid's axes (hp-train's).
TRAINING_AXES = ("dp_replicate", "dp_shard", "tp")


class RolesError(ValueError):
    """The job's ranks cannot be split as asked."""


@dataclass(frozen=True)
class JobRoles:
    """The job's ranks by role.

    Attributes:
        world: ranks in the job.
        placement: ``"colocated"`` or ``"disaggregated"``.
        training_ranks: the ranks that train, in grid order.
        rollout_ranks: the ranks that roll out, in grid order.
        dp_replicate, dp_shard, tp: the training layout's degrees.
        rollout_tp: ranks per rollout engine replica.
    """

    world: int
    placement: str
    training_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    dp_replicate: int
    dp_shard: int
    tp: int
    rollout_tp: int

    @property
    def dp(self) -> int:
        """Data-parallel training ranks (each trains on its own slice of the batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def rollout_groups(self) -> int:
        """Rollout engine replicas (each generates its own slice of the prompts)."""
        return len(self.rollout_ranks) // self.rollout_tp

    def training_grid(self) -> Mesh:
        """The training ranks as hp-train's ``(dp_replicate, dp_shard, tp)`` grid."""
        return Mesh((self.dp_replicate, self.dp_shard, self.tp), TRAINING_AXES, self.training_ranks)

    def rollout_grid(self) -> Mesh:
        """The rollout ranks as the ``(rollout, tp)`` grid."""
        return Mesh((self.rollout_groups, self.rollout_tp), ROLLOUT_AXES, self.rollout_ranks)

    def trains(self, rank: int) -> bool:
        """Whether ``rank`` trains."""
        return rank in self.training_ranks

    def rolls_out(self, rank: int) -> bool:
        """Whether ``rank`` rolls out."""
        return rank in self.rollout_ranks

    def rollout_group(self, rank: int) -> int:
        """The engine replica ``rank`` belongs to."""
        return self.rollout_ranks.index(rank) // self.rollout_tp

    def rollout_tp_rank(self, rank: int) -> int:
        """``rank``'s tensor-parallel index inside its rollout replica (0: the one that speaks
        for the replica, whose ranks all hold the same rollouts)."""
        return self.rollout_ranks.index(rank) % self.rollout_tp

    def training_tp_rank(self, rank: int) -> int:
        """``rank``'s tensor-parallel index inside its data-parallel rank (0: the one that
        speaks for it)."""
        return self.training_ranks.index(rank) % self.tp

    def training_dp_rank(self, rank: int) -> int:
        """``rank``'s data-parallel index (which slice of the batch it trains on)."""
        return self.training_ranks.index(rank) // self.tp


def plan_roles(
    world: int,
    *,
    placement: str = "colocated",
    dp_replicate: int = 1,
    dp_shard: int = -1,
    tp: int = 1,
    rollout_tp: int = 1,
    rollout_ranks: int = 0,
) -> JobRoles:
    """Split ``world`` ranks into training and rollout roles (module docstring).

    ``dp_shard=-1``: every training rank not taken by ``dp_replicate x tp``.
    ``rollout_ranks``: with ``"disaggregated"``, how many ranks roll out (the last ones);
    ignored (must be 0) when colocated.

    Raises:
        RolesError: degrees that do not divide the ranks, a placement that does not exist,
            or a disaggregated job without training or rollout ranks.
    """
    if placement not in PLACEMENTS:
        raise RolesError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    for name, value in (
        ("world", world),
        ("dp_replicate", dp_replicate),
        ("tp", tp),
        ("rollout_tp", rollout_tp),
    ):
        if value < 1:
            raise RolesError(f"{name} must be a positive integer, got {value}")
    if placement == "colocated":
        if rollout_ranks not in (0, world):
            raise RolesError(
                f"a colocated job rolls out on all {world} ranks; rollout_ranks={rollout_ranks} "
                "asks for a split: use placement 'disaggregated'"
            )
        training = rollout = tuple(range(world))
    else:
        if not 0 < rollout_ranks < world:
            raise RolesError(
                f"a disaggregated job of {world} ranks needs 1..{world - 1} rollout ranks (the "
                f"rest train), got rollout_ranks={rollout_ranks}"
            )
        training = tuple(range(world - rollout_ranks))
        rollout = tuple(range(world - rollout_ranks, world))
    n_train = len(training)
    if dp_shard == -1:
        if n_train % (dp_replicate * tp):
            raise RolesError(
                f"{n_train} training ranks are not a multiple of dp_replicate x tp = "
                f"{dp_replicate * tp}"
            )
        dp_shard = n_train // (dp_replicate * tp)
    if dp_shard < 1 or dp_replicate * dp_shard * tp != n_train:
        raise RolesError(
            f"the training layout dp_replicate x dp_shard x tp = {dp_replicate} x {dp_shard} x "
            f"{tp} must cover the {n_train} training ranks"
        )
    if len(rollout) % rollout_tp:
        raise RolesError(
            f"rollout_tp={rollout_tp} must divide the {len(rollout)} rollout ranks (one engine "
            "replica per rollout_tp ranks)"
        )
    return JobRoles(world, placement, training, rollout, dp_replicate, dp_shard, tp, rollout_tp)

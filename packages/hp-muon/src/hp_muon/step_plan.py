"""The plan of a whole Muon step, per rank group: :func:`plan_muon`, shared by ``Muon`` and
planners.

``Muon`` splits a step's matrices into two groups and plans each with
:func:`hp_muon.plan.plan_muon_step`:

* the matrices whose layout spans several ranks, exchanged over the process group (its ranks
  key the group), in buckets of ``bucket_cap_mb`` (bf16 MiB);
* the matrices whose layout spans one rank (plain parameters), orthogonalized where they are,
  with no collective, in one bucket (keyed by this rank alone).

:func:`plan_muon` is that rule, as a pure function of each parameter's name and layout (e.g.
``hp_dtensor.layout_of`` of a meta model's parameters, or the layouts a resolved plan gives):
no process group and no tensor. ``Muon`` builds its plans with it, so the two agree by
construction; ``Muon(plan=...)`` checks a planner's plan against its own at the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hp_layout import Layout
from hp_muon.plan import MatrixTensor, MuonPlan, plan_muon_step

__all__ = [
    "LOCAL_BUCKET_NUMEL",
    "MuonGroupPlan",
    "MuonStepPlan",
    "bucket_numel",
    "plan_muon",
]

LOCAL_BUCKET_NUMEL = 2**62
"""The bucket size of the single-rank group: one bucket (nothing crosses ranks)."""


def bucket_numel(bucket_cap_mb: float) -> int:
    """Matrix elements per exchange bucket: ``bucket_cap_mb`` MiB of bf16 (at least 1).

    Raises:
        ValueError: ``bucket_cap_mb`` is not positive.
    """
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
    return max(1, int(bucket_cap_mb * 2**20) // 2)


@dataclass(frozen=True)
class MuonGroupPlan:
    """The plan of one rank group of a Muon step.

    Attributes:
        ranks: the group's global ranks: the process group's carrying the exchanges, or this
            rank alone for the single-rank group.
        local: whether this is the single-rank group (no collective).
        bucket_numel: elements per exchange bucket.
        indices: the positions, in the parameters given to :func:`plan_muon`, of the group's
            parameters (``plan``'s ``MatrixJob.tensor`` indexes this tuple).
        plan: owners, pieces and buckets of the group's matrices.
        names: the group's parameters' names, for messages (not compared: a plan made from
            a model's names equals one made from positions).
    """

    ranks: tuple[int, ...]
    local: bool
    bucket_numel: int
    indices: tuple[int, ...]
    plan: MuonPlan
    names: tuple[str, ...] = field(default=(), compare=False)

    def matrix_label(self, job: int) -> str:
        """``matrix <job> (parameter '<name>', matrix <index> of it)``."""
        tensor = self.plan.jobs[job].tensor
        name = self.names[tensor] if tensor < len(self.names) else f"#{self.indices[tensor]}"
        return f"matrix {job} (parameter {name!r}, matrix {self.plan.jobs[job].index} of it)"


@dataclass(frozen=True)
class MuonStepPlan:
    """Every rank group of one Muon step: the exchanged group first, then the single-rank one
    (each present only when it has parameters)."""

    groups: tuple[MuonGroupPlan, ...]

    def by_ranks(self) -> dict[tuple[int, ...], MuonPlan]:
        """``{group ranks: MuonPlan}``."""
        return {g.ranks: g.plan for g in self.groups}


def _as_matrix(spec: MatrixTensor | Layout) -> MatrixTensor:
    return spec if isinstance(spec, MatrixTensor) else MatrixTensor(spec)


def plan_muon(
    params: Sequence[tuple[str, MatrixTensor | Layout]],
    *,
    bucket_cap_mb: float = 32.0,
    group_ranks: Sequence[int] | None = None,
    rank: int = 0,
) -> MuonStepPlan:
    """The plan of a Muon step over ``params`` (pure: layouts only, no process group).

    Args:
        params: ``(name, layout)`` (or ``(name, MatrixTensor(layout, row_blocks))``) per
            parameter with a gradient, in the optimizer's order (its groups' parameters in
            turn). The layout is the one ``Muon`` plans with: ``hp_dtensor.layout_of(param)``
            (a single-rank layout for a plain parameter, which is orthogonalized where it is),
            or, with ``Muon(replicate_group=...)``, a plain parameter's shape replicated over
            that group's ranks (axis ``"replicate"``).
        bucket_cap_mb: ``Muon``'s ``bucket_cap_mb``.
        group_ranks: the global ranks of ``Muon``'s ``process_group`` (default: the world):
            they key the exchanged group. None: the ranks holding some exchanged parameter.
        rank: the rank planning (keys the single-rank group; plain parameters' layouts name
            it too).

    Raises:
        ValueError: a bad ``bucket_cap_mb``; :class:`hp_muon.MuonPlanError` (a ValueError) for
            a layout Muon cannot plan (Partial placement, fewer than 2 dims, bad row blocks).
    """
    specs = [(name, _as_matrix(spec)) for name, spec in params]
    spread = tuple(i for i, (_, s) in enumerate(specs) if s.layout.mesh.size > 1)
    local = tuple(i for i, (_, s) in enumerate(specs) if s.layout.mesh.size == 1)
    groups: list[MuonGroupPlan] = []
    if spread:
        if group_ranks is None:
            group_ranks = sorted({r for i in spread for r in specs[i][1].layout.mesh.ranks})
        groups.append(_group(specs, spread, tuple(group_ranks), False, bucket_numel(bucket_cap_mb)))
    if local:
        groups.append(_group(specs, local, (rank,), True, LOCAL_BUCKET_NUMEL))
    return MuonStepPlan(tuple(groups))


def _group(
    specs: Sequence[tuple[str, MatrixTensor]],
    indices: tuple[int, ...],
    ranks: tuple[int, ...],
    local: bool,
    bucket: int,
) -> MuonGroupPlan:
    plan = plan_muon_step([specs[i][1] for i in indices], bucket_numel=bucket)
    names = tuple(specs[i][0] for i in indices)
    return MuonGroupPlan(ranks, local, bucket, indices, plan, names)

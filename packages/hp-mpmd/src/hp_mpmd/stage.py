"""Pipeline stages and where they run.

A :class:`PipelineStage` is one (virtual) stage's module on this rank. A
:class:`StagePlacement` says, for every *plan rank* of a :class:`~hp_mpmd.actions.SchedulePlan`,
which global ranks run it: one rank in plain pipeline parallelism, a tensor-parallel group when
a stage is itself sharded, groups of different sizes for heterogeneous (MPMD) stages. The
runtime (:mod:`hp_mpmd.runtime`) moves activations and gradients between these groups by the
rules documented on :class:`StagePlacement`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["PipelineStage", "StageError", "StagePlacement"]


class StageError(ValueError):
    """A stage, a placement and a plan that do not fit together."""


@dataclass(frozen=True)
class StagePlacement:
    """Which global ranks run each plan rank, and how stage inputs' gradients travel back.

    Attributes:
        rank_groups: per plan rank, the global ranks that run its stages (every one of them
            holds the stage's input and output whole, i.e. replicated over the group).
        partial_input_grad: stages whose input gradient is a *partial sum* over their group
            (each rank's input gradient is its own contribution, as a hand-written
            tensor-parallel stage with no all-reduce at its input gives it; hp-dtensor's
            production mode hands a stage's input gradient back whole on every rank).

    Communication rules between a producer group ``P`` (``p`` ranks) and a consumer group ``C``
    (``c`` ranks), with a single tensor crossing each stage boundary:

    * activations: consumer rank ``C[j]`` receives from ``P[j % p]`` (so one producer may feed
      several consumers, and with ``p > c`` some producers send nothing);
    * whole input gradients: producer rank ``P[i]`` receives from ``C[i % c]``;
    * partial input gradients: producer rank ``P[i]`` receives from every ``C[j]`` and sums in
      ``j`` order.
    """

    rank_groups: tuple[tuple[int, ...], ...]
    partial_input_grad: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        seen: set[int] = set()
        if not self.rank_groups:
            raise StageError("a StagePlacement needs at least one plan rank")
        for i, group in enumerate(self.rank_groups):
            if not group:
                raise StageError(f"plan rank {i} has no global ranks in {self.rank_groups}")
            overlap = seen.intersection(group)
            if overlap:
                raise StageError(
                    f"global ranks {sorted(overlap)} appear in more than one plan rank of "
                    f"{self.rank_groups}; each global rank runs one plan rank"
                )
            seen.update(group)

    @classmethod
    def from_group(cls, num_ranks: int, group: dist.ProcessGroup | None = None) -> StagePlacement:
        """One global rank per plan rank: plan rank ``i`` is rank ``i`` of ``group`` (default:
        the world). Raises :class:`StageError` when the group size differs from ``num_ranks``."""
        size = dist.get_world_size(group)
        if size != num_ranks:
            raise StageError(
                f"the schedule has {num_ranks} pipeline ranks but the process group has {size} "
                f"ranks; build the plan for {size} ranks or pass a group of {num_ranks}"
            )
        ranks = range(size)
        if group is not None:
            return cls(tuple((dist.get_global_rank(group, r),) for r in ranks))
        return cls(tuple((r,) for r in ranks))

    def plan_rank_of(self, global_rank: int) -> int | None:
        """The plan rank that ``global_rank`` runs, or None."""
        for i, group in enumerate(self.rank_groups):
            if global_rank in group:
                return i
        return None

    def act_sources(self, producer: int, consumer: int, me: int) -> tuple[int, ...]:
        """Global ranks ``me`` (in consumer plan rank) receives an activation from."""
        p, c = self.rank_groups[producer], self.rank_groups[consumer]
        return (p[c.index(me) % len(p)],)

    def act_targets(self, producer: int, consumer: int, me: int) -> tuple[int, ...]:
        """Global ranks ``me`` (in producer plan rank) sends an activation to."""
        p, c = self.rank_groups[producer], self.rank_groups[consumer]
        i = p.index(me)
        return tuple(r for j, r in enumerate(c) if j % len(p) == i)

    def grad_sources(
        self, producer: int, consumer: int, stage: int, me: int, *, whole: bool = False
    ) -> tuple[int, ...]:
        """Global ranks ``me`` (in producer plan rank) receives ``stage``'s input gradient
        from (``stage`` is the consumer stage; ``whole`` forces the whole-gradient rule)."""
        p, c = self.rank_groups[producer], self.rank_groups[consumer]
        if stage in self.partial_input_grad and not whole:
            return c
        return (c[p.index(me) % len(c)],)

    def grad_targets(
        self, producer: int, consumer: int, stage: int, me: int, *, whole: bool = False
    ) -> tuple[int, ...]:
        """Global ranks ``me`` (in consumer plan rank, running ``stage``) sends its input
        gradient to (``whole`` forces the whole-gradient rule)."""
        p, c = self.rank_groups[producer], self.rank_groups[consumer]
        if stage in self.partial_input_grad and not whole:
            return p
        j = c.index(me)
        return tuple(r for i, r in enumerate(p) if i % len(c) == j)


class PipelineStage:
    """One stage's module on this rank.

    Args:
        module: the stage's layers (already parallelized if the stage is tensor-parallel).
        stage_index: the (virtual) stage index in ``[0, num_stages)``.
        num_stages: the number of (virtual) stages of the pipeline.
        group: the pipeline process group (plan rank ``i`` = group rank ``i``) when no explicit
            :class:`StagePlacement` is given to the runtime; default: the world.
        device: where received activations and gradients are allocated (default: the device
            of the module's first parameter, else the CPU).
        input_shape: optional per-microbatch input shape this stage expects; checked at the
            shape exchange against what the previous stage sends.
        output_shape: optional per-microbatch output shape; checked at the shape exchange
            against what the module returns.

    The stage takes one tensor and returns one tensor (the last stage returns what the loss
    function takes).
    """

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        num_stages: int,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        input_shape: Sequence[int] | None = None,
        output_shape: Sequence[int] | None = None,
    ) -> None:
        if num_stages < 1:
            raise StageError(f"num_stages must be at least 1, got {num_stages}")
        if not 0 <= stage_index < num_stages:
            raise StageError(f"stage_index {stage_index} is not in [0, {num_stages})")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        if device is None:
            first = next(iter(module.parameters()), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.input_shape = None if input_shape is None else tuple(input_shape)
        self.output_shape = None if output_shape is None else tuple(output_shape)

    @property
    def is_first(self) -> bool:
        """True for stage 0 (it reads the batch)."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """True for the last stage (it computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> list[nn.Parameter]:
        """The parameters that take gradients."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages}, {type(self.module).__name__})"

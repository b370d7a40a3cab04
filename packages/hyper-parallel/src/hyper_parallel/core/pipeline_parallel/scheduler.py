"""``hyper_parallel.core.pipeline_parallel.scheduler``: upstream's schedules
(:class:`ScheduleGPipe`, :class:`Schedule1F1B`, :class:`ScheduleInterleaved1F1B`) and their
``run(...)``, on hp-mpmd's plans (``hp_mpmd.schedules``) and runtime
(``hp_mpmd.PipelineSchedule``).

Upstream's last stage returns each microbatch's loss and its backward starts from ones, so the
stage parameters' gradients are those of the *sum* of the microbatch losses; ``run`` returns the
losses on the ranks of the last stage. hp-mpmd's runtime divides each microbatch's loss by the
number of microbatches (the mean): the loss function given to it multiplies that back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import hp_mpmd
from hp_dtensor import DTensor, Replicate
from hp_mpmd.schedules import gpipe, interleaved_1f1b, one_f_one_b
from hyper_parallel.errors import not_offered
from hyper_parallel.migration import adapts

__all__ = [
    "PipelineScheduleRuntime",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
]


class PipelineScheduleRuntime:
    """The common part of upstream's schedules (upstream's base class name).

    Args:
        stages: this rank's stage, or its stages (interleaved schedules).
        micro_batch_num: microbatches per ``run``; the batch is split on dim 0.
        args_batch_dim: the batch dim of the input: 0 (or None) only.
        kwargs_batch_dim, output_concat_dim: not offered (stages take one tensor).
        overlap_p2p: accepted: the runtime always posts each run of transfers as one batch and
            waits for sends at the end of the step.
        swap: not offered: wrap the stage's layers with ``hyper_parallel.swap_wrapper``.
        p2p_transport: ``"auto"`` or ``"batch"`` (what the runtime does).
    """

    def __init__(
        self,
        stages: hp_mpmd.PipelineStage | Sequence[hp_mpmd.PipelineStage],
        micro_batch_num: int,
        args_batch_dim: int | None = None,
        kwargs_batch_dim: object = None,
        output_concat_dim: int | None = None,
        overlap_p2p: bool = False,
        swap: bool = False,
        p2p_transport: str = "auto",
    ) -> None:
        name = type(self).__name__
        self.stages = [stages] if isinstance(stages, hp_mpmd.PipelineStage) else list(stages)
        if not self.stages or not all(isinstance(s, hp_mpmd.PipelineStage) for s in self.stages):
            raise TypeError(
                f"{name} needs this rank's PipelineStage (or a list of them), got {stages!r}"
            )
        if args_batch_dim not in (None, 0):
            raise not_offered(
                f"{name}(args_batch_dim={args_batch_dim!r})",
                "microbatches are split on dim 0: move the batch dim to the front",
            )
        if kwargs_batch_dim is not None or output_concat_dim is not None:
            raise not_offered(
                f"{name}(kwargs_batch_dim=..., output_concat_dim=...)",
                "a stage takes one tensor and the last stage returns its loss",
            )
        if swap:
            raise not_offered(
                f"{name}(swap=True)",
                "wrap the stage's layers with hyper_parallel.swap_wrapper (hp_offload)",
            )
        if p2p_transport not in ("auto", "batch"):
            raise not_offered(
                f"{name}(p2p_transport={p2p_transport!r})",
                "transfers are always batched (p2p_transport='auto' or 'batch')",
            )
        del overlap_p2p  # the runtime always batches transfers and defers send waits
        self.micro_batch_num = micro_batch_num
        self.plan = self._plan(self.stages[0].num_stages, len(self.stages), micro_batch_num)
        self._losses: list[torch.Tensor] = []
        self.runtime = hp_mpmd.PipelineSchedule(self.plan, self.stages, self._loss)

    def _plan(
        self, stage_num: int, local_stages: int, micro_batch_num: int
    ) -> hp_mpmd.SchedulePlan:
        raise NotImplementedError(f"{type(self).__name__} builds no plan")

    def _single(self, local_stages: int) -> None:
        if local_stages != 1:
            raise ValueError(
                f"{type(self).__name__} runs one stage per rank, got {local_stages}; use "
                "ScheduleInterleaved1F1B for several stages per rank"
            )

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        del target  # the last stage computes its loss itself (upstream)
        self._losses.append(output.detach())
        # The runtime divides by micro_batch_num; upstream seeds every microbatch with ones.
        return output.sum() * self.micro_batch_num

    def _first_input(self, args: tuple[object, ...]) -> torch.Tensor:
        name = type(self).__name__
        if len(args) != 1:
            raise not_offered(
                f"{name}.run with {len(args)} positional inputs",
                "stage 0 takes exactly one tensor (pack several into one)",
            )
        (x,) = args
        if isinstance(x, DTensor):
            if not all(isinstance(p, Replicate) for p in x.placements):
                raise not_offered(
                    f"{name}.run on a DTensor placed {x.placements!r}",
                    "pass the whole batch: a replicated DTensor or a plain tensor",
                )
            x = x.to_local()
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}.run needs a tensor on stage 0, got {type(x).__name__}")
        return x

    def run(self, *args: object, **kwargs: object) -> list[torch.Tensor]:
        """One training step: forward and backward of every microbatch on this rank.

        Ranks running stage 0 pass the whole batch (``run(x)``), the others pass nothing (what
        they pass is ignored). Gradients accumulate into the stage parameters' ``.grad``:
        those of the sum of the microbatch losses, as upstream.

        Returns:
            The microbatch losses (the last stage's outputs) on the ranks running the last
            stage, in microbatch order; empty elsewhere.
        """
        if kwargs:
            raise not_offered(
                f"{type(self).__name__}.run(**{sorted(kwargs)})",
                "a stage takes one tensor: pass the batch positionally on stage 0",
            )
        first = any(s.is_first for s in self.stages)
        last = next((s for s in self.stages if s.is_last), None)
        inputs = self._first_input(args) if first else None
        targets = (
            torch.zeros(self.micro_batch_num, device=last.device) if last is not None else None
        )
        self._losses = []
        self.runtime.step(inputs, targets)
        losses, self._losses = self._losses, []
        return losses


@adapts("hp_mpmd.schedules.gpipe", "upstream's `ScheduleGPipe(stage, micro_batch_num).run(x)`")
class ScheduleGPipe(PipelineScheduleRuntime):
    """GPipe: every microbatch's forward, then every backward (one stage per rank)."""

    def _plan(
        self, stage_num: int, local_stages: int, micro_batch_num: int
    ) -> hp_mpmd.SchedulePlan:
        self._single(local_stages)
        return gpipe(stage_num, micro_batch_num)


@adapts("hp_mpmd.schedules.one_f_one_b", "upstream's `Schedule1F1B(stage, micro_batch_num).run(x)`")
class Schedule1F1B(PipelineScheduleRuntime):
    """1F1B: warm-up forwards, then one forward and one backward in turn (one stage per rank)."""

    def _plan(
        self, stage_num: int, local_stages: int, micro_batch_num: int
    ) -> hp_mpmd.SchedulePlan:
        self._single(local_stages)
        return one_f_one_b(stage_num, micro_batch_num)


@adapts(
    "hp_mpmd.schedules.interleaved_1f1b",
    "upstream's `ScheduleInterleaved1F1B(stages, micro_batch_num).run(x)`",
)
class ScheduleInterleaved1F1B(PipelineScheduleRuntime):
    """Interleaved 1F1B: several (virtual) stages per rank, stage ``s`` on pipeline rank
    ``s % ranks`` (upstream's "loop" placement); ``micro_batch_num`` a multiple of the ranks."""

    def _plan(
        self, stage_num: int, local_stages: int, micro_batch_num: int
    ) -> hp_mpmd.SchedulePlan:
        if stage_num % local_stages:
            raise ValueError(
                f"ScheduleInterleaved1F1B: {stage_num} stages cannot be spread evenly with "
                f"{local_stages} stages on this rank"
            )
        return interleaved_1f1b(stage_num // local_stages, local_stages, micro_batch_num)

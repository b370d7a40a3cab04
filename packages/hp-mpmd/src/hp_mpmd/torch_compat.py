"""``torch.distributed.pipelining``'s stage and schedule classes over hp-mpmd's plans and runtime.

Code written for torch's pipelining runs here by changing the import::

    from hp_mpmd.torch_compat import PipelineStage, Schedule1F1B

    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    out = schedule.step(x, target=y, losses=losses)  # x on stage 0, target on the last

The names live in this module, not in ``hp_mpmd``: :class:`hp_mpmd.PipelineStage` keeps its own
signature (``device`` and the pipeline group keyword-only; hp-train and hyper-parallel build
it), and :class:`PipelineStage` here is a subclass taking torch's positional arguments, so
either kind of stage runs under :class:`hp_mpmd.PipelineSchedule`.

What a ``step`` does, as torch's: the batch (stage 0) and ``target`` (last stage) are split on
dim 0 into ``n_microbatches`` chunks; the loss of each is ``loss_fn(output, target_chunk)``;
every backward starts from the *unscaled* loss and, with ``scale_grads=True`` (default), each
local stage's gradients are divided by ``n_microbatches`` once at the end of the step (torch's
order of operations: the results are bit-identical to torch's); ``losses`` (a list) receives
the per-microbatch losses on the last stage; the last stage returns the microbatch outputs
concatenated on dim 0 (``return_outputs``). Without ``loss_fn``, and in :meth:`eval`, the
step runs forwards only, under ``torch.no_grad()``.

Refused, with torch's exception type where torch has one for the case and a message naming
the alternative: chunk specs other than dim 0 and keyword inputs (``NotImplementedError``),
batches the microbatch count does not divide (``ValueError``), several tensors crossing a
stage boundary, DTensor metadata and ``dw_builder`` (``NotImplementedError``), and
``ScheduleZBVZeroBubble`` and interleaved zero bubble with several stages per rank
(``NotImplementedError`` on construction); ``ScheduleInterleavedZeroBubble`` with one stage per
rank runs ZB-H1, and ``ScheduleDualPipeV`` runs hp-mpmd's DualPipeV plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from hp_mpmd.actions import SchedulePlan
from hp_mpmd.runtime import PipelineSchedule, StepResult
from hp_mpmd.schedules import (
    dualpipev,
    forward_only,
    gpipe,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    zero_bubble_h1,
)
from hp_mpmd.stage import PipelineStage as _HpStage

__all__ = [
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
]

_ALTERNATIVE = "or use torch.distributed.pipelining for this feature"


def _one_tensor(value: object, what: str) -> torch.Tensor | None:
    """``value`` (None, a tensor, or a 1-tuple of one) as one tensor or None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and len(value) == 1 and isinstance(value[0], torch.Tensor):
        return value[0]
    if isinstance(value, tuple):
        raise NotImplementedError(
            f"{what} has {len(value)} entries; hp-mpmd passes one tensor across each stage "
            f"boundary: concatenate them into one tensor, {_ALTERNATIVE}"
        )
    raise TypeError(f"{what} must be a tensor or a tuple of tensors, got {type(value).__name__}")


class PipelineStage(_HpStage):
    """One stage on this rank, with torch's ``PipelineStage`` arguments.

    Args:
        submodule: the stage's module: one tensor in, one tensor out.
        stage_index: this stage's index (``ValueError`` when not below ``num_stages``).
        num_stages: the number of (virtual) stages.
        device: where received activations and gradients are allocated.
        input_args: an example microbatch input (a tensor or a 1-tuple): its shape is checked
            against what the previous stage sends at the shape exchange (a mismatch is a
            ``RuntimeError`` on every rank, as torch's ``PipeliningMetadataError``).
        output_args: an example microbatch output, checked the same way against what the
            module returns.
        output_grads, input_grads, get_mesh: DTensor boundary metadata; refused
            (``NotImplementedError``): hp-mpmd stages exchange plain tensors (run tensor
            parallelism inside a stage with hp-dtensor's production mode).
        group: the pipeline process group (default: the world); ``RuntimeError`` when it
            has more ranks than there are stages.
        dw_builder: refused (``NotImplementedError``): hp-mpmd's split backward computes
            weight gradients itself (``hp_mpmd.schedules.zero_bubble_h1``).
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        input_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_args: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        output_grads: object = None,
        input_grads: object = None,
        group: dist.ProcessGroup | None = None,
        dw_builder: object = None,
        get_mesh: object = None,
    ) -> None:
        if stage_index >= num_stages:
            raise ValueError(f"Stage index {stage_index} is out of range of {num_stages}")
        for name, value in (
            ("output_grads", output_grads),
            ("input_grads", input_grads),
            ("get_mesh", get_mesh),
        ):
            if value is not None:
                raise NotImplementedError(
                    f"PipelineStage({name}=...): hp-mpmd stages exchange plain tensors; run "
                    f"tensor parallelism inside a stage (hp-dtensor production mode), "
                    f"{_ALTERNATIVE}"
                )
        if dw_builder is not None:
            raise NotImplementedError(
                "PipelineStage(dw_builder=...): hp-mpmd's split backward computes weight "
                "gradients itself; run a zero-bubble plan (hp_mpmd.schedules.zero_bubble_h1) "
                f"with hp_mpmd.PipelineSchedule, {_ALTERNATIVE}"
            )
        size = dist.get_world_size(group)
        if size > num_stages:
            raise RuntimeError(
                f"Pipeline group size {size} cannot be larger than number of stages {num_stages}"
            )
        x = _one_tensor(input_args, "input_args")
        y = _one_tensor(output_args, "output_args")
        super().__init__(
            submodule,
            stage_index,
            num_stages,
            group=group,
            device=device,
            input_shape=None if x is None else x.shape,
            output_shape=None if y is None else y.shape,
        )
        self.group_rank = dist.get_rank(group)
        self.group_size = size

    @property
    def submod(self) -> nn.Module:
        """The stage's module (torch's name)."""
        return self.module


def _refuse_spec(name: str, value: object) -> None:
    if value is not None:
        raise NotImplementedError(
            f"{name}={value!r}: hp-mpmd splits the positional input and the target on dim 0 "
            f"and concatenates outputs on dim 0; move the batch dim to the front, {_ALTERNATIVE}"
        )


class _Schedule:
    """The common part: torch's ``step`` / ``eval`` over one :class:`PipelineSchedule` for
    training and one for forward-only passes."""

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None,
        scale_grads: bool,
    ) -> None:
        if not stages or not all(isinstance(s, _HpStage) for s in stages):
            raise TypeError(
                f"{type(self).__name__} needs this rank's hp_mpmd PipelineStage(s), got "
                f"{stages!r}; build them with hp_mpmd.torch_compat.PipelineStage"
            )
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int):
            raise TypeError(f"n_microbatches must be an int, got {n_microbatches!r}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be at least 1, got {n_microbatches}")
        self._stages = list(stages)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._has_backward = loss_fn is not None
        self._loss_kwargs: dict[str, Any] = {}
        plan = self._plan()
        self.plan = plan
        self._train = PipelineSchedule(plan, self._stages, self._loss, scale_loss=False)
        self._forward = PipelineSchedule(
            forward_only(plan), self._stages, self._loss, forward_only=True
        )

    def _plan(self) -> SchedulePlan:
        raise NotImplementedError(f"{type(self).__name__} builds no plan")  # pragma: no cover

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None  # targets reach the runtime only with a loss_fn
        return self._loss_fn(output, target, **self._loss_kwargs)

    @property
    def _first(self) -> bool:
        return any(s.is_first for s in self._stages)

    @property
    def _last(self) -> bool:
        return any(s.is_last for s in self._stages)

    def step(
        self,
        *args: object,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        **kwargs: object,
    ) -> torch.Tensor | None:
        """One training step on the whole batch (``args`` on stage 0, ``target`` on the last
        stage; both ignored elsewhere). Gradients accumulate into ``.grad``.

        Returns:
            The last stage's outputs concatenated on dim 0 (on its ranks, with
            ``return_outputs``), else None.

        Raises:
            RuntimeError: called under ``torch.no_grad()`` with a ``loss_fn`` (call
                :meth:`eval`).
            TypeError: ``losses`` is not a list, or no ``target`` on the last stage of a
                schedule with a ``loss_fn``.
            ValueError: a batch the microbatch count does not split into equal chunks.
            NotImplementedError: keyword inputs or several positional inputs.
        """
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError(
                "step() requires gradients to be enabled for backward computation; it should "
                "not be used under torch.no_grad() context. Please call eval() instead."
            )
        return self._run(
            self._has_backward, args, target, losses, return_outputs, loss_kwargs, kwargs
        )

    def eval(
        self,
        *args: object,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        **kwargs: object,
    ) -> torch.Tensor | None:
        """Forwards only on the whole batch (losses computed when a ``loss_fn`` and
        ``target`` are given); returns what :meth:`step` returns."""
        return self._run(False, args, target, losses, True, None, kwargs)

    def _run(
        self,
        backward: bool,
        args: tuple[object, ...],
        target: torch.Tensor | None,
        losses: list[torch.Tensor] | None,
        return_outputs: bool,
        loss_kwargs: dict[str, Any] | None,
        kwargs: dict[str, object],
    ) -> torch.Tensor | None:
        name = type(self).__name__
        if kwargs:
            raise NotImplementedError(
                f"{name}.step(**{sorted(kwargs)}): hp-mpmd stages take one positional tensor; "
                f"bind constant keyword arguments into the stage module, {_ALTERNATIVE}"
            )
        if len(args) > 1:  # checked on every rank, as torch splits args on every rank
            raise NotImplementedError(
                f"{name}.step with {len(args)} positional inputs: hp-mpmd stages take one "
                f"tensor; concatenate them into one, {_ALTERNATIVE}"
            )
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses)}")
        inputs = self._input(args) if self._first else None
        targets = None
        if self._last and self._loss_fn is not None:
            if target is None:
                # torch fails here with a TypeError (it indexes the missing target chunks)
                raise TypeError(
                    f"{name} has a loss_fn, so the last stage needs target= in step() and "
                    "eval(); build the schedule without loss_fn for forward-only passes"
                )
            targets = self._checked_batch(target, "target")
        self._loss_kwargs = dict(loss_kwargs or {})
        keep = return_outputs and self._last
        runtime = self._train if backward else self._forward
        try:
            result: StepResult = runtime.step(inputs, targets, keep_outputs=keep)
        finally:
            self._loss_kwargs = {}
        if backward and self.scale_grads and self._n_microbatches != 1:
            for stage in self._stages:
                for p in stage.module.parameters():
                    if p.grad is not None:
                        p.grad.div_(self._n_microbatches)
        if self._last and losses is not None:
            if len(result.losses) != self._n_microbatches:
                raise RuntimeError(
                    f"Expecting {self._n_microbatches} losses but got {len(result.losses)}: "
                    "pass target= (and build the schedule with a loss_fn) to get losses"
                )
            losses.clear()
            losses.extend(result.losses)
        return torch.cat(result.outputs) if keep else None

    def _input(self, args: tuple[object, ...]) -> torch.Tensor:
        name = type(self).__name__
        if not args:
            raise RuntimeError(f"{name}.step on stage 0 needs the batch: step(x, ...)")
        (x,) = args
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}.step needs a tensor on stage 0, got {type(x).__name__}")
        return self._checked_batch(x, "the input")

    def _checked_batch(self, x: torch.Tensor, what: str) -> torch.Tensor:
        n = self._n_microbatches
        size = x.shape[0] if x.dim() else 0
        if x.dim() == 0 or size % n:
            raise ValueError(
                f"{type(self).__name__}: {what} has a batch of {size}, which does not split "
                f"into {n} equal microbatches on dim 0 (hp-mpmd needs equal microbatches); "
                f"give a batch size divisible by n_microbatches={n}"
            )
        return x


class _SingleStage(_Schedule):
    """Torch's single-stage schedule arguments: one stage per rank."""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: object = None,
        kwargs_chunk_spec: object = None,
        output_merge_spec: object = None,
        scale_grads: bool = True,
    ) -> None:
        self._check_microbatches(stage, n_microbatches)
        _refuse_spec("args_chunk_spec", args_chunk_spec)
        _refuse_spec("kwargs_chunk_spec", kwargs_chunk_spec)
        _refuse_spec("output_merge_spec", output_merge_spec)
        if isinstance(stage, (list, tuple)):
            raise TypeError(
                f"{type(self).__name__} takes this rank's one stage; for several stages per "
                "rank use ScheduleInterleaved1F1B or ScheduleLoopedBFS"
            )
        self._stage = stage
        super().__init__([stage], n_microbatches, loss_fn, scale_grads)

    def _check_microbatches(self, stage: PipelineStage, n_microbatches: int) -> None:
        """A schedule's own rule on the microbatch count (none by default)."""
        del stage, n_microbatches


class ScheduleGPipe(_SingleStage):
    """GPipe (``hp_mpmd.schedules.gpipe``): every forward, then every backward."""

    def _plan(self) -> SchedulePlan:
        return gpipe(self._stage.num_stages, self._n_microbatches)


class Schedule1F1B(_SingleStage):
    """1F1B (``hp_mpmd.schedules.one_f_one_b``); ``ValueError`` with fewer microbatches than
    stages, as torch."""

    def _check_microbatches(self, stage: PipelineStage, n_microbatches: int) -> None:
        if n_microbatches < stage.num_stages:
            raise ValueError(
                f"Number of microbatches ({n_microbatches}) must be greater than or equal to "
                f"the number of stages ({stage.num_stages})."
            )

    def _plan(self) -> SchedulePlan:
        return one_f_one_b(self._stage.num_stages, self._n_microbatches)


class _MultiStage(_Schedule):
    """Torch's multi-stage schedule arguments: stage ``s`` on pipeline rank ``s % ranks``."""

    def __init__(
        self,
        stages: list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: object = None,
        kwargs_chunk_spec: object = None,
        output_merge_spec: object = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
    ) -> None:
        _refuse_spec("args_chunk_spec", args_chunk_spec)
        _refuse_spec("kwargs_chunk_spec", kwargs_chunk_spec)
        _refuse_spec("output_merge_spec", output_merge_spec)
        if not backward_requires_autograd:
            raise NotImplementedError(
                f"{type(self).__name__}(backward_requires_autograd=False): hp-mpmd's backward "
                f"runs autograd; keep the default, {_ALTERNATIVE}"
            )
        # defer_pp_recv only moves when receives are posted; hp-mpmd's plans already post each
        # receive right before its use (as late as deadlock freedom allows): no effect on results.
        del defer_pp_recv
        if not isinstance(stages, (list, tuple)) or not stages:
            raise TypeError(
                f"{type(self).__name__} takes a list of this rank's stages, got {stages!r}"
            )
        num_stages = stages[0].num_stages
        ranks = dist.get_world_size(stages[0].group)
        if num_stages != ranks * len(stages):
            raise ValueError(
                f"{type(self).__name__}: {len(stages)} stages on each of {ranks} ranks make "
                f"{ranks * len(stages)} stages, but the stages were built with "
                f"num_stages={num_stages}"
            )
        self._ranks = ranks
        self._per_rank = len(stages)
        super().__init__(stages, n_microbatches, loss_fn, scale_grads)


class ScheduleInterleaved1F1B(_MultiStage):
    """Interleaved 1F1B (``hp_mpmd.schedules.interleaved_1f1b``). Torch also runs microbatch
    counts that are not a multiple of the ranks (with another order); here they are a
    ``ValueError`` naming the nearest counts that work."""

    def _plan(self) -> SchedulePlan:
        n, p = self._n_microbatches, self._ranks
        if n % p:
            lower, upper = (n // p) * p, (n // p + 1) * p
            raise ValueError(
                f"ScheduleInterleaved1F1B on hp-mpmd needs n_microbatches to be a multiple of "
                f"the {p} pipeline ranks, got {n}; use {lower or upper} or {upper}, or "
                "ScheduleLoopedBFS (any count)"
            )
        return interleaved_1f1b(p, self._per_rank, n)


class ScheduleLoopedBFS(_MultiStage):
    """Breadth-first looping (``hp_mpmd.schedules.looped_bfs``); torch's signature has no
    chunk specs here."""

    def __init__(
        self,
        stages: list[PipelineStage],
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        output_merge_spec: object = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
    ) -> None:
        super().__init__(
            stages,
            n_microbatches,
            loss_fn,
            None,
            None,
            output_merge_spec,
            scale_grads,
            backward_requires_autograd,
            defer_pp_recv,
        )

    def _plan(self) -> SchedulePlan:
        return looped_bfs(self._ranks, self._per_rank, self._n_microbatches)


def _not_offered(name: str) -> NoReturn:
    raise NotImplementedError(
        f"{name} is not offered by hp-mpmd: its zero-bubble plan is ZB-H1 with one stage per "
        "rank (ScheduleInterleavedZeroBubble with one stage, or "
        "hp_mpmd.schedules.zero_bubble_h1); for several stages per rank use "
        "ScheduleInterleaved1F1B, "
        f"{_ALTERNATIVE}"
    )


class ScheduleInterleavedZeroBubble(_MultiStage):
    """Zero bubble with a split backward. With one stage per rank this is ZB-H1
    (``hp_mpmd.schedules.zero_bubble_h1``: input-gradient passes first, weight passes filling
    the bubble), bit-identical to torch's; several stages per rank are refused
    (``NotImplementedError`` naming ``ScheduleInterleaved1F1B``). Microbatch counts torch
    refuses (not a multiple of ``max(1, n // ranks)``) are the same ``ValueError``."""

    def _plan(self) -> SchedulePlan:
        if self._per_rank != 1:
            raise NotImplementedError(
                f"ScheduleInterleavedZeroBubble with {self._per_rank} stages per rank: "
                "hp-mpmd's zero-bubble plan is ZB-H1, one stage per rank (pass one stage); "
                f"for several stages per rank use ScheduleInterleaved1F1B, {_ALTERNATIVE}"
            )
        n, p = self._n_microbatches, self._ranks
        rounds = max(1, n // p)
        if n % rounds:
            raise ValueError(
                "Zero bubble requires the number of microbatches to be a multiple of the "
                f"number of rounds ({rounds}), but got {n}."
            )
        return zero_bubble_h1(p, n)


class ScheduleZBVZeroBubble:
    """Refused on construction (``NotImplementedError``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        _not_offered("ScheduleZBVZeroBubble")


class ScheduleDualPipeV(_MultiStage):
    """DualPipeV (``hp_mpmd.schedules.dualpipev``): two stages per rank placed in a V, stages
    ``r`` and ``2p - 1 - r`` on pipeline rank ``r`` of ``p``, as torch places them. What torch
    refuses is refused with its exception type (``ValueError``): other than two stages per rank,
    fewer microbatches than stages; and so is a rank given other stages than its V pair.
    Gradients accumulate microbatch by microbatch in order on every stage, as in torch's
    schedule, so the results are bit-identical to torch's."""

    def _plan(self) -> SchedulePlan:
        p, n, num_stages = self._ranks, self._n_microbatches, self._ranks * self._per_rank
        if self._per_rank != 2:
            raise ValueError(
                f"ScheduleDualPipeV needs exactly 2 stages per rank (stages r and {2 * p - 1} - r "
                f"on rank r), got {self._per_rank}"
            )
        if n < num_stages:
            raise ValueError(
                "DualPipeV requires at least as many microbatches as stages, but got "
                f"{n} microbatches and {num_stages} stages."
            )
        rank = dist.get_rank(self._stages[0].group)
        mine = sorted(s.stage_index for s in self._stages)
        v_pair = [rank, 2 * p - 1 - rank]
        if mine != v_pair:
            raise ValueError(
                f"ScheduleDualPipeV places stages in a V: pipeline rank {rank} of {p} runs "
                f"stages {v_pair}, but it was given stages {mine}"
            )
        return dualpipev(p, n)

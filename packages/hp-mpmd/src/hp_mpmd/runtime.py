"""Execute a :class:`~hp_mpmd.actions.SchedulePlan` on this rank.

:class:`PipelineSchedule` runs this rank's action list of a plan, one training step per
:meth:`PipelineSchedule.step`:

* the batch is split into ``num_microbatches`` equal microbatches (stage 0 reads inputs, the
  last stage targets);
* the last stage's loss of each microbatch is scaled by ``1 / num_microbatches`` before its
  backward, so the gradients accumulated over microbatches equal those of the mean loss of the
  whole batch (single-device training); the unscaled per-microbatch losses are returned
  (``scale_loss=False`` starts each backward from the unscaled loss: the gradients are then
  the sum, which :mod:`hp_mpmd.torch_compat` divides once at the end, as torch does);
* ``forward_only=True`` runs a plan of forwards alone (:func:`hp_mpmd.schedules.forward_only`)
  under ``torch.no_grad()`` for evaluation;
* consecutive communication actions form one ``dist.batch_isend_irecv`` batch, waited with a
  timeout; every transfer carries a tag naming its stage boundary, direction and microbatch;
* before the first step, shapes and dtypes are exchanged once along the pipeline (each stage
  runs its module once on zeros of the shape it will receive, without gradients) and cached:
  receive buffers are allocated from the cache, and a stage that cannot take what its
  predecessor sends fails on *every* rank with a :class:`ShapeMismatchError` naming both
  stages and shapes;
* ``BACKWARD_INPUT`` computes the stage input's gradient only (``torch.autograd.grad`` on the
  input, keeping the graph); ``BACKWARD_WEIGHT`` later computes the weight gradients
  (``torch.autograd.backward(..., inputs=leaves)``, the leaves being every tensor the graph
  accumulates a gradient into except the stage input: the parameters themselves, or the
  unsharded tensors a data-parallel sharder such as hp-fsdp computes with, whose
  gradient-accumulation hooks then fire in the weight pass and not in the input pass).

Memory: between a microbatch's forward and its backward a stage keeps its input, output and
autograd graph. Between ``BACKWARD_INPUT`` and ``BACKWARD_WEIGHT`` it keeps the graph (retained),
the output and the output gradient; the weight pass walks the graph again from the output, so
the activation-gradient path is computed twice (correct, simple; a finer split that stops at the
weight-consuming nodes would avoid the repeat).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from hp_dtensor.watchdog import watch_async, watch_p2p
from hp_mpmd.actions import COMM_KINDS, Action, ActionKind, SchedulePlan
from hp_mpmd.stage import PipelineStage, StageError, StagePlacement

__all__ = [
    "LossFn",
    "PipelineError",
    "PipelineSchedule",
    "ShapeMismatchError",
    "StepResult",
    "TensorMeta",
    "all_reduce_gradients",
    "run_plan",
]

_V = TypeVar("_V")

# The actions that compute a stage's weight gradients.
_WEIGHT_GRADIENT_KINDS = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT})
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_META_BYTES = 1024
DEFAULT_TIMEOUT = timedelta(seconds=300)


class PipelineError(RuntimeError):
    """The runtime met a plan or data it cannot execute."""


class ShapeMismatchError(PipelineError):
    """A stage cannot take what the previous stage sends (found at the shape exchange)."""


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one microbatch's tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        """The meta of ``t``."""
        return cls(tuple(t.shape), t.dtype)


@dataclass
class StepResult:
    """What one step returns.

    Attributes:
        losses: the unscaled loss of each microbatch, on the ranks running the last stage;
            empty elsewhere (and in a forward-only step without targets).
        outputs: the last stage's output of each microbatch (detached), on the ranks running
            the last stage, when the step was asked to keep them; empty otherwise.
    """

    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def loss(self) -> torch.Tensor | None:
        """The step's loss (mean over microbatches), or None off the last stage."""
        return torch.stack(self.losses).mean() if self.losses else None


def _encode(payload: dict[str, object], device: torch.device) -> torch.Tensor:
    data = json.dumps(payload).encode()
    if len(data) > _META_BYTES:
        data = json.dumps({**payload, "error": str(payload.get("error"))[:600]}).encode()
    out = torch.zeros(_META_BYTES, dtype=torch.uint8)
    out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out.to(device)


def _decode(t: torch.Tensor) -> dict[str, object]:
    raw = bytes(t.cpu().tolist()).rstrip(b"\0")
    decoded: dict[str, object] = json.loads(raw.decode())
    return decoded


def _meta_payload(meta: TensorMeta | None, error: str | None) -> dict[str, object]:
    if meta is None:
        return {"shape": None, "dtype": None, "error": error}
    return {"shape": list(meta.shape), "dtype": str(meta.dtype), "error": error}


def _meta_from(payload: dict[str, object]) -> TensorMeta | None:
    shape, dtype = payload.get("shape"), payload.get("dtype")
    if not isinstance(shape, list) or not isinstance(dtype, str):
        return None
    found = getattr(torch, dtype.removeprefix("torch."))
    assert isinstance(found, torch.dtype)
    return TensorMeta(tuple(int(v) for v in shape), found)


def _split(x: torch.Tensor, n: int, what: str) -> list[torch.Tensor]:
    if x.dim() == 0 or x.shape[0] % n:
        size = "a scalar" if x.dim() == 0 else f"a batch of {x.shape[0]}"
        raise PipelineError(
            f"{what} is {size}, which cannot be split into {n} equal microbatches; give a "
            f"batch size divisible by num_microbatches={n}"
        )
    return list(x.split(x.shape[0] // n))


class PipelineSchedule:
    """This rank's executor for one :class:`SchedulePlan`.

    Args:
        plan: the schedule (every rank builds the same plan).
        stages: this rank's stages (exactly ``plan.stages_of(plan_rank)``, any order).
        loss_fn: ``loss_fn(output, target)`` on the last stage, a mean over its microbatch.
        placement: the global ranks of each plan rank (default: one rank each, plan rank ``i``
            = rank ``i`` of the stages' group).
        timeout: the limit for every send, receive and collective of the runtime.
        before_weight_gradients: called as ``before_weight_gradients(stage, last)`` right
            before each action that computes a stage's weight gradients (``BACKWARD``, or
            ``BACKWARD_WEIGHT`` in split-backward plans), ``last`` True for the stage's final
            one of the step (read off the plan once). A data-parallel sharder hooks in here:
            e.g. hp-fsdp's ``set_requires_all_reduce(last)`` keeps HSDP's slow-tier
            all-reduce to once per step while every microbatch reduce-scatters (torch
            pipelining's ``backward_maybe_with_nosync`` plays this role for FSDP2).
        before_input_gradients: called as ``before_input_gradients(stage)`` right before each
            ``BACKWARD_INPUT``: a data-parallel sharder hooks in here to hold its gradient
            reduction until the weight pass (hp-fsdp: ``set_requires_gradient_sync(False)``,
            and ``True`` again in ``before_weight_gradients``).
        scale_loss: divide each microbatch's loss by ``num_microbatches`` before its backward
            (default), so the accumulated gradients are those of the batch mean. With False the
            backward starts from the unscaled loss and the gradients are the sum over
            microbatches (torch pipelining's order: it sums, then divides the gradients once;
            :mod:`hp_mpmd.torch_compat` does that division).
        forward_only: run a plan of forwards and activation transfers only (see
            :func:`hp_mpmd.schedules.forward_only`), under ``torch.no_grad()``, keeping no
            autograd state; the last stage computes losses only where targets are given.

    Raises:
        StageError: the plan, the placement and the stages do not fit together (each message
            says what was expected).
    """

    def __init__(
        self,
        plan: SchedulePlan,
        stages: Sequence[PipelineStage],
        loss_fn: LossFn,
        *,
        placement: StagePlacement | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        before_weight_gradients: Callable[[PipelineStage, bool], None] | None = None,
        before_input_gradients: Callable[[PipelineStage], None] | None = None,
        scale_loss: bool = True,
        forward_only: bool = False,
    ) -> None:
        if not stages:
            raise StageError("PipelineSchedule needs this rank's stages, got none")
        if placement is None:
            placement = StagePlacement.from_group(plan.num_ranks, stages[0].group)
        if len(placement.rank_groups) != plan.num_ranks:
            raise StageError(
                f"plan {plan.name!r} has {plan.num_ranks} pipeline ranks but the placement "
                f"gives {len(placement.rank_groups)} rank groups {placement.rank_groups}"
            )
        if len(plan.stage_to_rank) != plan.num_stages:
            raise StageError(
                f"plan {plan.name!r} places {len(plan.stage_to_rank)} stages but has "
                f"num_stages={plan.num_stages}"
            )
        if forward_only:
            extra = [
                a
                for acts in plan.actions
                for a in acts
                if a.kind not in (ActionKind.FORWARD, ActionKind.SEND_ACT, ActionKind.RECV_ACT)
            ]
            if extra:
                raise StageError(
                    f"forward_only=True runs forwards and activation transfers only, but plan "
                    f"{plan.name!r} has {extra[0]}; build the plan with "
                    "hp_mpmd.schedules.forward_only(plan)"
                )
        self.scale_loss = scale_loss
        self.forward_only = forward_only
        self.me = dist.get_rank()
        plan_rank = placement.plan_rank_of(self.me)
        if plan_rank is None:
            raise StageError(f"rank {self.me} is in no rank group of {placement.rank_groups}")
        for stage in stages:
            if stage.num_stages != plan.num_stages:
                raise StageError(
                    f"plan {plan.name!r} has {plan.num_stages} stages but stage "
                    f"{stage.stage_index} was built with num_stages={stage.num_stages}"
                )
        mine = sorted(s.stage_index for s in stages)
        expected = list(plan.stages_of(plan_rank))
        if mine != expected:
            raise StageError(
                f"plan {plan.name!r} runs stages {expected} on plan rank {plan_rank} (global "
                f"rank {self.me}) but this rank was given stages {mine}"
            )
        self.plan = plan
        self.loss_fn = loss_fn
        self.placement = placement
        self.timeout = timeout
        self.plan_rank = plan_rank
        self.stages = {s.stage_index: s for s in stages}
        self._pending_sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.in_meta: dict[int, TensorMeta] = {}
        self.out_meta: dict[int, TensorMeta] = {}
        self._exchanged = False
        self._keep_outputs = False
        self._program = self._group(plan.actions[plan_rank])
        self.before_weight_gradients = before_weight_gradients
        self.before_input_gradients = before_input_gradients
        self._last_weight_action = {
            a.stage: a for a in plan.actions[plan_rank] if a.kind in _WEIGHT_GRADIENT_KINDS
        }
        self._reset()

    # ---------------------------------------------------------------- plan structure

    @staticmethod
    def _group(actions: Sequence[Action]) -> list[Action | tuple[Action, ...]]:
        """Compute actions alone, consecutive communication actions as one tuple (a batch)."""
        out: list[Action | tuple[Action, ...]] = []
        batch: list[Action] = []
        for a in actions:
            if a.kind in COMM_KINDS:
                batch.append(a)
                continue
            if batch:
                out.append(tuple(batch))
                batch = []
            out.append(a)
        if batch:
            out.append(tuple(batch))
        return out

    def _rank_of(self, stage: int) -> int:
        return self.plan.stage_to_rank[stage]

    def _local(self, stage: int) -> bool:
        return 0 <= stage < self.plan.num_stages and self._rank_of(stage) == self.plan_rank

    def _tag(self, producer_stage: int, microbatch: int, grad: bool) -> int:
        return 2 * (producer_stage * self.plan.num_microbatches + microbatch) + int(grad)

    def _meta_tag(self, producer_stage: int, reverse: bool) -> int:
        base = 2 * self.plan.num_stages * self.plan.num_microbatches
        return base + 2 * producer_stage + int(reverse)

    # ---------------------------------------------------------------- p2p

    def _transfer(self, ops: list[dist.P2POp], *, eager_sends: bool = False) -> None:
        """Post ``ops`` as one batch and wait for its receives (and sends, unless
        ``eager_sends``: then they are waited at the end of the step, their tensors kept)."""
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)  # watched: each op's work, by watch_p2p below
        if len(works) != len(ops):  # a coalesced batch (NCCL): one work for all
            for work in works:
                work.wait(self.timeout)
            return
        me = dist.get_rank()
        for i, (op, work) in enumerate(zip(ops, works, strict=True)):
            send = op.op is dist.isend
            src, dst = (me, op.peer) if send else (op.peer, me)
            work = watch_p2p(self._describe(op.tag, send), src, dst, work)
            works[i] = work
        for op, work in zip(ops, works, strict=True):
            if eager_sends and op.op is dist.isend:
                self._pending_sends.append((work, op.tensor))
            else:
                work.wait(self.timeout)

    def _describe(self, tag: int, send: bool) -> str:
        """What a transfer with ``tag`` (see :meth:`_tag`, :meth:`_meta_tag`) carries."""
        verb = "send" if send else "recv"
        base = 2 * self.plan.num_stages * self.plan.num_microbatches
        if tag >= base:
            stage, reverse = divmod(tag - base, 2)
            return f"pipeline {verb} (shapes of stage {stage}{' backward' if reverse else ''})"
        slot, grad = divmod(tag, 2)
        stage, microbatch = divmod(slot, self.plan.num_microbatches)
        what = "gradient to stage" if grad else "activation of stage"
        return f"pipeline {verb} ({what} {stage}, microbatch {microbatch})"

    def _wait_sends(self) -> None:
        pending: list[tuple[dist.Work, torch.Tensor]] = self._pending_sends
        self._pending_sends = []
        for work, _ in pending:
            work.wait(self.timeout)

    def _device(self, stage: int) -> torch.device:
        return self.stages[stage].device

    # ---------------------------------------------------------------- shape exchange

    def _exchange_shapes(self, first_input: torch.Tensor | None) -> None:
        """Pass shapes along the pipeline once, check every stage takes its input, and agree
        on the verdict everywhere (a forward chain of metadata, then a backward chain)."""
        errors: dict[int, str | None] = {}
        for s in sorted(self.stages):
            stage = self.stages[s]
            error: str | None = None
            meta: TensorMeta | None
            if s == 0:
                if first_input is None:
                    raise PipelineError(f"rank {self.me} runs stage 0 but got no inputs")
                meta = TensorMeta.of(first_input)
            elif self._local(s - 1):
                meta, error = self.out_meta.get(s - 1), errors[s - 1]
            else:
                meta, error = self._recv_meta(s, reverse=False)
            if error is None:
                assert meta is not None
                self.in_meta[s] = meta
                error = self._try_stage(stage, meta)
            errors[s] = error
            if not stage.is_last and not self._local(s + 1):
                out = self.out_meta.get(s)
                targets = self.placement.act_targets(self.plan_rank, self._rank_of(s + 1), self.me)
                payload = _encode(_meta_payload(out, error), stage.device)
                tag = self._meta_tag(s, reverse=False)
                self._transfer([dist.P2POp(dist.isend, payload, t, tag=tag) for t in targets])
        verdicts: dict[int, str | None] = {}
        for s in sorted(self.stages, reverse=True):
            stage = self.stages[s]
            if stage.is_last:
                verdicts[s] = errors[s]
            elif self._local(s + 1):
                verdicts[s] = verdicts[s + 1]
            else:
                verdicts[s] = self._recv_meta(s + 1, reverse=True)[1]
            if s > 0 and not self._local(s - 1):
                targets = self.placement.grad_targets(
                    self._rank_of(s - 1), self.plan_rank, s, self.me, whole=True
                )
                payload = _encode(_meta_payload(None, verdicts[s]), stage.device)
                tag = self._meta_tag(s - 1, reverse=True)
                self._transfer([dist.P2POp(dist.isend, payload, t, tag=tag) for t in targets])
        verdict = verdicts[min(self.stages)]
        if verdict is not None:
            raise ShapeMismatchError(verdict)
        self._exchanged = True

    def _recv_meta(self, stage: int, *, reverse: bool) -> tuple[TensorMeta | None, str | None]:
        """Receive the metadata message crossing the boundary into ``stage`` (forward) or out
        of ``stage`` back to ``stage - 1`` (reverse)."""
        if reverse:
            sources = self.placement.grad_sources(
                self.plan_rank, self._rank_of(stage), stage, self.me, whole=True
            )
        else:
            sources = self.placement.act_sources(self._rank_of(stage - 1), self.plan_rank, self.me)
        device = self._device(stage - 1 if reverse else stage)
        buf = torch.zeros(_META_BYTES, dtype=torch.uint8, device=device)
        tag = self._meta_tag(stage - 1, reverse=reverse)
        self._transfer([dist.P2POp(dist.irecv, buf, sources[0], tag=tag)])
        payload = _decode(buf)
        error = payload.get("error")
        return _meta_from(payload), None if error is None else str(error)

    def _try_stage(self, stage: PipelineStage, meta: TensorMeta) -> str | None:
        """Run ``stage`` once on zeros of ``meta``; return an error message or None."""
        s = stage.stage_index
        source = "the batch" if s == 0 else f"stage {s - 1}"
        if stage.input_shape is not None and stage.input_shape != meta.shape:
            return (
                f"stage {s} expects inputs of shape {list(stage.input_shape)} but {source} "
                f"sends {meta}"
            )
        try:
            with torch.no_grad():
                out = stage.module(torch.zeros(meta.shape, dtype=meta.dtype, device=stage.device))
        except Exception as exc:  # any failure is reported on every rank with both stages
            return (
                f"stage {s} cannot take the output of {source} ({meta}): "
                f"{type(exc).__name__}: {exc}"
            )
        if not isinstance(out, torch.Tensor):
            return f"stage {s} returned {type(out).__name__}; a stage must return one tensor"
        if stage.output_shape is not None and stage.output_shape != tuple(out.shape):
            return (
                f"stage {s} declares outputs of shape {list(stage.output_shape)} but returns "
                f"{TensorMeta.of(out)} for its input {meta}"
            )
        self.out_meta[s] = TensorMeta.of(out)
        return None

    # ---------------------------------------------------------------- one step

    def _reset(self) -> None:
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._to_send: dict[tuple[int, int], torch.Tensor] = {}
        self._grad_out: dict[tuple[int, int], torch.Tensor] = {}
        self._input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._weight_pending: dict[
            tuple[int, int], tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]
        ] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pending_sends = []

    def step(
        self,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        *,
        keep_outputs: bool = False,
    ) -> StepResult:
        """Run one training step (forward and backward of every microbatch) on this rank.

        Gradients accumulate into the stage parameters' ``.grad`` (zero them between steps).

        Args:
            inputs: the whole batch, on ranks running stage 0 (ignored elsewhere).
            targets: the whole batch's targets, on ranks running the last stage (optional in
                a forward-only schedule: no losses then).
            keep_outputs: also return the last stage's per-microbatch outputs (detached).

        Returns:
            The per-microbatch losses (and outputs) on the ranks of the last stage.
        """
        n = self.plan.num_microbatches
        self._mb_inputs: list[torch.Tensor] = []
        self._mb_targets: list[torch.Tensor] = []
        if 0 in self.stages:
            if inputs is None:
                raise PipelineError(f"rank {self.me} runs stage 0 and needs the inputs")
            self._mb_inputs = _split(inputs, n, "the input")
        if self.plan.num_stages - 1 in self.stages:
            if targets is not None:
                self._mb_targets = _split(targets, n, "the target")
            elif not self.forward_only:
                raise PipelineError(f"rank {self.me} runs the last stage and needs targets")
        self._keep_outputs = keep_outputs
        if not self._exchanged:
            self._exchange_shapes(self._mb_inputs[0] if self._mb_inputs else None)
        self._reset()
        for item in self._program:
            if isinstance(item, tuple):
                self._communicate(item)
            else:
                self._compute(item)
        self._wait_sends()
        leftover = [
            f"{name} {sorted(d)}"
            for name, d in (
                ("inputs", self._inputs),
                ("forward state", self._saved),
                ("unsent activations", self._to_send),
                ("output gradients", self._grad_out),
                ("unsent input gradients", self._input_grads),
                ("pending weight gradients", self._weight_pending),
            )
            if d
        ]
        if leftover:
            raise PipelineError(
                f"plan {self.plan.name!r} left work unfinished on rank {self.me}: "
                + "; ".join(leftover)
            )
        losses = [self._losses[m] for m in sorted(self._losses)]
        outputs = [self._outputs[m] for m in sorted(self._outputs)]
        self._reset()
        return StepResult(losses, outputs)

    def _compute(self, a: Action) -> None:
        key = (a.stage, a.microbatch)
        if a.kind is ActionKind.FORWARD:
            self._forward(a.stage, a.microbatch)
        elif a.kind is ActionKind.BACKWARD:
            self._before_weight_gradients(a)
            x, out = self._pop(self._saved, key, a, "its forward")
            grad = self._output_grad(a)
            torch.autograd.backward(out, grad)
            self._deliver_input_grad(a, x)
        elif a.kind is ActionKind.BACKWARD_INPUT:
            x, out = self._pop(self._saved, key, a, "its forward")
            grad = self._output_grad(a)
            if self.before_input_gradients is not None:
                self.before_input_gradients(self.stages[a.stage])
            if x.requires_grad:
                (gx,) = torch.autograd.grad(out, x, grad, retain_graph=True)
                x.grad = gx
                self._deliver_input_grad(a, x)
            self._weight_pending[key] = (out, grad, x)
        elif a.kind is ActionKind.BACKWARD_WEIGHT:
            out, grad, x = self._pop(self._weight_pending, key, a, "its BACKWARD_INPUT")
            self._before_weight_gradients(a)
            leaves = _weight_leaves(out, x)
            if leaves:
                torch.autograd.backward(out, grad, inputs=leaves)
        else:  # pragma: no cover - COMPUTE_KINDS are exhausted above
            raise PipelineError(f"unknown compute action {a}")

    def _before_weight_gradients(self, a: Action) -> None:
        if self.before_weight_gradients is not None:
            last = self._last_weight_action.get(a.stage) == a
            self.before_weight_gradients(self.stages[a.stage], last)

    @staticmethod
    def _pop(store: dict[tuple[int, int], _V], key: tuple[int, int], a: Action, what: str) -> _V:
        try:
            return store.pop(key)
        except KeyError:
            raise PipelineError(f"action {a} runs before {what}") from None

    def _forward(self, s: int, m: int) -> None:
        stage = self.stages[s]
        a = Action(ActionKind.FORWARD, s, m)
        x = (
            self._mb_inputs[m]
            if stage.is_first
            else self._pop(self._inputs, (s, m), a, "its input arrived")
        )
        with torch.no_grad() if self.forward_only else contextlib.nullcontext():
            out = stage.module(x)
        if stage.is_last:
            if self._keep_outputs:
                self._outputs[m] = out.detach()
            if self._mb_targets:
                loss = self.loss_fn(out, self._mb_targets[m])
                self._losses[m] = loss.detach()
                out = loss / self.plan.num_microbatches if self.scale_loss else loss
        elif self._local(s + 1):
            grad = out.is_floating_point() and not self.forward_only
            self._inputs[(s + 1, m)] = out.detach().requires_grad_(grad)
        else:
            self._to_send[(s, m)] = out.detach()
        if not self.forward_only:
            self._saved[(s, m)] = (x, out)

    def _output_grad(self, a: Action) -> torch.Tensor | None:
        if self.stages[a.stage].is_last:
            return None
        grad: torch.Tensor = self._pop(
            self._grad_out, (a.stage, a.microbatch), a, "its output gradient arrived"
        )
        return grad

    def _deliver_input_grad(self, a: Action, x: torch.Tensor) -> None:
        if self.stages[a.stage].is_first or not x.requires_grad:
            return
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        if self._local(a.stage - 1):
            self._grad_out[(a.stage - 1, a.microbatch)] = grad
        else:
            self._input_grads[(a.stage, a.microbatch)] = grad

    def _communicate(self, batch: tuple[Action, ...]) -> None:
        ops: list[dist.P2POp] = []
        finish: list[Callable[[], None]] = []
        for a in batch:
            s, m = a.stage, a.microbatch
            if a.kind is ActionKind.SEND_ACT:
                self._check_peer(a, s + 1)
                t = self._pop(self._to_send, (s, m), a, "its FORWARD").contiguous()
                self._check_meta(a, t, self.out_meta[s])
                targets = self.placement.act_targets(self.plan_rank, self._rank_of(s + 1), self.me)
                tag = self._tag(s, m, grad=False)
                ops += [dist.P2POp(dist.isend, t, r, tag=tag) for r in targets]
            elif a.kind is ActionKind.RECV_ACT:
                self._check_peer(a, s - 1)
                meta = self.in_meta[s]
                buf = torch.empty(meta.shape, dtype=meta.dtype, device=self._device(s))
                (src,) = self.placement.act_sources(self._rank_of(s - 1), self.plan_rank, self.me)
                ops.append(dist.P2POp(dist.irecv, buf, src, tag=self._tag(s - 1, m, grad=False)))
                finish.append(self._store_input(s, m, buf))
            elif a.kind is ActionKind.SEND_GRAD:
                self._check_peer(a, s - 1)
                g = self._pop(self._input_grads, (s, m), a, "its backward").contiguous()
                targets = self.placement.grad_targets(
                    self._rank_of(s - 1), self.plan_rank, s, self.me
                )
                tag = self._tag(s - 1, m, grad=True)
                ops += [dist.P2POp(dist.isend, g, r, tag=tag) for r in targets]
            elif a.kind is ActionKind.RECV_GRAD:
                self._check_peer(a, s + 1)
                meta = self.out_meta[s]
                sources = self.placement.grad_sources(
                    self.plan_rank, self._rank_of(s + 1), s + 1, self.me
                )
                bufs = [
                    torch.empty(meta.shape, dtype=meta.dtype, device=self._device(s))
                    for _ in sources
                ]
                tag = self._tag(s, m, grad=True)
                ops += [
                    dist.P2POp(dist.irecv, b, r, tag=tag)
                    for b, r in zip(bufs, sources, strict=True)
                ]
                finish.append(self._store_grad(s, m, bufs))
        self._transfer(ops, eager_sends=True)
        for done in finish:
            done()

    def _store_input(self, s: int, m: int, buf: torch.Tensor) -> Callable[[], None]:
        def done() -> None:
            grad = buf.is_floating_point() and not self.forward_only
            self._inputs[(s, m)] = buf.requires_grad_(grad)

        return done

    def _store_grad(self, s: int, m: int, bufs: list[torch.Tensor]) -> Callable[[], None]:
        def done() -> None:
            total = bufs[0]
            for b in bufs[1:]:
                total = total + b
            self._grad_out[(s, m)] = total

        return done

    def _check_peer(self, a: Action, expected: int) -> None:
        if a.peer_stage != expected:
            raise PipelineError(
                f"action {a} names peer stage {a.peer_stage}; the runtime runs linear pipelines, "
                f"where it must be stage {expected}"
            )

    def _check_meta(self, a: Action, t: torch.Tensor, meta: TensorMeta) -> None:
        if TensorMeta.of(t) != meta:
            raise ShapeMismatchError(
                f"action {a}: stage {a.stage} produced {TensorMeta.of(t)} but the shape exchange "
                f"announced {meta} to stage {a.stage + 1}; every microbatch must have the shape "
                "of the first"
            )


def _weight_leaves(out: torch.Tensor, stage_input: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor the autograd graph of ``out`` accumulates a gradient into, but
    ``stage_input``: the weights the weight pass differentiates (whatever tensors the module
    computed with, which under a sharder are not the module's registered parameters)."""
    if out.grad_fn is None:
        return []
    leaves: dict[int, torch.Tensor] = {}
    seen: dict[int, object] = {}  # the nodes themselves kept alive, so their ids stay unique
    todo = [out.grad_fn]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # an AccumulateGrad node's leaf
        if isinstance(variable, torch.Tensor) and variable is not stage_input:
            leaves[id(variable)] = variable
        todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return list(leaves.values())


def run_plan(
    plan: SchedulePlan,
    stages: Sequence[PipelineStage],
    inputs: torch.Tensor | None,
    targets: torch.Tensor | None,
    loss_fn: LossFn,
    *,
    placement: StagePlacement | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> StepResult:
    """One step of ``plan`` on this rank (a fresh :class:`PipelineSchedule`: its shape
    exchange runs every call; keep a schedule to run it once)."""
    schedule = PipelineSchedule(plan, stages, loss_fn, placement=placement, timeout=timeout)
    return schedule.step(inputs, targets)


def all_reduce_gradients(
    stages: Sequence[PipelineStage],
    group: dist.ProcessGroup,
    *,
    average: bool = True,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Data parallelism across pipeline replicas: sum (``average``: mean) every stage
    parameter's gradient over ``group`` (the same stage in every replica), in one flat
    collective per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for stage in stages:
        for p in stage.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    size = dist.get_world_size(group)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=group, async_op=True)
        assert work is not None
        watch_async("all_reduce (pipeline replicas' gradients)", group, work).wait(timeout)
        if average:
            flat /= size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

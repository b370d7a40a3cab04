"""``Muon``: torch.optim.Muon's update, distributed by the parameters' layouts.

Per parameter (its local data only): ``buf.lerp_(grad, 1 - momentum)``; the Newton-Schulz input
is ``grad.lerp(buf, momentum)`` with Nesterov, else ``buf``; after orthogonalization,
``param.mul_(1 - lr * weight_decay)`` and ``param.add_(update, alpha=-adjusted_lr)``. Those are
elementwise, so they run on each rank's shard exactly as they would on the whole tensor.

Newton-Schulz needs whole matrices. The step plans (:mod:`hp_muon.plan`) one owner per matrix
from the layouts, gathers each matrix to its owner in bf16, orthogonalizes it there (same-shape
matrices batched), and sends every holder its part of the result (:mod:`hp_muon.exchange`).
Parameters whose layout spans one rank (plain tensors) are orthogonalized where they are.

Momentum lives with the gradient: sharded exactly like the parameter. The EMA is elementwise,
so it needs no communication there; it takes ``1/N`` of the memory of a whole-matrix buffer;
and the state dict is laid out like the parameters, which is what
``torch.distributed.checkpoint`` reshards. Keeping it on the owner instead would save nothing
on the wire (the owner needs the gradient pieces every step anyway) and would tie the state to
the owner assignment.

A NaN or inf gradient is refused before any of this (:mod:`hp_muon.nonfinite`): Newton-Schulz
would spread it over its whole matrix and the exchange to every rank holding a piece, so every
rank of the step learns of it through one small all-reduce and raises (or skips the step).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.distributed as dist
from torch.optim.optimizer import Optimizer, ParamsT

from hp_layout import Mesh
from hp_muon.checks import check_muon_params
from hp_muon.coefficients import KELLER, Coefficients, CoefficientSpec, coefficient_schedule
from hp_muon.exchange import ExchangeStats, piece_view, run_program
from hp_muon.newton_schulz import default_dtype, orthogonalize_counted
from hp_muon.nonfinite import (
    NONFINITE_POLICIES,
    NonFiniteGradient,
    NonFiniteGradientError,
    NonFinitePolicy,
    find_nonfinite_gradient,
)
from hp_muon.plan import MatrixTensor, MuonPlan, RankProgram, rank_program
from hp_muon.plan_check import check_muon_plan
from hp_muon.step_plan import MuonStepPlan, bucket_numel, plan_muon
from hp_muon.tensors import global_shape, like_param, local_data, local_grad, planning_layout

__all__ = ["Muon", "MuonStepStats", "adjusted_lr"]

_ADJUST_LR_FNS = ("original", "match_rms_adamw")
_MOMENTUM = "momentum_buffer"


def adjusted_lr(
    lr: float | torch.Tensor, adjust_lr_fn: str | None, rows: int, cols: int
) -> float | torch.Tensor:
    """The learning rate applied to a ``rows x cols`` orthogonalized update.

    ``"original"`` (or ``None``): ``lr * sqrt(max(1, rows / cols))`` (Keller Jordan);
    ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(rows, cols))`` (Moonshot, arXiv 2502.16982),
    so that the update's RMS matches AdamW's and AdamW's lr and weight decay carry over.
    A tensor ``lr`` gives a tensor (computed in its dtype, as torch does).
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be one of {_ADJUST_LR_FNS} or None, got {adjust_lr_fn!r}")


@dataclass(frozen=True)
class MuonStepStats:
    """What this rank did in the last step (sum over ranks for the whole step).

    Attributes:
        matrices: matrices in the step (the same on every rank that holds them all).
        orthogonalized: matrices this rank orthogonalized.
        newton_schulz_runs: Newton-Schulz runs this rank issued: each is one call of
            :func:`hp_muon.orthogonalize` (one matrix) or :func:`hp_muon.orthogonalize_batch`
            (a batch of same-shape matrices, a shape and its transpose together). Without
            ``fuse_shapes`` it equals ``orthogonalized``; with it, one per shape class (and
            per group settings) among the matrices this rank owns. Summed over the ranks it is
            the job's runs for the step; 0 on a rank means it orthogonalized nothing (and a
            step in which every rank reports 0 orthogonalized nothing at all).
        elements_sent: elements this rank sent to other ranks.
        bytes_sent: bytes this rank sent to other ranks.
        collectives: all-to-all calls this rank issued.
    """

    matrices: int
    orthogonalized: int
    newton_schulz_runs: int
    elements_sent: int
    bytes_sent: int
    collectives: int


# Newton-Schulz settings of a matrix: its schedule, eps and dtype (None: the hardware's).
_Settings = tuple[tuple[Coefficients, ...], float, torch.dtype | None]


@dataclass(frozen=True)
class _Found:
    """A parameter with a gradient at this step, before its momentum is updated."""

    param: torch.Tensor
    grad: torch.Tensor  # its local gradient
    index: int  # its position among every group's parameters
    group: dict[str, Any]
    settings: _Settings
    name: str
    spec: MatrixTensor


@dataclass
class _Entry:
    param: torch.Tensor
    update: torch.Tensor  # flat bf16 local Newton-Schulz input
    spec: MatrixTensor
    settings: _Settings
    lr: float | torch.Tensor  # a tensor lr stays one: torch computes with it in its dtype
    weight_decay: float
    adjust_lr_fn: str | None


@dataclass(frozen=True)
class _Prepared:
    plan: MuonStepPlan
    programs: tuple[RankProgram, ...]  # this rank's part of each group's plan


def _scalar(value: float | torch.Tensor) -> float | torch.Tensor:
    return value.squeeze() if isinstance(value, torch.Tensor) else float(value)


def _row_blocks(option: int | Sequence[int] | None, shape: Sequence[int]) -> tuple[int, ...] | None:
    if option is None:
        return None
    rows = shape[-2]
    if isinstance(option, int) and not isinstance(option, bool):
        if option <= 0 or rows % option:
            raise ValueError(
                f"row_blocks={option}: a block size must be positive and divide the {rows} rows "
                f"of each matrix of a parameter of shape {tuple(shape)}"
            )
        return (option,) * (rows // option)
    if isinstance(option, bool):
        raise TypeError(f"row_blocks must be an int or a sequence of ints, got {option!r}")
    blocks = tuple(int(b) for b in option)
    if any(b <= 0 for b in blocks) or sum(blocks) != rows:
        raise ValueError(
            f"row_blocks={blocks} must be positive sizes summing to the {rows} rows of each "
            f"matrix of a parameter of shape {tuple(shape)}"
        )
    return blocks


# Per-group options of hp-muon's Muon that torch.optim.Muon has no key for.
_HP_GROUP_OPTIONS = ("row_blocks", "ns_dtype")


class Muon(Optimizer):
    """Muon (momentum orthogonalized by Newton-Schulz) for parameters of any layout.

    On one device it computes exactly what ``torch.optim.Muon`` computes (bit for bit; see
    :mod:`hp_muon.newton_schulz` for batched runs). On several ranks, each matrix is
    orthogonalized once, by one owner, and every rank updates its own shard.

    Args:
        params: parameters (at least 2-D; a parameter with more dims is a batch of matrices
            over its last two dims, e.g. MoE experts ``[E, out, in]``) or parameter groups.
            Optimize 1-D parameters, embeddings and usually the LM head with AdamW
            (:func:`hp_muon.split_params`, :class:`hp_muon.ChainedOptimizer`).
        lr: learning rate (float or 1-element tensor).
        weight_decay: decoupled weight decay, applied with the unadjusted ``lr``.
        momentum: EMA momentum factor.
        nesterov: use ``grad.lerp(buf, momentum)`` as the Newton-Schulz input.
        ns_coefficients: ``(a, b, c)`` for every step, a sequence of them (one per step, the
            last repeating), or a preset name (:data:`hp_muon.PRESETS`).
        eps: lower clamp of the Frobenius norm the input is divided by.
        ns_steps: Newton-Schulz steps (fewer than 100).
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"`` (see :func:`adjusted_lr`);
            computed from each matrix's own shape.
        row_blocks: (also a per-group option) cut each matrix's rows into blocks orthogonalized
            separately: an int (block size, e.g. a head's rows) or a tuple of sizes (a fused
            QKV weight's Q, K and V rows). ``None``: whole matrices.
        process_group: the group carrying the exchanges; it must contain every rank of every
            parameter's mesh. Default: the default (world) group.
        replicate_group: take plain (layout-less) parameters as replicated over this group,
            as under DDP: each matrix is orthogonalized by one rank of it and broadcast in the
            scatter. ``None``: plain parameters are orthogonalized on every rank.
        bucket_cap_mb: size of the matrices in one exchange bucket (bf16 MiB).
        fuse_shapes: batch same-shape matrices (and transposed shapes) in one Newton-Schulz
            run on each owner. ``None`` (default): batch on accelerators, not on CPU, where
            batched bf16 products run different kernels than torch's per-matrix ones (results
            then differ from ``torch.optim.Muon`` by bf16 rounding) and save only dispatch
            overhead.
        ns_dtype: (also a per-group option) the precision of the Newton-Schulz iteration.
            ``None`` (the default): the hardware's choice, bf16 where bf16 matmuls are fast
            (accelerators, CPUs with AVX-512 BF16 or AMX) and fp32 on CPUs without them, where
            bf16 runs tens of times slower (``hp_kernels.newton_schulz_dtype``, decided once
            per process; bf16 when hp-kernels is not installed). ``torch.bfloat16`` is
            ``torch.optim.Muon``'s on every machine (bit-equal to it on one device);
            ``torch.float32`` runs the iteration in fp32 (its input and result still travel in
            bf16, the dtype torch's have).
        plan: the step plan a planner made (:func:`hp_muon.plan_muon` on the parameters'
            layouts, this rank, the process group's ranks and ``bucket_cap_mb``). Checked at
            the first step, before any state changes, against what Muon plans: the plan covers
            the parameters that have a gradient then, and the process group's ranks and this
            rank are read then (a sharder may also still re-lay parameters between
            construction and the first step). A difference raises ``ValueError`` naming the
            rank group and the first difference (a matrix's owner, its pieces, the buckets,
            the bucket size) with both values. None: not checked.
        nonfinite: what a step does when a gradient holds a NaN or inf on any rank of the step
            (Newton-Schulz would spread it over the whole matrix, and the exchange to every
            rank holding a piece of it). Checked at every :meth:`step` before any parameter or
            momentum changes, with one fused reduction over this rank's gradients and, for a
            distributed step, one 1-element all-reduce over ``process_group``, so that every
            rank decides alike (:mod:`hp_muon.nonfinite`). ``"raise"`` (default): raise
            :class:`hp_muon.NonFiniteGradientError` on every rank, naming the first such
            parameter in parameter order (by its name where the parameters were given named,
            else ``param_groups[g][i] (shape RxC)``) and the lowest rank holding a bad piece.
            ``"skip"``: the step does nothing on every rank (no momentum or parameter change,
            gradients left as they are), adds 1 to :attr:`skipped_steps` and warns
            (``RuntimeWarning``) naming the parameter. Only this optimizer's parameters are
            checked: chained with AdamW (:class:`hp_muon.ChainedOptimizer`), AdamW's are not.

    Raises:
        ValueError: as ``torch.optim.Muon`` for a bad ``lr``, ``momentum``, ``weight_decay`` or
            ``adjust_lr_fn``, or a parameter with fewer than 2 dims (by its global shape:
            a flat FSDP piece of a matrix is accepted, a piece of a bias is not; the message
            names the parameter); for a group with no parameters (torch accepts one and steps
            nothing); and for bad ``row_blocks`` or ``bucket_cap_mb``. At :meth:`step`, for
            ``ns_steps >= 100`` or bad ``ns_coefficients`` (``ValueError``), complex parameters
            and sparse gradients (``RuntimeError``), as torch does; for ``nonfinite`` other
            than ``"raise"`` or ``"skip"``.
        NonFiniteGradientError: (a ``ValueError``) at :meth:`step`, a gradient holding a NaN
            or inf on any rank of the step, with ``nonfinite="raise"`` (see ``nonfinite``).

    Attributes:
        last_step_stats: what this rank did in the last :meth:`step`
            (:class:`MuonStepStats`: matrices, Newton-Schulz runs, traffic), None before the
            first.
        newton_schulz_runs: Newton-Schulz runs this rank issued over every step so far (the
            sum of ``last_step_stats.newton_schulz_runs``). Only :meth:`step` adds to it: under
            gradient accumulation it grows by one step's runs per optimizer step, never per
            micro-batch.
        skipped_steps: steps skipped for a non-finite gradient (``nonfinite="skip"``) since
            construction; not part of the state dict.
        steps_jointly: True (class attribute): a step couples its parameters (one exchange
            over every matrix with a gradient, entered by every rank of the process group),
            so a wrapper that steps parameters in parts must hand it all of them in one call
            (``hp_offload.OffloadedOptimizer`` reads this attribute).
    """

    steps_jointly: ClassVar[bool] = True

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: CoefficientSpec = KELLER,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        row_blocks: int | Sequence[int] | None = None,
        process_group: dist.ProcessGroup | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 32.0,
        fuse_shapes: bool | None = None,
        ns_dtype: torch.dtype | None = None,
        plan: MuonStepPlan | None = None,
        nonfinite: NonFinitePolicy = "raise",
    ) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"nonfinite must be one of {NONFINITE_POLICIES} (raise at a non-finite "
                f"gradient, or skip such steps), got {nonfinite!r}"
            )
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got {lr.numel()} elements")
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in _ADJUST_LR_FNS:
            raise ValueError(
                f"Adjust learning rate function {adjust_lr_fn} is not supported; use one of "
                f"{_ADJUST_LR_FNS} or None"
            )
        bucket_numel(bucket_cap_mb)  # checked here, at construction
        defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "row_blocks": row_blocks,
            "ns_dtype": ns_dtype,
        }
        self._process_group = process_group
        self._replicate_group = replicate_group
        self._replicas: Mesh | None = None
        self._bucket_cap_mb = bucket_cap_mb
        self._fuse = fuse_shapes
        self._prepared: dict[tuple[Any, ...], _Prepared] = {}
        self._given_plan = plan
        self._plan_checked = False
        self._last_plan: MuonStepPlan | None = None
        self.last_step_stats: MuonStepStats | None = None
        self.newton_schulz_runs = 0
        self._nonfinite: NonFinitePolicy = nonfinite
        self.skipped_steps = 0
        super().__init__(params, defaults)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (``torch.optim.Muon``'s loads too). Group options torch's Muon does
        not have (``row_blocks``, ``ns_dtype``) keep this optimizer's values where the loaded
        groups lack them, so loading torch's state never changes what was constructed here."""
        own = [{k: g[k] for k in _HP_GROUP_OPTIONS if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, options in zip(self.param_groups, own, strict=True):
            for key, value in options.items():
                group.setdefault(key, value)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, checked (:func:`hp_muon.check_muon_params`): at least one parameter,
        every parameter's global shape at least 2-D (a flat FSDP piece of a matrix counts by
        its layout's shape), row blocks fitting. A refused group is not added."""
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        try:
            check_muon_params(
                group["params"], f"Muon parameter group {index}", names=group.get("param_names")
            )
            for p in group["params"]:
                _row_blocks(group.get("row_blocks"), global_shape(p))
        except ValueError:
            self.param_groups.pop()
            raise

    # Step ---------------------------------------------------------------------------------------

    def _replica_mesh(self) -> Mesh | None:
        if self._replicate_group is None:
            return None
        if self._replicas is None:
            ranks = tuple(dist.get_process_group_ranks(self._replicate_group))
            self._replicas = Mesh((len(ranks),), ("replicate",), ranks)
        return self._replicas

    def _with_grads(self) -> list[_Found]:
        """The parameters with a gradient, in order, with what planning reads of them.

        Raises:
            RuntimeError: a complex parameter or a sparse gradient (as torch).
            ValueError: a gradient laid out unlike its parameter.
        """
        replicas = self._replica_mesh()
        found: list[_Found] = []
        index = 0
        for group in self.param_groups:
            schedule = coefficient_schedule(group["ns_coefficients"], group["ns_steps"])
            settings: _Settings = (schedule, float(group["eps"]), group.get("ns_dtype"))
            names = group.get("param_names")
            for position, p in enumerate(group["params"]):
                index += 1
                if p.grad is None:
                    continue
                if torch.is_complex(p):
                    raise RuntimeError(
                        f"Muon does not support complex parameters (parameter {index - 1})"
                    )
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"Muon does not support sparse gradients (parameter {index - 1})"
                    )
                grad = local_grad(p, index - 1)
                name = str(names[position]) if names else ""
                spec = MatrixTensor(
                    planning_layout(p, replicas),
                    _row_blocks(group.get("row_blocks"), global_shape(p)),
                )
                found.append(_Found(p, grad, index - 1, group, settings, name, spec))
        return found

    def _entries(self, found: Sequence[_Found]) -> list[_Entry]:
        """Update each parameter's momentum; its Newton-Schulz input (bf16, flat)."""
        entries: list[_Entry] = []
        for f in found:
            group, p, grad, i = f.group, f.param, f.grad, f.index
            momentum, nesterov = group["momentum"], group["nesterov"]
            state = self.state[p]
            if _MOMENTUM not in state:
                state[_MOMENTUM] = like_param(p, torch.zeros_like(grad))
            buf = local_data(state[_MOMENTUM])
            if buf.shape != grad.shape:
                raise ValueError(
                    f"parameter {i}: momentum buffer of local shape {tuple(buf.shape)} does "
                    f"not match its local gradient {tuple(grad.shape)} (state loaded for "
                    "another layout? load optimizer state through a sharded state dict)"
                )
            buf.lerp_(grad, 1 - momentum)
            update = grad.lerp(buf, momentum) if nesterov else buf
            entries.append(
                _Entry(
                    param=p,
                    update=update.bfloat16().reshape(-1),
                    spec=f.spec,
                    settings=f.settings,
                    lr=_scalar(group["lr"]),
                    weight_decay=float(group["weight_decay"]),
                    adjust_lr_fn=group["adjust_lr_fn"],
                )
            )
        return entries

    def _prepare(
        self, found: Sequence[_Found], rank: int, group: dist.ProcessGroup | None
    ) -> _Prepared:
        """The step plan (:func:`hp_muon.plan_muon`, cached per layouts) and this rank's
        programs; at the first step, checked against the plan given to the constructor."""
        group_ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else None
        key = (tuple(f.spec for f in found), rank, group_ranks, self._bucket_cap_mb)
        prepared = self._prepared.get(key)
        if prepared is None:
            plan = plan_muon(
                [(f.name or f"parameter {f.index}", f.spec) for f in found],
                bucket_cap_mb=self._bucket_cap_mb,
                group_ranks=group_ranks,
                rank=rank,
            )
            programs = tuple(rank_program(g.plan, rank, g.ranks) for g in plan.groups)
            prepared = _Prepared(plan, programs)
            if len(self._prepared) > 8:  # layouts changed (resharding): forget old plans
                self._prepared.clear()
            self._prepared[key] = prepared
        if self._given_plan is not None and not self._plan_checked:
            check_muon_plan(prepared.plan, self._given_plan)
            self._plan_checked = True
        self._last_plan = prepared.plan
        return prepared

    def planned(self) -> MuonStepPlan | None:
        """The step plan of the last :meth:`step` (what :func:`hp_muon.plan_muon` returns for
        the parameters that had gradients, this rank and the process group), None before the
        first step."""
        return self._last_plan

    def _orthogonalizer(
        self, plan: MuonPlan, entries: Sequence[_Entry], runs: list[int]
    ) -> Callable[[Sequence[int], Sequence[torch.Tensor]], list[torch.Tensor]]:
        """The executor's orthogonalize callback; adds its Newton-Schulz runs to ``runs[0]``."""

        def run(jobs: Sequence[int], matrices: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            by_settings: dict[_Settings, list[int]] = {}
            for k, j in enumerate(jobs):
                by_settings.setdefault(entries[plan.jobs[j].tensor].settings, []).append(k)
            out: list[torch.Tensor | None] = [None] * len(jobs)
            for (schedule, eps, ns_dtype), members in by_settings.items():
                chosen = [matrices[k] for k in members]
                device = chosen[0].device
                fuse = self._fuse if self._fuse is not None else device.type != "cpu"
                dtype = ns_dtype if ns_dtype is not None else default_dtype(device)
                results, issued = orthogonalize_counted(
                    chosen, schedule, eps, fuse=fuse, dtype=dtype
                )
                runs[0] += issued
                for k, r in zip(members, results, strict=True):
                    out[k] = r
            return [cast(torch.Tensor, o) for o in out]

        return run

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step over every parameter with a gradient (collective over the ranks of
        distributed parameters: every rank of ``process_group`` must call it).

        Raises:
            NonFiniteGradientError: a gradient holds a NaN or inf on some rank of the step
                (``nonfinite="raise"``); raised on every rank, before anything changed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = self._with_grads()
        me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        spread = any(f.spec.layout.mesh.size > 1 for f in found)
        group = (self._process_group or dist.group.WORLD) if spread else None
        # Before any state changes, and agreed over the exchange's group: a NaN on one rank
        # would reach every holder of its matrix through the exchange.
        bad = find_nonfinite_gradient([(f.index, f.grad) for f in found], group=group)
        if bad is not None:
            self._refuse(bad)
            return loss
        prepared = self._prepare(found, me, group)  # checked before any state changes
        entries = self._entries(found)
        outputs: dict[int, torch.Tensor] = {
            id(e): torch.empty(e.update.numel(), dtype=torch.bfloat16, device=e.update.device)
            for e in entries
        }
        runs = [0]
        stats = self._exchange(prepared, entries, outputs, group, runs)
        for g in prepared.plan.groups:
            self._apply([entries[i] for i in g.indices], g.plan, outputs, me)
        self.last_step_stats = MuonStepStats(
            matrices=sum(len(g.plan.jobs) for g in prepared.plan.groups),
            orthogonalized=sum(s.orthogonalized for s in stats),
            newton_schulz_runs=runs[0],
            elements_sent=sum(s.elements_sent for s in stats),
            bytes_sent=sum(s.bytes_sent for s in stats),
            collectives=sum(s.collectives for s in stats),
        )
        self.newton_schulz_runs += runs[0]
        return loss

    def _label(self, index: int) -> tuple[str, str]:
        """Parameter ``index`` (over all groups, in order) as an error names it and as its
        message writes it: ``name`` and ``'name'`` where the optimizer has names, else
        ``param_groups[g][i] (shape RxC)`` (the whole parameter's shape) for both."""
        start = 0
        for g, group in enumerate(self.param_groups):
            params = group["params"]
            if index < start + len(params):
                position = index - start
                names = group.get("param_names")
                if names:
                    name = str(names[position])
                    return name, repr(name)
                shape = "x".join(str(n) for n in global_shape(params[position]))
                label = f"param_groups[{g}][{position}] (shape {shape})"
                return label, label
            start += len(params)
        raise IndexError(f"parameter {index} is not in this optimizer ({start} parameters)")

    def _refuse(self, bad: NonFiniteGradient) -> None:
        """Raise :class:`NonFiniteGradientError` for ``bad``, or (``nonfinite="skip"``) count
        and warn; nothing else changes either way."""
        name, label = self._label(bad.index)
        what = f"Muon.step: the gradient of {label} is non-finite ({bad.value}) on rank {bad.rank}"
        local = [self._label(i) for i in bad.local]
        if local and bad.local != (bad.index,):
            what += f" (non-finite on this rank: {', '.join(shown for _, shown in local)})"
        if self._nonfinite == "raise":
            raise NonFiniteGradientError(
                f"{what}; no parameter was updated. Lower the learning rate, clip gradients, "
                "or pass nonfinite='skip' to skip such steps",
                parameter=name,
                index=bad.index,
                rank=bad.rank,
                value=bad.value,
                local_parameters=tuple(named for named, _ in local),
            )
        self.skipped_steps += 1
        self.last_step_stats = MuonStepStats(
            matrices=0,
            orthogonalized=0,
            newton_schulz_runs=0,
            elements_sent=0,
            bytes_sent=0,
            collectives=0,
        )
        warnings.warn(
            f"{what}; skipped the step on every rank (no parameter or momentum changed, "
            f"gradients left as they are; {self.skipped_steps} skipped so far)",
            RuntimeWarning,
            stacklevel=3,
        )

    def _exchange(
        self,
        prepared: _Prepared,
        entries: Sequence[_Entry],
        outputs: dict[int, torch.Tensor],
        group: dist.ProcessGroup | None,
        runs: list[int],
    ) -> list[ExchangeStats]:
        """Orthogonalize every group's matrices into ``outputs``: the exchanged group over
        ``group``, the single-rank one while its first gather is in flight."""
        stats: list[ExchangeStats] = []
        groups = prepared.plan.groups

        def run(k: int, while_first_gather: Callable[[], None] | None = None) -> None:
            g = groups[k]
            chosen = [entries[i] for i in g.indices]
            stats.append(
                run_program(
                    prepared.programs[k],
                    g.plan,
                    [e.update for e in chosen],
                    [outputs[id(e)] for e in chosen],
                    self._orthogonalizer(g.plan, chosen, runs),
                    group=None if g.local else group,
                    while_first_gather=while_first_gather,
                )
            )

        def run_local() -> None:
            for k, g in enumerate(groups):
                if g.local:
                    run(k)

        spread = [k for k, g in enumerate(groups) if not g.local]
        if spread:
            run(spread[0], run_local)
        else:
            run_local()
        return stats

    def _apply(
        self, entries: Sequence[_Entry], plan: MuonPlan, outputs: dict[int, torch.Tensor], me: int
    ) -> None:
        jobs_of: dict[int, list[int]] = {}
        for j, job in enumerate(plan.jobs):
            jobs_of.setdefault(job.tensor, []).append(j)
        for t, entry in enumerate(entries):
            param = local_data(entry.param)
            update = outputs[id(entry)]
            param.mul_(1 - entry.lr * entry.weight_decay)
            shapes = {plan.jobs[j].shape for j in jobs_of.get(t, [])}
            if len(shapes) <= 1:
                rows, cols = shapes.pop() if shapes else (1, 1)
                rate = adjusted_lr(entry.lr, entry.adjust_lr_fn, rows, cols)
                # A 0-d tensor alpha works at runtime (torch.optim.Muon passes one too).
                param.add_(update.view(param.shape), alpha=cast(float, -rate))
                continue
            # Row blocks of different shapes: each block has its own adjusted lr.
            if not param.is_contiguous():
                raise ValueError(
                    "row blocks of different sizes need a contiguous local parameter to update "
                    f"block by block; parameter {t} has strides {param.stride()}"
                )
            flat = param.view(-1)
            for j in jobs_of[t]:
                job = plan.jobs[j]
                rate = adjusted_lr(entry.lr, entry.adjust_lr_fn, *job.shape)
                for piece in job.targets:
                    if piece.rank == me:
                        piece_view(flat, piece).add_(
                            piece_view(update, piece), alpha=cast(float, -rate)
                        )

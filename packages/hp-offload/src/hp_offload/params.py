"""Parameter offload with prefetch: parameters and gradients live on the host between uses.

:func:`offload_parameters` splits a model into *units* (by default its blocks: the children
of the root, with ``ModuleList``/``ModuleDict`` containers expanded) and keeps every unit's
parameters in host memory (pinned on accelerators). Through public module hooks only:

* forward: the root's pre-hook prefetches the first ``prefetch`` units; each unit's pre-hook
  prefetches the next ``prefetch`` units and waits for its own copy; its post-hook puts the
  host tensors back (the device copies are freed) and, when the output needs gradients,
  registers a pre-backward hook on it (``torch.autograd.graph.register_multi_grad_hook``);
* backward: a unit's pre-backward hook loads it again (with its accumulated host gradient,
  if any) and prefetches the ``prefetch`` units that ran before it; once every parameter of the
  unit has accumulated its gradient (``register_post_accumulate_grad_hook``) the gradients are
  written back to host buffers and the unit is released; a final callback of the backward
  releases whatever remains and synchronizes, so after ``backward()`` every ``p.grad`` of an
  offloaded parameter is a complete host tensor.

Between forward/backward passes parameters and gradients are host tensors, so any optimizer can
step them in host memory, or :class:`hp_offload.OffloadedOptimizer` (``device=`` the
accelerator) streams them through the device bucket by bucket. Buffers (non-parameter tensors)
are not moved. Each unit may run once per forward while gradients are enabled.

Event log entries ``(event, unit)``: ``"prefetch"`` (copy issued ahead of use), ``"fetch"``
(copy issued on demand: a prefetch miss), ``"forward"``/``"backward"`` (the unit's compute
may start), ``"release"`` (device copy dropped after forward), ``"keep"`` (the last unit stays
on the device from its forward into its backward, which comes next), ``"offload_grads"``
(gradients written back, device copy dropped after backward).

Composition: with plain DP (DDP) or HSDP-by-replication the gradient all-reduce sees host
gradients after backward (all-reduce them there, or use the DDP comm hook on the device
copies). With FSDP (torch ``fully_shard`` or hp-fsdp) the sharder owns its parameters' storage:
offload those with the sharder's own CPU offload policy and give :func:`offload_parameters`
only modules the sharder does not manage (``units=``); both work through module hooks, and
hooks of one module run in registration order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hp_offload.streams import CopyEvent, Transfers, TransferStats

__all__ = ["ParameterOffload", "default_units", "offload_parameters"]


def default_units(model: nn.Module) -> list[nn.Module]:
    """The children of ``model`` that own parameters, ``ModuleList``/``ModuleDict`` expanded
    (recursively), in registration order."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList | nn.ModuleDict):
                visit(child)
            elif any(True for _ in child.parameters()):
                units.append(child)

    visit(model)
    return units


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


@dataclass
class _Unit:
    index: int
    module: nn.Module
    params: list[nn.Parameter]
    host: dict[nn.Parameter, torch.Tensor]
    grad_buffers: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    status: str = "host"  # "host" | "fetching" | "loaded"
    backward: bool = False
    ready: CopyEvent | None = None
    data: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    grad: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict)
    stashed_grad: dict[nn.Parameter, torch.Tensor | None] = field(default_factory=dict)
    accumulated: int = 0

    @property
    def trainable(self) -> int:
        return sum(p.requires_grad for p in self.params)


class ParameterOffload:
    """Handle of an active parameter offload (see :func:`offload_parameters`).

    Attributes:
        units: the offloaded modules, in prefetch order.
        event_log: ``(event, unit index)`` entries since the last :meth:`clear_log`.
        stats: cumulative host<->device copy counters.
    """

    def __init__(
        self, model: nn.Module, units: Sequence[nn.Module], prefetch: int, transfers: Transfers
    ) -> None:
        self.model = model
        self.prefetch = prefetch
        self.transfers = transfers
        self.stats: TransferStats = transfers.stats
        self.event_log: list[tuple[str, int]] = []
        self._units: list[_Unit] = []
        self._of_param: dict[nn.Parameter, _Unit] = {}
        self._order: list[int] = []
        self._in_backward = False
        self._pending: list[tuple[CopyEvent, list[torch.Tensor]]] = []
        self._handles: list[RemovableHandle] = []
        self._setup(units)

    @property
    def units(self) -> tuple[nn.Module, ...]:
        return tuple(u.module for u in self._units)

    def host_tensor(self, param: nn.Parameter) -> torch.Tensor:
        """The host tensor holding ``param`` between uses (KeyError if not offloaded)."""
        return self._of_param[param].host[param]

    def clear_log(self) -> None:
        """Postcondition: :attr:`event_log` is empty."""
        self.event_log.clear()

    def remove(self) -> None:
        """Remove every hook. Postcondition: parameters and gradients stay host tensors."""
        self._finish()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- setup ----------------------------------------------------------------------------
    def _setup(self, modules: Sequence[nn.Module]) -> None:
        t = self.transfers
        owner: dict[nn.Parameter, int] = {}
        for index, module in enumerate(modules):  # validate everything before moving anything
            for p in module.parameters():
                if p in owner:
                    raise ValueError(
                        f"parameter {tuple(p.shape)} belongs to units {owner[p]} and {index}: "
                        "units must not share parameters (tied or nested units)"
                    )
                if p.device not in (t.host, t.device):
                    raise ValueError(
                        f"parameter {tuple(p.shape)} of unit {index} is on {p.device}, neither "
                        f"the host {t.host} nor the device {t.device}"
                    )
                owner[p] = index
        missing = [n for n, p in self.model.named_parameters() if p not in owner]
        if missing:
            raise ValueError(
                f"parameters {missing} belong to no unit; pass units= covering every parameter"
            )
        for index, module in enumerate(modules):
            unit = _Unit(index, module, list(module.parameters()), {})
            for p in unit.params:
                self._of_param[p] = unit
                host = t.to_host_copy(p.detach())
                grad = p.grad
                p.grad = None
                p.data = host
                unit.host[p] = host
                if grad is not None:
                    p.grad = t.to_host_copy(grad)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
            self._units.append(unit)
            self._handles.append(module.register_forward_pre_hook(self._pre_forward_hook(unit)))
            self._handles.append(module.register_forward_hook(self._post_forward_hook(unit)))
        self._handles.append(self.model.register_forward_pre_hook(self._begin_forward))

    # -- movement -------------------------------------------------------------------------
    def _fetch(self, unit: _Unit, *, backward: bool, ahead: bool) -> None:
        if unit.status != "host":
            return
        sources = [unit.host[p] for p in unit.params]
        with_grad = [p for p in unit.params if backward and p.grad is not None]
        sources += [p.grad for p in with_grad if p.grad is not None]
        copies, unit.ready = self.transfers.h2d(sources)
        n = len(unit.params)
        unit.data = dict(zip(unit.params, copies[:n], strict=True))
        unit.grad = dict(zip(with_grad, copies[n:], strict=True))
        unit.status, unit.backward = "fetching", backward
        self.event_log.append(("prefetch" if ahead else "fetch", unit.index))

    def _load(self, unit: _Unit, *, backward: bool) -> None:
        self._fetch(unit, backward=backward, ahead=False)
        if unit.status == "loaded":
            return
        assert unit.ready is not None
        unit.ready.wait_on_compute(self.transfers)
        for p in unit.params:
            unit.stashed_grad[p] = None if unit.backward else p.grad
            p.grad = None
            p.data = unit.data[p]
            p.grad = unit.grad.get(p)
        unit.status, unit.accumulated = "loaded", 0

    def _release_forward(self, unit: _Unit) -> None:
        for p in unit.params:
            p.grad = None
            p.data = unit.host[p]
            p.grad = unit.stashed_grad.get(p)
        self._drop(unit)
        self.event_log.append(("release", unit.index))

    def _keep_for_backward(self, unit: _Unit) -> None:
        """Turn a unit loaded for forward into one loaded for backward (its accumulated host
        gradients copied in), without copying its parameters again."""
        with_grad = [p for p in unit.params if unit.stashed_grad.get(p) is not None]
        sources = [g for p in with_grad if (g := unit.stashed_grad[p]) is not None]
        copies, ready = self.transfers.h2d(sources)
        ready.wait_on_compute(self.transfers)
        for p, grad in zip(with_grad, copies, strict=True):
            p.grad = grad
        unit.stashed_grad, unit.backward = {}, True
        self.event_log.append(("keep", unit.index))

    def _release_backward(self, unit: _Unit) -> None:
        t = self.transfers
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p in unit.params:
            grad = p.grad
            p.grad = None
            p.data = unit.host[p]
            if grad is None:
                continue
            buf = unit.grad_buffers.get(p)
            if buf is None or buf.shape != grad.shape or buf.dtype != grad.dtype:
                buf = unit.grad_buffers[p] = t.host_empty_like(grad)
            pairs.append((grad, buf))
            p.grad = buf
        if pairs:
            self._pending.append((t.d2h(pairs), [g for g, _ in pairs]))
        self._drop(unit)
        self.event_log.append(("offload_grads", unit.index))

    def _drop(self, unit: _Unit) -> None:
        unit.data, unit.grad, unit.stashed_grad = {}, {}, {}
        unit.status, unit.ready, unit.accumulated = "host", None, 0

    def _finish(self) -> None:
        """Release every loaded unit and complete pending gradient write-backs."""
        for unit in self._units:
            if unit.status == "loaded" and unit.backward:
                self._release_backward(unit)
            elif unit.status != "host":
                if unit.status == "fetching":
                    self._load(unit, backward=unit.backward)
                self._release_forward(unit)
        for event, keep in self._pending:
            event.wait_on_compute(self.transfers)
            keep.clear()
        if self._pending:
            self._pending[-1][0].synchronize()
        self._pending.clear()
        self._in_backward = False

    # -- hooks ----------------------------------------------------------------------------
    def _begin_forward(self, module: nn.Module, args: Any) -> None:
        self._finish()
        self._order = []
        for unit in self._units[: self.prefetch]:
            self._fetch(unit, backward=False, ahead=True)

    def _pre_forward_hook(self, unit: _Unit) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled() and unit.index in self._order:
                raise RuntimeError(
                    f"unit {unit.index} ({type(module).__name__}) ran twice in one forward with "
                    "gradients enabled: parameter offload needs each unit to run once per pass"
                )
            self._order.append(unit.index)
            self._fetch(unit, backward=False, ahead=False)
            ahead = self._units[unit.index + 1 : unit.index + 1 + self.prefetch]
            for other in ahead:
                self._fetch(other, backward=False, ahead=True)
            self._load(unit, backward=False)
            self.event_log.append(("forward", unit.index))

        return hook

    def _post_forward_hook(self, unit: _Unit) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            needs = [t for t in _tensors(output) if t.requires_grad]
            if needs and unit.trainable:
                torch.autograd.graph.register_multi_grad_hook(
                    needs, lambda grads: self._pre_backward(unit), mode="any"
                )
            if needs and unit.trainable and unit.index == len(self._units) - 1:
                self._keep_for_backward(unit)  # backward starts with it: no round trip
            else:
                self._release_forward(unit)

        return hook

    def _pre_backward(self, unit: _Unit) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._fetch(unit, backward=True, ahead=False)
        position = self._order.index(unit.index) if unit.index in self._order else 0
        earlier = self._order[max(0, position - self.prefetch) : position]
        for index in reversed(earlier):
            self._fetch(self._units[index], backward=True, ahead=True)
        self._load(unit, backward=True)
        self.event_log.append(("backward", unit.index))

    def _on_grad(self, param: torch.Tensor) -> None:
        assert isinstance(param, nn.Parameter)
        unit = self._of_param[param]
        if unit.status != "loaded" or not unit.backward:
            return
        unit.accumulated += 1
        if unit.accumulated == unit.trainable:
            self._release_backward(unit)


def offload_parameters(
    model: nn.Module,
    *,
    prefetch: int = 1,
    units: Iterable[nn.Module] | None = None,
    device: torch.device | str | None = None,
    host: torch.device | str = "cpu",
) -> ParameterOffload:
    """Keep ``model``'s parameters and gradients on ``host``, moving each unit to ``device``
    just ahead of its forward and its backward.

    Args:
        model: the module whose forward drives the passes (its pre-hook starts each pass).
        prefetch: how many units ahead (forward) or behind (backward) to copy in advance;
            0 copies each unit on demand.
        units: disjoint modules covering every parameter (default: :func:`default_units`).
        device: compute device (default: the current accelerator, else the CPU).
        host: where parameters and gradients live between uses.

    Postconditions: every parameter's data is its host tensor (:meth:`ParameterOffload.
    host_tensor`) outside forward/backward; after ``backward()`` gradients are complete host
    tensors; a forward/backward computes exactly what it computes without offload.

    Raises:
        ValueError: negative ``prefetch``, units sharing parameters, parameters outside every
            unit, parameters neither on the host nor on the device.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    chosen = default_units(model) if units is None else list(units)
    if not chosen:
        raise ValueError("no units to offload: the model has no parameters")
    return ParameterOffload(model, chosen, prefetch, Transfers(device, host))

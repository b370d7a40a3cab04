"""The edge of a production-mode model: where its gradient convention meets the caller's.

Two conventions exist for the gradient of a value replicated over the parallel axis:

* **adjoint**, inside the model: each rank holds a partial gradient and the true gradient is
  their sum. A row-parallel output's all-reduce then costs one all-reduce in backward however
  many column-parallel projections read it, and replicated parameters' partial gradients are
  summed in one bucketed collective (:mod:`hp_dtensor.parallel._grad_reduction`);
* **exact**, in the caller's code: the caller's tensors are plain and the same on every rank,
  so autograd gives every rank the whole gradient of whatever the caller computes from them
  (torch's tensor parallelism and Megatron keep this convention everywhere).

A *region* is one call of a module of the model made from outside any other call of the
model's modules: the root called by a training loop, and just as well a submodule the caller
runs itself (``model.down(relu(model.up(x)))``, a Hugging Face ``model.model(ids)`` followed
by ``model.lm_head(h)``). Calls made inside a region are part of it. At the region's edge:

* a replicated tensor the call hands out (anywhere in its output structure) gets the caller's
  whole gradient once: coordinate 0 keeps it, the others pass zeros (or, for a tensor gathered
  from shards, each rank's shard takes its slice of it, with no collective);
* a replicated tensor the caller passes in that requires grad hands back the sum of its
  partial gradients (one all-reduce over the axis in backward), whole on every rank;
* sharded tensors have the same gradient in both conventions: nothing happens to them;
* a parameter with a recorded gradient reduction is read inside the region through a marker
  (a view of it, swapped into every module registering it while the region lasts, so a
  forward reading a submodule's parameter directly reads a marker too, and again, freshly,
  for each call of its own module): a marker's backward stashes that use's partial gradient
  in the bucket, which reduces it; a use outside any region (a penalty on the parameter in the
  loss) reaches ``.grad`` directly, whole, as the exact convention gives it. The parameter
  stays in the graph: ``backward(inputs=params)`` (a zero-bubble pipeline's weight pass)
  reaches it. ``torch.autograd.grad`` over parameters is not supported: the reduced gradient
  goes to ``.grad``.

So every way of forming the loss gets the single-device gradient: the root's output, a chain of
submodules, several forwards of one module, intermediate outputs the model returns, parameters
used directly. Two cases are refused or left out, never scaled silently:

* under sequence or context parallelism (activations sharded on a dim other than the last), a
  tensor that requires grad and crosses the edge with no recorded placement (the caller
  computed it) could be a sequence shard or a replicated value: :class:`PlanError`, naming the
  module;
* a tensor taken out of the model by other means than a call's output (a forward hook the
  caller registers on an inner module) carries the adjoint convention; use
  :func:`hp_dtensor.parallel.partial_gradients_of` on it to read it in the caller's convention.

Recompute: activation checkpointing reruns a forward inside backward. A rerun follows what
the original call did (its edge conversions if that call was a region, the parameter markers
in any case), so reentrant checkpointing, whose rerun is the graph that backward walks, gets
the same gradients; non-reentrant checkpointing only reads the rerun's saved tensors, which
the markers and conversions do not change. Under ``torch.compile`` the hooks step aside
(compiled modules are inner calls of an uncompiled root).

A model whose ranks each compute a loss of their own over the axis (expert parallelism: each
rank routes its own tokens) has no region: there the caller's gradients are each rank's own
contribution, which is the adjoint convention already.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

import hp_dtensor._comm as _comm
from hp_dtensor.collectives import _apply
from hp_dtensor.parallel._grad_reduction import (
    _Bucket,
    _Kind,
    grad_reduction_handed_over,
    grad_reduction_of,
    grad_region_of,
)
from hp_dtensor.parallel._structure import map_tensors
from hp_dtensor.parallel.plan import PlanError
from hp_layout import Placement, ReduceOp, Replicate, Shard

__all__ = ["Region", "keep_edge_outermost", "placement_of", "sequence_sharded", "set_placement"]

# Tensors handed on by a boundary carry their placement on the parallel axis here.
_PLACEMENT_ATTR = "_hp_dtensor_boundary_placement"
# A tensor an all-gather made: (source shard, its box in the gathered tensor).
GATHERED_FROM_ATTR = "_hp_dtensor_gathered_from"

_TOKENS = itertools.count(1)
# The id of a module's region post-hook (for keep_edge_outermost).
_POST_HOOK_ATTR = "_hp_dtensor_region_post_hook"
# The root's region (copying the model meets it and refuses).
# On a marker: the parameter it reads.
_MARKED_ATTR = "_hp_dtensor_marked_param"
REGION_ATTR = "_hp_dtensor_region"


def placement_of(value: torch.Tensor) -> Placement | None:
    """The placement a boundary recorded on ``value``, None if none did."""
    placement: Placement | None = getattr(value, _PLACEMENT_ATTR, None)
    return placement


def set_placement(value: torch.Tensor, placement: Placement) -> None:
    """Record ``value``'s placement on the parallel axis."""
    setattr(value, _PLACEMENT_ATTR, placement)


class _PartialToExact(torch.autograd.Function):
    """Identity forward; backward sums the partial gradients over the group (partial ->
    exact)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: _comm.AxisGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _comm.all_reduce(grad.contiguous(), ReduceOp.SUM, ctx.group), None


class _ExactToPartial(torch.autograd.Function):
    """Identity forward; backward keeps the exact gradient on coordinate 0 and passes zeros
    elsewhere (exact -> partial: the sum is exact and no rounding is added)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: _comm.AxisGroup) -> torch.Tensor:
        ctx.keep = group.index == 0
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad if ctx.keep else torch.zeros_like(grad)), None


class _GatheredOutput(torch.autograd.Function):
    """A gathered tensor handed to the caller, connected straight to the local shard it came
    from: the caller's gradient is whole on every rank, so the shard's gradient is its slice."""

    @staticmethod
    def forward(
        ctx: Any, source: torch.Tensor, gathered: torch.Tensor, box: tuple[tuple[int, int], ...]
    ) -> torch.Tensor:
        ctx.box = box
        return gathered.view_as(gathered)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        out = grad
        for d, (a, b) in enumerate(ctx.box):
            out = out.narrow(d, a, b - a)
        return out, None, None


class _MarkedUse(torch.autograd.Function):
    """A parameter read inside a region: identity forward (a view of the parameter, which stays
    in the graph, so ``backward(inputs=params)`` and zero-bubble weight passes reach it);
    backward stashes the use's partial gradient in the bucket, which reduces it and adds it to
    ``.grad``, and passes nothing on."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, bucket: _Bucket, kind: _Kind) -> torch.Tensor:
        ctx.param, ctx.bucket, ctx.kind = param, bucket, kind
        # An alias by detach, which selective checkpointing does not count: a block rerun
        # inside backward marks parameters its first forward saw marked outside it.
        return param.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.bucket.add(ctx.kind, ctx.param, grad)
        return None, None, None


@dataclass
class ModuleEdge:
    """What a region needs to know about one module of the model.

    Attributes:
        name: the module's qualified name (for messages).
        inputs: per positional input, the placement the plan says it arrives with (None: not
            planned, read the tensor's recorded placement).
        kwargs: per keyword input, the same.
        params: the parameters in the module's subtree whose gradient the plan reduces, as
            (owning module's path below the module, attribute name); a shared parameter once
            per owner.
        own: the names of the module's own such parameters.
        entered_last: whether the module's last call outside backward was a region.
    """

    name: str
    inputs: tuple[Placement | None, ...] = ()
    kwargs: Mapping[str, Placement | None] = field(default_factory=dict)
    params: tuple[tuple[str, str], ...] = ()
    own: tuple[str, ...] = ()
    entered_last: bool = False


class _Frame:
    __slots__ = ("entering", "swapped")

    def __init__(self, entering: bool, swapped: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        self.entering, self.swapped = entering, swapped


class _Calls(threading.local):
    """The calls of the model's modules in progress on this thread: how deep, and the one that
    opened the region (only a call at depth 0 opens one)."""

    def __init__(self) -> None:
        self.depth = 0
        self.opening: _Frame | None = None
        # Per call of a module owning reduced parameters: what its markers replaced.
        self.owned: list[list[tuple[nn.Module, str, torch.Tensor]]] = []


def _recomputing() -> bool:
    """Whether this forward runs inside a backward pass (activation checkpointing's rerun)."""
    return bool(torch._C._current_graph_task_id() != -1)


class Region:
    """The edge conversions and parameter markers of one production-mode model (see the module
    docstring). Built by :func:`hp_dtensor.parallel.production.apply_production`.

    Args:
        root: the model's root module (for messages).
        group: this rank's group along the parallel axis.
        bucket: the model's gradient bucket.
        sequence_sharded: whether the plan shards activations on a dim other than the last
            (sequence or context parallelism), so an unrecorded placement is ambiguous.
    """

    def __init__(
        self, root: nn.Module, group: _comm.AxisGroup, bucket: _Bucket, sequence_sharded: bool
    ) -> None:
        self.token = next(_TOKENS)
        self.root_type = type(root).__name__
        self.group = group
        self.bucket = bucket
        self.sequence_sharded = sequence_sharded
        self._calls = _Calls()
        self._kinds: dict[int, _Kind] = {}  # by the identity of a parameter's reduction

    def __deepcopy__(self, memo: dict[int, Any]) -> Region:
        raise TypeError(
            f"a {self.root_type} parallelized in production mode cannot be copied: its hooks, "
            "its parameters' layouts and the collectives planned for it belong to this model. "
            "Copy the model before parallelize_module and parallelize the copy, or take its "
            "state_dict()"
        )

    # Installation ----------------------------------------------------------------------------

    def install(self, module: nn.Module, edge: ModuleEdge) -> None:
        """Track ``module``'s calls. Its pre-hook runs before the plan's input conversions,
        its post-hook after the plan's output conversions; hooks registered later (a sharder's,
        the caller's) run after it and see what the caller sees, the tensors autograd will
        walk back through."""
        post = module.register_forward_hook(self._post_hook(edge), always_call=True)
        object.__setattr__(module, _POST_HOOK_ATTR, post.id)
        module.register_forward_pre_hook(self._pre_hook(edge), prepend=True, with_kwargs=True)

    def _pre_hook(self, edge: ModuleEdge) -> Callable[..., Any]:
        calls = self._calls

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if torch.compiler.is_compiling():
                return None
            if calls.depth:
                # Inside a region (every call but the first: keep it cheap).
                calls.depth += 1
                if edge.entered_last and not _recomputing():
                    edge.entered_last = False
                if edge.own:
                    calls.owned.append(self._mark(module, ((module, n) for n in edge.own)))
                return None
            if _recomputing():
                entering = edge.entered_last
            else:
                entering = edge.entered_last = True
            subtree = ((module.get_submodule(path), name) for path, name in edge.params)
            swapped = self._mark(module, subtree) if edge.params else []
            calls.depth, calls.opening = 1, _Frame(entering, swapped)
            if edge.own:
                calls.owned.append(self._mark(module, ((module, n) for n in edge.own)))
            if not entering:
                return None
            return self._inputs(edge, args), self._kwargs(edge, kwargs)

        return hook

    def _post_hook(self, edge: ModuleEdge) -> Callable[..., Any]:
        calls = self._calls
        where = f"the output of {edge.name or self.root_type}"

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if torch.compiler.is_compiling():
                return None
            if edge.own and calls.owned:
                _restore(calls.owned.pop())
            depth = calls.depth
            if depth != 1:
                calls.depth = max(depth - 1, 0)
                return None
            frame, calls.depth, calls.opening = calls.opening, 0, None
            assert frame is not None
            _restore(frame.swapped)
            if not frame.entering or output is None:
                return None
            return map_tensors(partial(self._to_caller, where=where), output, where=where)

        return hook

    # Parameters ------------------------------------------------------------------------------

    def _mark(
        self, module: nn.Module, slots: Iterable[tuple[nn.Module, str]]
    ) -> list[tuple[nn.Module, str, torch.Tensor]]:
        """Put a fresh marker of each reduced parameter in ``slots`` (owner, name) in its
        place; what was there, to put back. A region's opening marks the whole subtree (a
        forward may read a submodule's parameter directly); each call of an owning module
        marks its own again, so that the marker is made, and its backward runs, next to the
        module's own ops (early enough in backward to ride on the next sum all-reduce)."""
        if not torch.is_grad_enabled():
            return []
        swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
        marked: dict[int, torch.Tensor] = {}  # a parameter tied into several modules: one
        for owner, name in slots:
            params = owner._parameters
            current = params.get(name)
            param = getattr(current, _MARKED_ATTR, current)
            if (
                param is None
                or not param.requires_grad
                or grad_region_of(param) != self.token
                or grad_reduction_handed_over(param)
            ):
                continue
            marker = marked.get(id(param))
            if marker is None:
                marker = marked[id(param)] = _apply(_MarkedUse)(
                    param, self.bucket, self._kind(param)
                )
                setattr(marker, _MARKED_ATTR, param)
            # A plain tensor in ``_parameters`` for the call: what nn.Module's attribute access
            # hands the forwards (FSDP swaps its views in the same way).
            params[name] = marker  # type: ignore[assignment]
            assert current is not None
            swapped.append((owner, name, current))
        return swapped

    def _kind(self, param: torch.Tensor) -> _Kind:
        spec = grad_reduction_of(param)
        assert spec is not None
        kind = self._kinds.get(id(spec))
        if kind is None:
            kind = self._kinds[id(spec)] = self.bucket.kind(spec)
        return kind

    # Tensors crossing the edge ---------------------------------------------------------------

    def _known(self, value: torch.Tensor, planned: Placement | None, where: str) -> Placement:
        placement = planned if planned is not None else placement_of(value)
        if placement is not None:
            return placement
        if self.sequence_sharded:
            raise PlanError(
                f"{where}: a tensor that requires grad crosses the edge of the "
                f"{self.root_type} model with no known placement; under sequence or context "
                "parallelism it may be a sequence shard or a replicated value, and the two "
                "take different gradients. Give the module its layouts in the plan "
                "(PrepareModuleInputOutput), or pass on the tensor the model handed out "
                "unchanged"
            )
        return Replicate()

    def _from_caller(self, value: Any, planned: Placement | None, where: str) -> Any:
        if not isinstance(value, torch.Tensor) or not value.requires_grad:
            return value
        if not torch.is_grad_enabled():
            return value
        placement = self._known(value, planned, where)
        if not isinstance(placement, Replicate):
            return value
        out: torch.Tensor = _apply(_PartialToExact)(value, self.group)
        set_placement(out, placement)
        return out

    def _inputs(self, edge: ModuleEdge, args: tuple[Any, ...]) -> tuple[Any, ...]:
        planned = edge.inputs
        where = f"input of {edge.name or self.root_type}"
        out = []
        for i, arg in enumerate(args):
            known = planned[i] if i < len(planned) else None
            out.append(self._each(arg, known, where))
        return tuple(out)

    def _kwargs(self, edge: ModuleEdge, kwargs: dict[str, Any]) -> dict[str, Any]:
        where = f"keyword input of {edge.name or self.root_type}"
        return {k: self._each(v, edge.kwargs.get(k), where) for k, v in kwargs.items()}

    def _each(self, value: Any, planned: Placement | None, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self._from_caller(value, planned, where)
        if isinstance(value, list | tuple | dict):
            # Containers of inputs (a list of hidden states): each tensor as it is recorded.
            leaves, spec = pytree.tree_flatten(value)
            return pytree.tree_unflatten([self._from_caller(v, None, where) for v in leaves], spec)
        return value

    def _to_caller(self, value: torch.Tensor, *, where: str) -> torch.Tensor:
        if not value.requires_grad or not torch.is_grad_enabled():
            return value
        placement = self._known(value, None, where)
        if not isinstance(placement, Replicate):
            return value
        gathered = getattr(value, GATHERED_FROM_ATTR, None)
        out: torch.Tensor
        if gathered is not None:
            source, box = gathered
            out = _apply(_GatheredOutput)(source, value.detach(), box)
        else:
            out = _apply(_ExactToPartial)(value, self.group)
        set_placement(out, placement)
        return out


def _restore(swapped: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    for owner, name, value in reversed(swapped):
        owner._parameters[name] = value  # type: ignore[assignment]


def keep_edge_outermost(module: nn.Module) -> None:
    """Move ``module``'s region post-hook after the forward hooks registered so far: a
    conversion hp-dtensor adds to a planned module later (an exact region) belongs inside the
    region's edge. No-op for a module no region tracks."""
    post_id = getattr(module, _POST_HOOK_ATTR, None)
    hooks = module._forward_hooks
    if post_id is not None and post_id in hooks:
        assert isinstance(hooks, OrderedDict)  # what nn.Module keeps its hooks in
        hooks.move_to_end(post_id)


def sequence_sharded(placements: Sequence[Placement | None]) -> bool:
    """Whether any of ``placements`` shards a dim other than the last (``Shard(-1)``)."""
    return any(isinstance(p, Shard) and p.dim != -1 for p in placements)

"""Sharding plans: the general per-module form, and resolving a plan against a module tree.

A plan maps module-name patterns (each dotted component an ``fnmatch`` pattern for one
component of the name, as torch matches them: ``*`` is one whole component in
``layers.*.attn.q_proj``) to parallel styles. Every style lowers to a :class:`ShardingPlan`:
the placements of the module's own parameters, and the layouts of its inputs and outputs on
the parallel mesh axis (how they arrive or are produced, and how they must be). Resolution is
pure: it returns the lowered plan of every matched module, or raises naming the entry that
matched nothing, the module a style cannot shard, or the module matched twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from hp_layout import Placement, Shard

if TYPE_CHECKING:
    from torch import nn

    from hp_dtensor.parallel.styles import ParallelStyle

__all__ = [
    "Boundary",
    "ExpertParallelPlan",
    "PlanError",
    "PlanLayoutLengthError",
    "ShardingPlan",
    "lower_plan",
    "match_modules",
]


class PlanError(ValueError):
    """A plan does not fit the module it is applied to."""


class PlanLayoutLengthError(PlanError, AssertionError):
    """A style was given layouts and desired layouts of different lengths. torch's styles raise
    ``AssertionError`` for this when they are built; this is that type and a PlanError too."""


def _ours(value: object) -> Placement | None:
    """A boundary's placement as ours: torch's placements are converted (imported only when
    one is given: this module stays light)."""
    if value is None or isinstance(value, Placement):
        return value
    from hp_dtensor.interop import style_placement

    return style_placement(value)


def _ours_all(value: object) -> Placement | tuple[Placement, ...]:
    """A parameter's placement (or one per mesh axis) as ours."""
    if isinstance(value, tuple):
        return tuple(_must(_ours(v)) for v in value)
    return _must(_ours(value))


def _must(value: Placement | None) -> Placement:
    if value is None:
        raise PlanError("a parameter's placement cannot be None; give Replicate() to keep it whole")
    return value


@dataclass(frozen=True)
class Boundary:
    """One module input or output on the parallel axis.

    Attributes:
        layout: the placement the tensor has when it arrives (input) or is produced (output);
            None accepts whatever arrives.
        desired: the placement the module needs (input) or hands on (output); None keeps
            ``layout``.
    """

    layout: Placement | None = None
    desired: Placement | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", _ours(self.layout))
        object.__setattr__(self, "desired", _ours(self.desired))

    @property
    def target(self) -> Placement | None:
        """The placement after the boundary."""
        return self.desired if self.desired is not None else self.layout


@dataclass(frozen=True)
class ShardingPlan:
    """The general per-module sharding that every style lowers to.

    Attributes:
        params: placement of each of the module's own parameters (by attribute name) on the
            parallel axis; the other mesh axes replicate. A tuple gives one placement per mesh
            axis instead.
        inputs: per positional input, its boundary (None leaves the input alone).
        kwarg_inputs: per keyword input, its boundary.
        outputs: the output's boundary, or one per element of a tuple output.
        use_local_output: hand plain local tensors to the consumer (always so in production
            mode; validation mode keeps DTensors so layouts keep propagating).
        replaces_forward: the style computes the module's forward itself in production mode
            (its ops are then not checked op by op in validation mode).
        style: the name of the style, for messages.
        behaviour: the style object the plan was lowered from (set by :func:`lower_plan`);
            it supplies the module's own forward where ``replaces_forward`` says so, in
            production and in validation mode. None for a plan given directly.
        exact_inputs: the module must be called with exactly ``len(inputs)`` positional
            inputs, else a ``ValueError`` at the call (torch's check; set by
            ``PrepareModuleInput`` given one placement rather than a tuple).
    """

    params: Mapping[str, Placement | tuple[Placement, ...]] = field(default_factory=dict)
    inputs: tuple[Boundary | None, ...] = ()
    kwarg_inputs: Mapping[str, Boundary] = field(default_factory=dict)
    outputs: Boundary | tuple[Boundary | None, ...] | None = None
    use_local_output: bool = True
    replaces_forward: bool = False
    style: str = "ShardingPlan"
    behaviour: ParallelStyle | None = field(default=None, compare=False, repr=False)
    exact_inputs: bool = False

    def __post_init__(self) -> None:
        if any(not isinstance(p, Placement | tuple) for p in self.params.values()) or any(
            isinstance(p, tuple) and not all(isinstance(q, Placement) for q in p)
            for p in self.params.values()
        ):
            object.__setattr__(self, "params", {k: _ours_all(v) for k, v in self.params.items()})

    def input_boundary(self, index: int) -> Boundary | None:
        """The boundary of positional input ``index`` (None: leave it alone)."""
        return self.inputs[index] if index < len(self.inputs) else None

    def describe(self, axis_size: int) -> str:
        """What the plan does beyond its placements and boundaries, for tables ("" when
        nothing: expert and context parallel plans say how they move tokens)."""
        return ""

    def collectives(self, axis_size: int) -> Mapping[str, int]:
        """Collectives the module runs inside per forward and backward, by kind, beyond its
        boundaries' (expert dispatch, context-parallel attention); none for most plans."""
        return {}

    def per_rank_loss(self) -> bool:
        """Whether, over the parallel axis, each rank's caller computes a loss of its own (the
        global loss is the sum of the ranks' losses, as expert parallelism's per-rank tokens
        make it), instead of one loss that is the same on every rank. False for most plans."""
        return False

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        """A ShardingPlan is already lowered; check its parameter names exist."""
        own = dict(module.named_parameters(recurse=False))
        unknown = [p for p in self.params if p not in own]
        if unknown:
            raise PlanError(
                f"ShardingPlan for module {name!r} ({type(module).__name__}) names parameters "
                f"{unknown} it does not have; it has {sorted(own)}"
            )
        return self


def _matches(name: str, parts: Sequence[str]) -> bool:
    components = name.split(".") if name else []
    return len(components) == len(parts) and all(
        fnmatchcase(c, p) for c, p in zip(components, parts, strict=True)
    )


def match_modules(module: nn.Module, entry: str) -> list[str]:
    """Names of the submodules of ``module`` matched by ``entry`` ("" is the module itself):
    each dotted component is an ``fnmatch`` pattern (``*``, ``?``, ``[...]``) for one component
    of the name, as torch's ``parallelize_module`` matches its plan keys."""
    parts = entry.split(".") if entry else []
    return [name for name, _ in module.named_modules() if _matches(name, parts)]


def lower_plan(
    module: nn.Module, plan: Mapping[str, ParallelStyle | ShardingPlan]
) -> list[tuple[str, ShardingPlan]]:
    """Lower every plan entry on the modules it matches, in module order."""
    lowered: dict[str, tuple[str, ShardingPlan]] = {}
    names = [name for name, _ in module.named_modules()]
    for entry, style in plan.items():
        matched = match_modules(module, entry)
        if not matched:
            raise PlanError(
                f"plan entry {entry!r} names no module; modules are e.g. {_closest(entry, names)}"
            )
        for name in matched:
            if name in lowered:
                raise PlanError(
                    f"module {name!r} is matched by plan entries {lowered[name][0]!r} and "
                    f"{entry!r}; give each module one style"
                )
            sharding = style.lower(module.get_submodule(name), name)
            if sharding.behaviour is None and not isinstance(style, ShardingPlan):
                sharding = replace(sharding, behaviour=style)
            lowered[name] = (entry, sharding)
    return [(name, lowered[name][1]) for name in names if name in lowered]


def _closest(entry: str, names: Sequence[str]) -> list[str]:
    tail = entry.split(".")[-1]
    near = [n for n in names if n.split(".")[-1] == tail or tail.strip("*") in n]
    return (near or [n for n in names if n])[:5]


@dataclass(frozen=True)
class ExpertParallelPlan(ShardingPlan):
    """The lowered expert-parallel styles: the general plan (whole experts per rank of the
    parallel axis, tokens ``Shard(0)`` there) plus what the dispatch needs.

    Which rows go where is data-dependent: each forward plans it from the router's counts
    (:func:`hp_dtensor.parallel.expert.plan_dispatch`) and exchanges them by all-to-all,
    forward (dispatch) and backward (combine's adjoint), twice each.

    Attributes:
        num_experts: routed experts of the MoE.
        top_k: experts each token is routed to.
        expert_tp_axis: the axis each expert's hidden dim is sharded over (expert-tensor
            parallelism), None when experts are whole.
    """

    num_experts: int = 0
    top_k: int = 1
    expert_tp_axis: str | None = None

    def describe(self, axis_size: int) -> str:
        per_rank = self.num_experts // axis_size if axis_size else self.num_experts
        tp = (
            f", each expert's hidden dim over {self.expert_tp_axis!r}"
            if self.expert_tp_axis
            else ""
        )
        return (
            f"{self.num_experts} experts, {per_rank} per rank{tp}; top-{self.top_k} routing; "
            "tokens dispatched and combined by all-to-all, sizes planned each forward from "
            "the router's counts"
        )

    def per_rank_loss(self) -> bool:
        """Tokens that arrive sharded (each rank routes its own batch) make each rank's loss
        its own term of the global one; tokens that arrive replicated do not."""
        arrives = self.input_boundary(0)
        return arrives is None or arrives.layout is None or isinstance(arrives.layout, Shard)

    def collectives(self, axis_size: int) -> Mapping[str, int]:
        if axis_size == 1:
            return {}
        # The per-expert counts gathered once; rows dispatched and combined, and both adjoints.
        counts = {"all_gather": 1, "all_to_all": 4}
        if self.expert_tp_axis is not None:
            # The experts' row-parallel second matmul sums over the expert-tensor axis, and the
            # adjoint of its replicated input does too.
            counts["all_reduce"] = 2
        return counts

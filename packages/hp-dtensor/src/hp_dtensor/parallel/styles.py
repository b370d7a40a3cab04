"""Tensor-parallel styles. Each lowers, for one module, to the general :class:`ShardingPlan`.

Names and defaults follow ``torch.distributed.tensor.parallel``. Placements given to a style
are placements on the parallel (tensor-parallel) mesh axis.

* :class:`ColwiseParallel` -- ``nn.Linear`` weight and bias sharded on the output features
  (``Shard(0)``), ``nn.Embedding`` on the embedding dim (``Shard(1)``); replicated input,
  output sharded on the last dim.
* :class:`RowwiseParallel` -- ``nn.Linear`` weight sharded on the input features
  (``Shard(1)``), bias replicated; ``nn.Embedding`` sharded on the vocabulary (``Shard(0)``);
  the output is a partial sum, reduced to the requested layout (Replicate, or Shard(1) for
  sequence parallel).
* :class:`SequenceParallel` -- replicated parameters, input and output sharded on the sequence
  dim (norms, dropout, element-wise modules).
* :class:`PrepareModuleInput` / :class:`PrepareModuleOutput` /
  :class:`PrepareModuleInputOutput` -- only convert a module's inputs, outputs, or both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from torch import nn

import hp_dtensor.parallel.context_attention as context_attention
import hp_dtensor.parallel.expert as expert
import hp_dtensor.parallel.local_forwards as local_forwards
from hp_dtensor.interop import style_placement
from hp_dtensor.parallel.context_plan import ContextParallelPlan
from hp_dtensor.parallel.expert_module import expert_module_of
from hp_dtensor.parallel.plan import (
    Boundary,
    ExpertParallelPlan,
    PlanError,
    PlanLayoutLengthError,
    ShardingPlan,
)
from hp_layout import Layout, Partial, Placement, Replicate, Shard

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement as TorchPlacement

    from hp_dtensor.device_mesh import DeviceMesh

    AnyPlacement = Placement | TorchPlacement
    """A placement of either library: styles take torch's too (converted when built)."""
    Layouts = AnyPlacement | tuple[AnyPlacement | None, ...] | list[AnyPlacement | None]
    """One placement (a single input or output) or one per input or output (None: leave it)."""

__all__ = [
    "ColwiseParallel",
    "ContextParallel",
    "ExpertParallel",
    "ExpertTensorParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]


class ParallelStyle(ABC):
    """A way to parallelize one module: :meth:`lower` gives its general plan; a style whose
    plan says ``replaces_forward`` also supplies the module's forward in each mode (so a new
    style is one class, and the executors never dispatch on style names)."""

    @abstractmethod
    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        """The plan for ``module`` (called ``name``), or a PlanError if the style cannot apply."""

    def production_forward(
        self, module: nn.Module, sharding: ShardingPlan, axis_mesh: DeviceMesh, coordinate: int
    ) -> Callable[..., Any] | None:
        """The module's forward in production mode (plain local tensors in and out, called as
        a method of ``module``), or None when the module's own forward is right. ``axis_mesh``
        is the 1-d mesh of the parallel axis; ``coordinate`` this rank's place on it."""
        return None

    def prepare_production(self, module: nn.Module, axis_mesh: DeviceMesh) -> None:
        """Called once ``module``'s parameters are this rank's local pieces (production mode),
        before any forward: a style tells a module that computes differently when split
        (:class:`~hp_dtensor.parallel.local_forwards.SplitAwareLinear`) how it is split. No-op
        by default."""
        del module, axis_mesh  # the default has nothing to tell

    def production_output_is_fresh(self, module: nn.Module) -> bool:
        """Whether the production forward returns tensors that nothing else holds (results
        of its own last op, not an input, a parameter or a view): the output boundary may then
        reduce them in place, as Megatron's hand-written ``g`` does. False by default."""
        del module  # the default claims nothing about any module
        return False

    def install_validation_forward(
        self, module: nn.Module, sharding: ShardingPlan, mesh: DeviceMesh, axis: str
    ) -> None:
        """Replace the module's forward in validation mode where it must run the production
        computation on local shards (expert and context parallelism); by default the module's
        own forward runs on DTensors."""
        del module, sharding, mesh, axis  # the default keeps the module's own forward


def _placement(value: object) -> Placement | None:
    """A style's placement as ours (None stays None; torch's are converted)."""
    return None if value is None else style_placement(value)


def _convert_fields(style: object, *names: str) -> None:
    """Replace a frozen style's placement fields by ours, so that torch's placements are
    accepted and anything else is refused when the style is built, not when it is applied."""
    for name in names:
        object.__setattr__(style, name, _placement(getattr(style, name)))


def _layout_tuple(value: object) -> tuple[Placement | None, ...] | None:
    """Per-input layouts as a tuple of ours: one placement becomes a 1-tuple (torch's
    ``PrepareModuleInput(input_layouts=Shard(0))``), None stays None."""
    if value is None:
        return None
    if isinstance(value, tuple | list):
        return tuple(_placement(v) for v in value)
    return (_placement(value),)


def _check_lengths(style: str, what: str, layouts: object, desired: object) -> None:
    """torch refuses layouts and desired layouts of different lengths when the style is built
    (an ``AssertionError``); so does this (:class:`PlanLayoutLengthError` is both a PlanError
    and an AssertionError)."""
    if layouts is None or desired is None:
        return
    assert isinstance(layouts, tuple | dict)
    assert isinstance(desired, tuple | dict)
    if len(layouts) != len(desired):
        raise PlanLayoutLengthError(
            f"{what} and desired_{what} should have same length! "
            f"{style}: {what} has {len(layouts)} entries but desired_{what} has "
            f"{len(desired)}; give one desired layout per layout (None leaves one alone)"
        )


def _refuse(style: str, module: nn.Module, name: str, supported: str) -> PlanError:
    return PlanError(
        f"{style} cannot shard module {name!r} ({type(module).__name__}); it supports {supported}"
    )


def _refuse_split_aware_validation(module: nn.Module, style: str) -> None:
    """Validation mode runs a module's own forward on DTensors; a linear computing its own
    product (an FP8 linear) runs on local pieces only, as production mode gives them."""
    if isinstance(module, local_forwards.SplitAwareLinear):
        raise PlanError(
            f"{style} cannot run {type(module).__name__} in validation mode: it computes its "
            "own product (e.g. in FP8) on plain local pieces, not on DTensors; use "
            "mode='production'"
        )


def _own_params(module: nn.Module) -> list[str]:
    return [n for n, _ in module.named_parameters(recurse=False)]


@dataclass(frozen=True)
class ColwiseParallel(ParallelStyle):
    """Shard a Linear's output features or an Embedding's embedding dim.

    Attributes:
        input_layouts: how the input arrives (default Replicate).
        output_layouts: how the output is handed on (default Shard(-1)).
        use_local_output: hand on a plain local tensor (validation mode keeps DTensors).
    """

    input_layouts: AnyPlacement | None = None
    output_layouts: AnyPlacement | None = None
    use_local_output: bool = True

    def __post_init__(self) -> None:
        _convert_fields(self, "input_layouts", "output_layouts")

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        if isinstance(module, nn.Linear):
            params: dict[str, Placement] = {"weight": Shard(0)}
            if module.bias is not None:
                params["bias"] = Shard(0)
        elif isinstance(module, nn.Embedding):
            _check_embedding(module, name, "ColwiseParallel", ("max_norm",))
            params = {"weight": Shard(1)}
        else:
            raise _refuse("ColwiseParallel", module, name, "nn.Linear and nn.Embedding")
        return ShardingPlan(
            params=params,
            inputs=(Boundary(_placement(self.input_layouts) or Replicate(), Replicate()),),
            outputs=Boundary(Shard(-1), _placement(self.output_layouts) or Shard(-1)),
            use_local_output=self.use_local_output,
            style="ColwiseParallel",
        )

    def prepare_production(self, module: nn.Module, axis_mesh: DeviceMesh) -> None:
        if isinstance(module, nn.Linear):
            local_forwards.announce_linear_split(module, 0, axis_mesh)

    def install_validation_forward(
        self, module: nn.Module, sharding: ShardingPlan, mesh: DeviceMesh, axis: str
    ) -> None:
        _refuse_split_aware_validation(module, "ColwiseParallel")


def _embedding_option_set(module: nn.Embedding, option: str) -> bool:
    if option == "max_norm":
        # Renormalizes rows in place from their whole norm.
        return module.max_norm is not None
    if option == "scale_grad_by_freq":
        # Divides by the counts of ids in the batch: a vocabulary shard maps the ids outside it
        # to its row 0, which would count them.
        return module.scale_grad_by_freq
    # Sparse gradients are not reduced.
    return module.sparse


def _check_embedding(module: nn.Embedding, name: str, style: str, options: tuple[str, ...]) -> None:
    """Refuse the embedding ``options`` a shard cannot honour on its own."""
    for option in options:
        if _embedding_option_set(module, option):
            raise PlanError(
                f"{style} cannot shard embedding {name!r}: its {option} option needs the whole "
                f"rows or vocabulary; drop the option, or keep the embedding replicated "
                "(ShardingPlan())"
            )


@dataclass(frozen=True)
class RowwiseParallel(ParallelStyle):
    """Shard a Linear's input features or an Embedding's vocabulary; reduce the partial output.

    Attributes:
        input_layouts: how the input arrives (default Shard(-1) for Linear, Replicate for
            Embedding).
        output_layouts: how the reduced output is handed on (default Replicate; Shard(1)
            gives a reduce-scatter for sequence parallel).
        use_local_output: hand on a plain local tensor (validation mode keeps DTensors).
    """

    input_layouts: AnyPlacement | None = None
    output_layouts: AnyPlacement | None = None
    use_local_output: bool = True

    def __post_init__(self) -> None:
        _convert_fields(self, "input_layouts", "output_layouts")

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        if isinstance(module, nn.Linear):
            params: dict[str, Placement] = {"weight": Shard(1)}
            if module.bias is not None:
                params["bias"] = Replicate()
            desired_input: Placement = Shard(-1)
        elif isinstance(module, nn.Embedding):
            _check_embedding(
                module, name, "RowwiseParallel", ("max_norm", "scale_grad_by_freq", "sparse")
            )
            params = {"weight": Shard(0)}
            desired_input = Replicate()
        else:
            raise _refuse("RowwiseParallel", module, name, "nn.Linear and nn.Embedding")
        return ShardingPlan(
            params=params,
            inputs=(Boundary(_placement(self.input_layouts) or desired_input, desired_input),),
            outputs=Boundary(Partial(), _placement(self.output_layouts) or Replicate()),
            use_local_output=self.use_local_output,
            replaces_forward=True,
            style="RowwiseParallel",
        )

    def production_forward(
        self, module: nn.Module, sharding: ShardingPlan, axis_mesh: DeviceMesh, coordinate: int
    ) -> Callable[..., Any] | None:
        if isinstance(module, nn.Linear):
            own = isinstance(module, local_forwards.SplitAwareLinear)
            return local_forwards.rowwise_linear_forward(coordinate, own_product=own)
        embedding = cast(nn.Embedding, module)  # lower() admits nothing else
        shape = (embedding.num_embeddings, embedding.embedding_dim)
        layout = Layout(shape, axis_mesh.mesh, [Shard(0)])
        (start, stop), _ = layout.local_region(axis_mesh.get_rank()).box
        return local_forwards.vocab_parallel_embedding_forward(start, stop)

    def prepare_production(self, module: nn.Module, axis_mesh: DeviceMesh) -> None:
        if isinstance(module, nn.Linear):
            local_forwards.announce_linear_split(module, 1, axis_mesh)

    def install_validation_forward(
        self, module: nn.Module, sharding: ShardingPlan, mesh: DeviceMesh, axis: str
    ) -> None:
        _refuse_split_aware_validation(module, "RowwiseParallel")

    def production_output_is_fresh(self, module: nn.Module) -> bool:
        # Both production forwards end in an op of their own (a linear, a masked fill).
        return True


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """Replicated parameters; input and output sharded along the sequence dim.

    Attributes:
        sequence_dim: the sequence dim of the input and output (default 1).
        use_local_output: hand on a plain local tensor (default False, as in torch).
    """

    sequence_dim: int = 1
    use_local_output: bool = False

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        seq = Shard(self.sequence_dim)
        return ShardingPlan(
            params={p: Replicate() for p in _own_params(module)},
            inputs=(Boundary(seq, seq),),
            outputs=Boundary(seq, seq),
            use_local_output=self.use_local_output,
            replaces_forward=isinstance(module, nn.modules.dropout._DropoutNd),
            style="SequenceParallel",
        )

    def production_forward(
        self, module: nn.Module, sharding: ShardingPlan, axis_mesh: DeviceMesh, coordinate: int
    ) -> Callable[..., Any] | None:
        return local_forwards.sequence_parallel_dropout_forward(axis_mesh, sharding)


@dataclass(frozen=True)
class ContextParallel(ParallelStyle):
    """Context-parallel causal attention on a core module (``q, k, v -> out``, each
    ``[batch, heads, seq, head_size]`` with the sequence sharded on the parallel axis; e.g.
    :class:`hp_dtensor.parallel.context.CausalAttention`). See :mod:`hp_dtensor.parallel.context`.

    Attributes:
        variant: ``"ring"`` (key/value blocks rotate around the ring) or ``"ulysses"``
            (all-to-all between sequence and heads; heads must divide by the axis size).
        balanced: the load-balanced ("zigzag") sequence sharding (default) or contiguous.
        use_local_output: hand on a plain local tensor (validation mode keeps DTensors).
    """

    variant: str = "ring"
    balanced: bool = True
    use_local_output: bool = False

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        if _own_params(module):
            raise _refuse("ContextParallel", module, name, "parameter-free attention cores")
        seq = Shard(2)
        return ContextParallelPlan(
            inputs=(Boundary(seq, seq),) * 3,
            outputs=Boundary(seq, seq),
            use_local_output=self.use_local_output,
            replaces_forward=True,
            style="ContextParallel",
            variant=self.variant,
            balanced=self.balanced,
        )

    def production_forward(
        self, module: nn.Module, sharding: ShardingPlan, axis_mesh: DeviceMesh, coordinate: int
    ) -> Callable[..., Any] | None:
        assert isinstance(sharding, ContextParallelPlan)
        return context_attention.production_forward(module, sharding, axis_mesh)

    def install_validation_forward(
        self, module: nn.Module, sharding: ShardingPlan, mesh: DeviceMesh, axis: str
    ) -> None:
        assert isinstance(sharding, ContextParallelPlan)
        context_attention.install_validation_forward(module, sharding, mesh, axis)


_EXPERT_STACKS = ("experts.w1", "experts.w2", "experts.w3")


class _ExpertForwards(ParallelStyle):
    """The forwards of both expert-parallel styles: the MoE routes its tokens to the ranks
    holding their experts (all-to-all), in either mode on local shards."""

    def production_forward(
        self, module: nn.Module, sharding: ShardingPlan, axis_mesh: DeviceMesh, coordinate: int
    ) -> Callable[..., Any] | None:
        return expert.expert_parallel_forward(module, axis_mesh)

    def install_validation_forward(
        self, module: nn.Module, sharding: ShardingPlan, mesh: DeviceMesh, axis: str
    ) -> None:
        expert.install_validation_forward(module, mesh, axis)


def _expert_boundaries(
    style: str,
    module: nn.Module,
    name: str,
    params: Mapping[str, Placement | tuple[Placement, ...]],
    input_layouts: Placement | None,
    output_layouts: Placement | None,
    use_local_output: bool,
    expert_tp_axis: str | None = None,
) -> ShardingPlan:
    moe = expert_module_of(module, style, name)
    tokens = Shard(0)
    return ExpertParallelPlan(
        params=params,
        inputs=(Boundary(input_layouts or tokens, tokens),),
        outputs=Boundary(tokens, output_layouts or tokens),
        use_local_output=use_local_output,
        replaces_forward=True,
        style=style,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        expert_tp_axis=expert_tp_axis,
    )


@dataclass(frozen=True)
class ExpertParallel(_ExpertForwards):
    """Expert parallelism on a :class:`~hp_dtensor.parallel.ExpertModule` over the parallel axis
    (the ep axis: ``parallelize_module(..., tp_axis="ep")``). See
    :mod:`hp_dtensor.parallel.expert`.

    The expert stacks are ``Shard(0)`` (whole experts per rank; the number of experts must be
    divisible by the axis size); router and shared experts replicated. Tokens are ``Shard(0)``
    on the axis inside the MoE (each rank routes its own batch; tokens are exchanged by
    all-to-all). The global loss is the sum of the per-rank losses.

    Attributes:
        input_layouts: how the input arrives on the ep axis (default Shard(0): each rank its
            own batch; Replicate: every rank the whole batch, sliced at the boundary).
        output_layouts: how the output is handed on (default Shard(0); Replicate gathers).
        use_local_output: hand on a plain local tensor (validation mode keeps DTensors).
    """

    input_layouts: AnyPlacement | None = None
    output_layouts: AnyPlacement | None = None
    use_local_output: bool = True

    def __post_init__(self) -> None:
        _convert_fields(self, "input_layouts", "output_layouts")

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        params: dict[str, Placement | tuple[Placement, ...]] = dict.fromkeys(
            _EXPERT_STACKS, Shard(0)
        )
        return _expert_boundaries(
            "ExpertParallel",
            module,
            name,
            params,
            _placement(self.input_layouts),
            _placement(self.output_layouts),
            self.use_local_output,
        )


@dataclass(frozen=True)
class ExpertTensorParallel(_ExpertForwards):
    """EP x TP on a :class:`~hp_dtensor.parallel.ExpertModule`: experts sharded over ``ep_axis``
    (``Shard(0)``), each expert's hidden dim over ``tp_axis`` (``w1``/``w3`` ``Shard(1)``,
    ``w2`` ``Shard(2)``). Apply with the ep axis as the parallel axis and no data-parallel
    axis among them: ``parallelize_module(model, mesh, plan, tp_axis=ep_axis, dp_axes=())``.

    The expert placements are given in the tuple form (one placement per mesh axis, in the
    order of ``mesh_axes``, which must be the mesh's axis names); tokens are ``Shard(0)`` on
    ep (as :class:`ExpertParallel`) and replicated over tp.

    Attributes:
        mesh_axes: the mesh's axis names in order.
        ep_axis: the expert-parallel axis.
        tp_axis: the axis sharding each expert's hidden dim.
        input_layouts, output_layouts, use_local_output: as :class:`ExpertParallel`.
    """

    mesh_axes: tuple[str, ...] = ("ep", "tp")
    ep_axis: str = "ep"
    tp_axis: str = "tp"
    input_layouts: AnyPlacement | None = None
    output_layouts: AnyPlacement | None = None
    use_local_output: bool = True

    def __post_init__(self) -> None:
        _convert_fields(self, "input_layouts", "output_layouts")

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        if (
            self.ep_axis == self.tp_axis
            or self.ep_axis not in self.mesh_axes
            or self.tp_axis not in self.mesh_axes
        ):
            raise PlanError(
                f"ExpertTensorParallel for {name!r}: ep_axis {self.ep_axis!r} and tp_axis "
                f"{self.tp_axis!r} must be two different names of mesh_axes {self.mesh_axes}"
            )

        def placement(axis: str, tp_dim: int) -> Placement:
            if axis == self.ep_axis:
                return Shard(0)
            return Shard(tp_dim) if axis == self.tp_axis else Replicate()

        def placements(tp_dim: int) -> tuple[Placement, ...]:
            return tuple(placement(axis, tp_dim) for axis in self.mesh_axes)

        params: dict[str, Placement | tuple[Placement, ...]] = {
            "experts.w1": placements(1),
            "experts.w2": placements(2),
            "experts.w3": placements(1),
        }
        return _expert_boundaries(
            "ExpertTensorParallel",
            module,
            name,
            params,
            _placement(self.input_layouts),
            _placement(self.output_layouts),
            self.use_local_output,
            self.tp_axis,
        )


def _boundaries(
    layouts: Sequence[Placement | None] | None,
    desired: Sequence[Placement | None] | None,
) -> tuple[Boundary | None, ...]:
    """One boundary per layout (lengths were checked when the style was built)."""
    got = list(layouts or [])
    want = list(desired or [])
    out: list[Boundary | None] = []
    for i, layout in enumerate(got):
        target = want[i] if want else None
        out.append(None if layout is None and target is None else Boundary(layout, target))
    return tuple(out)


def _kwarg_layouts(value: Mapping[str, object]) -> dict[str, Placement]:
    out: dict[str, Placement] = {}
    for key, layout in value.items():
        converted = _placement(layout)
        if converted is None:
            raise PlanError(f"keyword input {key!r}: give a placement, not None")
        out[key] = converted
    return out


def _prepare_inputs(style: Any, name: str) -> None:
    """Convert and check the input fields of :class:`PrepareModuleInput` and
    :class:`PrepareModuleInputOutput` (``name``: the style, for messages)."""
    layouts = style.input_layouts
    object.__setattr__(
        style, "one_input", layouts is not None and not isinstance(layouts, tuple | list)
    )
    _convert_layouts(style, "input_layouts")
    _convert_layouts(style, "desired_input_layouts")
    for field_name in ("input_kwarg_layouts", "desired_input_kwarg_layouts"):
        object.__setattr__(style, field_name, _kwarg_layouts(getattr(style, field_name)))
    _check_lengths(
        name,
        "input_layouts",
        style.input_layouts,
        style.desired_input_layouts,
    )
    _check_lengths(
        name,
        "input_kwarg_layouts",
        style.input_kwarg_layouts or None,
        style.desired_input_kwarg_layouts or None,
    )


def _convert_layouts(style: ParallelStyle, field_name: str) -> None:
    object.__setattr__(style, field_name, _layout_tuple(getattr(style, field_name)))


def _output_layouts(value: object) -> Placement | tuple[Placement | None, ...]:
    """An output layout field as ours: one placement, or a tuple of them."""
    if isinstance(value, tuple | list):
        return tuple(_placement(v) for v in value)
    converted = _placement(value)
    if converted is None:
        raise PlanError("output layouts: give a placement (or a tuple of them), not None")
    return converted


def _prepare_outputs(style: Any, name: str) -> None:
    """Convert and check the output fields of :class:`PrepareModuleOutput` and
    :class:`PrepareModuleInputOutput`."""
    for field_name in ("output_layouts", "desired_output_layouts"):
        object.__setattr__(style, field_name, _output_layouts(getattr(style, field_name)))
    layouts, desired = style.output_layouts, style.desired_output_layouts
    if isinstance(layouts, tuple) or isinstance(desired, tuple):
        _check_lengths(
            name,
            "output_layouts",
            layouts if isinstance(layouts, tuple) else (layouts,),
            desired if isinstance(desired, tuple) else (desired,),
        )


@dataclass(frozen=True)
class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs: ``input_layouts[i]`` as they arrive, ``desired_...[i]`` as the
    module needs them (None leaves an input alone).

    Placements may be ``hp_layout``'s or ``torch.distributed.tensor``'s. Layouts and desired
    layouts of different lengths are refused when the style is built
    (:class:`PlanLayoutLengthError`, an ``AssertionError`` as torch raises). A single placement
    (not a tuple) stands for a module with one positional input, as in torch: a call with
    another number of positional inputs is refused (``ValueError``, as torch). A tuple gives
    the layouts of the leading positional inputs and leaves any further ones alone (torch
    refuses a call with more inputs than layouts; hp's own plans rely on this, e.g. an
    attention block's rotary tables after its hidden states).

    Attributes:
        input_layouts: per positional input (or one placement).
        desired_input_layouts: per positional input (or one placement).
        input_kwarg_layouts: per keyword input.
        desired_input_kwarg_layouts: per keyword input.
        use_local_output: hand the module plain local tensors (validation mode keeps DTensors).
        one_input: set when built: ``input_layouts`` was one placement (see above).
    """

    input_layouts: Layouts | None = None
    desired_input_layouts: Layouts | None = None
    input_kwarg_layouts: Mapping[str, AnyPlacement] = field(default_factory=dict)
    desired_input_kwarg_layouts: Mapping[str, AnyPlacement] = field(default_factory=dict)
    use_local_output: bool = False
    one_input: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _prepare_inputs(self, "PrepareModuleInput")

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        layouts = cast("tuple[Placement | None, ...] | None", self.input_layouts)
        desired = cast("tuple[Placement | None, ...] | None", self.desired_input_layouts)
        wanted = cast("Mapping[str, Placement]", self.desired_input_kwarg_layouts)
        kwargs = {
            key: Boundary(cast(Placement, layout), wanted.get(key))
            for key, layout in self.input_kwarg_layouts.items()
        }
        return ShardingPlan(
            inputs=_boundaries(layouts, desired),
            kwarg_inputs=kwargs,
            use_local_output=self.use_local_output,
            style="PrepareModuleInput",
            exact_inputs=self.one_input,
        )


@dataclass(frozen=True)
class PrepareModuleInputOutput(ParallelStyle):
    """Convert a module's inputs and its outputs (torch's name): :class:`PrepareModuleInput`
    and :class:`PrepareModuleOutput` on one module. With layouts equal to the desired ones
    nothing moves, but the placements are recorded: a caller may then call the module itself
    with tensors whose placement it does not record (under sequence parallelism, a block
    between sequence-sharded activations).

    Attributes:
        input_layouts, desired_input_layouts, input_kwarg_layouts,
        desired_input_kwarg_layouts: as :class:`PrepareModuleInput`.
        output_layouts, desired_output_layouts: as :class:`PrepareModuleOutput`.
        use_local_output: hand on plain local tensors (validation mode keeps DTensors).
    """

    input_layouts: Layouts | None = None
    desired_input_layouts: Layouts | None = None
    input_kwarg_layouts: Mapping[str, AnyPlacement] = field(default_factory=dict)
    desired_input_kwarg_layouts: Mapping[str, AnyPlacement] = field(default_factory=dict)
    output_layouts: Layouts = field(default_factory=Replicate)
    desired_output_layouts: Layouts = field(default_factory=Replicate)
    use_local_output: bool = True
    one_input: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _prepare_inputs(self, "PrepareModuleInputOutput")
        _prepare_outputs(self, "PrepareModuleInputOutput")

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        inputs = PrepareModuleInput(
            self.input_layouts,
            self.desired_input_layouts,
            self.input_kwarg_layouts,
            self.desired_input_kwarg_layouts,
        ).lower(module, name)
        outputs = PrepareModuleOutput(
            self.output_layouts, self.desired_output_layouts, self.use_local_output
        ).lower(module, name)
        return ShardingPlan(
            inputs=inputs.inputs,
            kwarg_inputs=inputs.kwarg_inputs,
            outputs=outputs.outputs,
            use_local_output=self.use_local_output,
            style="PrepareModuleInputOutput",
            exact_inputs=self.one_input,
        )


@dataclass(frozen=True)
class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs: ``output_layouts`` as produced, ``desired_output_layouts``
    as handed on (placements of either library; tuples of different lengths are refused when
    the style is built, as :class:`PrepareModuleInput`'s).

    Attributes:
        output_layouts: per output (one placement, or a tuple for tuple outputs).
        desired_output_layouts: per output.
        use_local_output: hand on plain local tensors (validation mode keeps DTensors).
    """

    output_layouts: Layouts = field(default_factory=Replicate)
    desired_output_layouts: Layouts = field(default_factory=Replicate)
    use_local_output: bool = True

    def __post_init__(self) -> None:
        _prepare_outputs(self, "PrepareModuleOutput")

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        produced = cast("Placement | tuple[Placement | None, ...]", self.output_layouts)
        handed = cast("Placement | tuple[Placement | None, ...]", self.desired_output_layouts)
        if isinstance(produced, tuple) or isinstance(handed, tuple):
            layouts = produced if isinstance(produced, tuple) else (produced,)
            desired = handed if isinstance(handed, tuple) else (handed,)
            outputs: Boundary | tuple[Boundary | None, ...] = _boundaries(layouts, desired)
        else:
            outputs = Boundary(produced, handed)
        return ShardingPlan(
            outputs=outputs, use_local_output=self.use_local_output, style="PrepareModuleOutput"
        )

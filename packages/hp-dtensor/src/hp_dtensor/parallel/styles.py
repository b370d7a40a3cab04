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
* :class:`PrepareModuleInput` / :class:`PrepareModuleOutput` -- only convert a module's inputs
  or outputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch import nn

from hp_dtensor.parallel.plan import Boundary, PlanError, ShardingPlan
from hp_layout import Partial, Placement, Replicate, Shard

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
]


class ParallelStyle(ABC):
    """A way to parallelize one module; :meth:`lower` gives its general plan."""

    @abstractmethod
    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        """The plan for ``module`` (called ``name``), or a PlanError if the style cannot apply."""


def _refuse(style: str, module: nn.Module, name: str, supported: str) -> PlanError:
    return PlanError(
        f"{style} cannot shard module {name!r} ({type(module).__name__}); it supports {supported}"
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

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        if isinstance(module, nn.Linear):
            params: dict[str, Placement] = {"weight": Shard(0)}
            if module.bias is not None:
                params["bias"] = Shard(0)
        elif isinstance(module, nn.Embedding):
            params = {"weight": Shard(1)}
        else:
            raise _refuse("ColwiseParallel", module, name, "nn.Linear and nn.Embedding")
        return ShardingPlan(
            params=params,
            inputs=(Boundary(self.input_layouts or Replicate(), Replicate()),),
            outputs=Boundary(Shard(-1), self.output_layouts or Shard(-1)),
            use_local_output=self.use_local_output,
            style="ColwiseParallel",
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

    input_layouts: Placement | None = None
    output_layouts: Placement | None = None
    use_local_output: bool = True

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        if isinstance(module, nn.Linear):
            params: dict[str, Placement] = {"weight": Shard(1)}
            if module.bias is not None:
                params["bias"] = Replicate()
            desired_input: Placement = Shard(-1)
        elif isinstance(module, nn.Embedding):
            params = {"weight": Shard(0)}
            desired_input = Replicate()
        else:
            raise _refuse("RowwiseParallel", module, name, "nn.Linear and nn.Embedding")
        return ShardingPlan(
            params=params,
            inputs=(Boundary(self.input_layouts or desired_input, desired_input),),
            outputs=Boundary(Partial(), self.output_layouts or Replicate()),
            use_local_output=self.use_local_output,
            replaces_forward=True,
            style="RowwiseParallel",
        )


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


def _boundaries(
    layouts: Sequence[Placement | None] | None,
    desired: Sequence[Placement | None] | None,
    what: str,
    name: str,
) -> tuple[Boundary | None, ...]:
    got = list(layouts or [])
    want = list(desired or [])
    if want and len(want) != len(got):
        raise PlanError(
            f"{what} for module {name!r}: {len(got)} layouts but {len(want)} desired layouts; "
            "give one desired layout per input (None to leave one alone)"
        )
    out: list[Boundary | None] = []
    for i, layout in enumerate(got):
        target = want[i] if want else None
        out.append(None if layout is None and target is None else Boundary(layout, target))
    return tuple(out)


@dataclass(frozen=True)
class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs: ``input_layouts[i]`` as they arrive, ``desired_...[i]`` as the
    module needs them (None leaves an input alone).

    Attributes:
        input_layouts: per positional input.
        desired_input_layouts: per positional input.
        input_kwarg_layouts: per keyword input.
        desired_input_kwarg_layouts: per keyword input.
        use_local_output: hand the module plain local tensors (validation mode keeps DTensors).
    """

    input_layouts: tuple[Placement | None, ...] | None = None
    desired_input_layouts: tuple[Placement | None, ...] | None = None
    input_kwarg_layouts: Mapping[str, Placement] = field(default_factory=dict)
    desired_input_kwarg_layouts: Mapping[str, Placement] = field(default_factory=dict)
    use_local_output: bool = False

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        kwargs = {
            key: Boundary(layout, self.desired_input_kwarg_layouts.get(key))
            for key, layout in self.input_kwarg_layouts.items()
        }
        return ShardingPlan(
            inputs=_boundaries(
                self.input_layouts, self.desired_input_layouts, "PrepareModuleInput", name
            ),
            kwarg_inputs=kwargs,
            use_local_output=self.use_local_output,
            style="PrepareModuleInput",
        )


@dataclass(frozen=True)
class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs: ``output_layouts`` as produced, ``desired_output_layouts``
    as handed on.

    Attributes:
        output_layouts: per output (one placement, or a tuple for tuple outputs).
        desired_output_layouts: per output.
        use_local_output: hand on plain local tensors (validation mode keeps DTensors).
    """

    output_layouts: Placement | tuple[Placement | None, ...] = field(default_factory=Replicate)
    desired_output_layouts: Placement | tuple[Placement | None, ...] = field(
        default_factory=Replicate
    )
    use_local_output: bool = True

    def lower(self, module: nn.Module, name: str) -> ShardingPlan:
        if isinstance(self.output_layouts, tuple) or isinstance(self.desired_output_layouts, tuple):
            layouts = (
                self.output_layouts
                if isinstance(self.output_layouts, tuple)
                else (self.output_layouts,)
            )
            desired = (
                self.desired_output_layouts
                if isinstance(self.desired_output_layouts, tuple)
                else (self.desired_output_layouts,)
            )
            outputs: Boundary | tuple[Boundary | None, ...] = _boundaries(
                layouts, desired, "PrepareModuleOutput", name
            )
        else:
            outputs = Boundary(self.output_layouts, self.desired_output_layouts)
        return ShardingPlan(
            outputs=outputs, use_local_output=self.use_local_output, style="PrepareModuleOutput"
        )

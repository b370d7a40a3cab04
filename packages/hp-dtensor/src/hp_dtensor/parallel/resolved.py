"""The resolved parallel plan: what a sharding plan does to a model, as frozen data.

:func:`resolve` takes a model (a ``meta``-device model is enough: only shapes and dtypes are
read), a mesh and the user's plan (module-name patterns to styles) and returns a
:class:`ParallelPlan`, without any process group: per parameter (by fully qualified name) its
global shape, dtype, ``hp_layout.Layout`` and gradient reduction; per module boundary the
conversion on the parallel axis and the collectives it runs forward and backward; per styled
module its lowered :class:`~hp_dtensor.parallel.plan.ShardingPlan` (expert and context
parallel ones carry their dispatch or sequence plan). A sharder that packs the parameters into
flat buffers (hp-fsdp) adds each parameter's :class:`ParamFlatSlot` once it has planned its groups
(see :mod:`hp_dtensor.contract`).

Production and validation mode are two executors of the same object
(:func:`hp_dtensor.parallel.parallelize_module` resolves, then applies). A plan prints as a
table (:meth:`ParallelPlan.table`) and serializes to JSON (:meth:`ParallelPlan.to_json`), so a
user can see what will run before it runs. Equal plans compare equal; resolution is
deterministic, so every rank resolves the same plan.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hp_dtensor.gradients import dual_placement
from hp_dtensor.parallel.plan import Boundary, PlanError, ShardingPlan, lower_plan
from hp_layout import (
    Layout,
    Mesh,
    Partial,
    Placement,
    RaggedShard,
    ReduceOp,
    Replicate,
    Shard,
    StepKind,
    plan_redistribute,
)

if TYPE_CHECKING:
    from torch import nn

    from hp_dtensor.device_mesh import DeviceMesh
    from hp_dtensor.parallel.styles import ParallelStyle

__all__ = [
    "BoundaryPlan",
    "GradReductionPlan",
    "ModulePlan",
    "ParallelPlan",
    "ParamFlatSlot",
    "ParamPlan",
    "ReductionTime",
    "resolve",
]

Mode = str  # "production" | "validation" (see hp_dtensor.parallel.api.Mode)


class ReductionTime(enum.Enum):
    """When a replicated parameter's partial gradients are reduced."""

    END_OF_BACKWARD = "end of backward"
    """Bucketed into one all-reduce per kind when the backward pass ends, or carried along by
    a sum all-reduce over the same axis that the backward runs anyway (a row-parallel
    output's), which then costs no collective of its own."""


@dataclass(frozen=True)
class GradReductionPlan:
    """How a parameter's gradient is reduced over the mesh axes where it is replicated.

    Attributes:
        axes: ``(axis, op)`` pairs, reduced in this order (production mode: sum over the
            parallel axis, average over the data-parallel axes, as DDP; validation mode: sum
            over every replicated axis, its loss being the global one).
        when: when the reduction happens.
    """

    axes: tuple[tuple[str, ReduceOp], ...]
    when: ReductionTime = ReductionTime.END_OF_BACKWARD

    def describe(self) -> str:
        """``sum(tp), avg(dp)`` for tables."""
        return ", ".join(f"{op.value}({axis})" for axis, op in self.axes)


@dataclass(frozen=True)
class ParamFlatSlot:
    """Where a sharder keeps a parameter: a slot of one group's flat buffer.

    Attributes:
        group: the fully qualified name of the module the group belongs to ("" the root).
        index: the parameter's position in the group.
        offset: its first element in the group's padded flat buffer.
        numel: its elements (of the tensor-parallel local shard when tensor-parallel).
        padding: elements of padding after it (alignment, and the buffer's end).
        buffer_numel: elements of the padded flat buffer.
        chunk_numel: elements of one rank's chunk of the buffer.
        shard_axes: the mesh axes the buffer is cut over.
        replicate_axes: the mesh axes holding replicas of the buffer (HSDP).
        dtype: the buffer's storage dtype.
        rows_per_rank: 0 when the parameter is packed end to end into the buffer (``offset``
            in the whole buffer); otherwise the per-parameter layout (FSDP2's): every rank's
            chunk holds up to this many rows of it (dim 0 cut as ``torch.chunk`` cuts it) at
            ``offset`` within the chunk.
    """

    group: str
    index: int
    offset: int
    numel: int
    padding: int
    buffer_numel: int
    chunk_numel: int
    shard_axes: tuple[str, ...]
    replicate_axes: tuple[str, ...] = ()
    dtype: str = "float32"
    rows_per_rank: int = 0


@dataclass(frozen=True)
class ParamPlan:
    """One parameter, resolved.

    Attributes:
        fqn: its fully qualified name (the first one, for a shared parameter).
        aliases: other names of the same parameter (tied weights).
        global_shape: its whole shape.
        dtype: e.g. ``"float32"``.
        layout: where its pieces live over the mesh (the tensor-parallel layout).
        module: the module that owns it.
        style: the style of that module's plan entry, None when no entry names it.
        reduction: its gradient reduction, None when it is sharded everywhere it is split.
        flat: its slot in a sharder's flat buffer, once one has planned it.
        optimizer_group: the optimizer group a caller assigned it to, if any.
    """

    fqn: str
    global_shape: tuple[int, ...]
    dtype: str
    layout: Layout
    module: str
    style: str | None = None
    aliases: tuple[str, ...] = ()
    reduction: GradReductionPlan | None = None
    flat: ParamFlatSlot | None = None
    optimizer_group: str | None = None

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of ``rank``'s tensor-parallel piece."""
        return self.layout.local_shape(rank)


@dataclass(frozen=True)
class BoundaryPlan:
    """One conversion at a module boundary, on the parallel axis.

    Attributes:
        module: the module name ("" the root).
        style: its plan entry's style.
        where: ``"input 0"``, ``"input 'mask'"``, ``"output"``, ``"output 1"``.
        arrives: the placement the tensor comes with (None: whatever it has).
        leaves: the placement it goes on with.
        forward: the collectives of the conversion in forward, in order (``"all_reduce"``,
            ``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"``); local slices are none.
        backward: the collectives of its adjoint in backward.
    """

    module: str
    style: str
    where: str
    arrives: Placement | None
    leaves: Placement | None
    forward: tuple[str, ...] = ()
    backward: tuple[str, ...] = ()

    @property
    def gathers_output(self) -> bool:
        """An output that is only all-gathered: as the model's output, its backward is a local
        slice (every rank's loss gradient is whole) instead of :attr:`backward`."""
        return (
            self.where.startswith("output")
            and bool(self.forward)
            and all(kind == "all_gather" for kind in self.forward)
        )


@dataclass(frozen=True)
class ModulePlan:
    """A module a plan entry names, with its lowered plan.

    Attributes:
        name: the module name ("" the root).
        module_type: the module's class name.
        sharding: the lowered plan (placements of its own parameters, boundaries; the
            style's own behaviour in production and validation mode).
    """

    name: str
    module_type: str
    sharding: ShardingPlan

    @property
    def style(self) -> str:
        return self.sharding.style


@dataclass(frozen=True)
class ParallelPlan:
    """What a sharding plan does to a model (see the module docstring).

    Attributes:
        mesh: the rank grid.
        tp_axis: the parallel axis the styles shard over.
        dp_axes: the axes over which inputs are split by batch.
        mode: ``"production"`` or ``"validation"`` (they reduce gradients differently).
        modules: the styled modules, in module order.
        params: every parameter, in module order.
        boundaries: every boundary conversion, in module order.
    """

    mesh: Mesh
    tp_axis: str
    dp_axes: tuple[str, ...]
    mode: Mode
    modules: tuple[ModulePlan, ...]
    params: tuple[ParamPlan, ...]
    boundaries: tuple[BoundaryPlan, ...] = field(default=())

    # Queries ------------------------------------------------------------------------------

    def param(self, fqn: str) -> ParamPlan:
        """The parameter named ``fqn`` (or one of its aliases).

        Raises:
            KeyError: no parameter has that name.
        """
        found = self._by_name.get(fqn)
        if found is None:
            raise KeyError(
                f"no parameter {fqn!r} in the plan; it has e.g. {list(self._by_name)[:5]}"
            )
        return found

    def module(self, name: str) -> ModulePlan | None:
        """The styled module called ``name``, None when no plan entry names it."""
        return next((m for m in self.modules if m.name == name), None)

    def model_output(self) -> str | None:
        """The styled module whose output the model is taken to return: the last one in module
        order (an LM head), None without styled modules. Only the predicted counts depend on
        it (a gathered model output's gradient is sliced, with no reduce-scatter)."""
        return self.modules[-1].name if self.modules else None

    def boundary_collectives(self, model_output: str | None = None) -> dict[str, int]:
        """Collectives the boundaries run per forward and backward, by kind (``"all_reduce"``
        ...), each boundary counted once per call of its module, where the model returns the
        output of ``model_output`` (default :meth:`model_output`)."""
        output = self.model_output() if model_output is None else model_output
        counts: dict[str, int] = {}
        for b in self.boundaries:
            sliced = b.module == output and b.gathers_output
            for kind in b.forward if sliced else b.forward + b.backward:
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def sharded(self) -> bool:
        """Whether a sharder (hp-fsdp) has planned flat slots for the parameters: it then
        reduces their gradients itself, in its own collectives (not counted here)."""
        return any(p.flat is not None for p in self.params)

    def reduction_collectives(self) -> dict[str, int]:
        """All-reduces the gradient reductions run of their own per backward: one per axis of
        each distinct reduction, except a single sum over the parallel axis when the
        boundaries' backward runs a sum all-reduce there anyway (the reduction rides on it;
        see :class:`ReductionTime`). None once a sharder holds the parameters
        (:meth:`sharded`): its reduce-scatters and all-reduces do the reductions."""
        if self.sharded():
            return {}
        carrier = any("all_reduce" in b.backward for b in self.boundaries)
        count = 0
        for r in self.reduction_kinds():
            rides = carrier and r.axes == ((self.tp_axis, ReduceOp.SUM),)
            count += 0 if rides else len(r.axes)
        return {"all_reduce": count} if count else {}

    def module_collectives(self) -> dict[str, int]:
        """Collectives the styled modules run inside (expert dispatch, context-parallel
        attention) per forward and backward, each module counted once per call."""
        size = self.mesh.axis_size(self.tp_axis)
        counts: dict[str, int] = {}
        for m in self.modules:
            for kind, n in m.sharding.collectives(size).items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    def collectives_per_step(self, model_output: str | None = None) -> dict[str, int]:
        """Collectives one production-mode forward and backward runs, by kind: the
        boundaries' (:meth:`boundary_collectives`), the modules' own
        (:meth:`module_collectives`) and the gradient reductions'
        (:meth:`reduction_collectives`)."""
        counts = self.boundary_collectives(model_output)
        for part in (self.module_collectives(), self.reduction_collectives()):
            for kind, n in part.items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    def reduction_kinds(self) -> tuple[GradReductionPlan, ...]:
        """The distinct gradient reductions, in first-use order."""
        seen: list[GradReductionPlan] = []
        for p in self.params:
            if p.reduction is not None and p.reduction not in seen:
                seen.append(p.reduction)
        return tuple(seen)

    def with_flat_slots(self, slots: Mapping[str, ParamFlatSlot]) -> ParallelPlan:
        """The plan with each named parameter's flat-buffer slot set.

        Raises:
            KeyError: a name that is not one of the plan's parameters.
        """
        unknown = [name for name in slots if not self._has(name)]
        if unknown:
            raise KeyError(f"flat slots for parameters not in the plan: {unknown}")
        params = tuple(replace(p, flat=slots.get(p.fqn, p.flat)) for p in self.params)
        return replace(self, params=params)

    def with_optimizer_groups(self, groups: Mapping[str, str]) -> ParallelPlan:
        """The plan with the optimizer group of each named parameter set (e.g. ``"muon"``)."""
        unknown = [name for name in groups if not self._has(name)]
        if unknown:
            raise KeyError(f"optimizer groups for parameters not in the plan: {unknown}")
        return replace(
            self,
            params=tuple(
                replace(p, optimizer_group=groups.get(p.fqn, p.optimizer_group))
                for p in self.params
            ),
        )

    # Output -------------------------------------------------------------------------------

    def table(self, rank: int = 0) -> str:
        """The plan as text: a parameter table (global shape, placements, ``rank``'s local
        shape, gradient reduction, flat slot, optimizer group), the boundaries with their
        collectives, and the collectives per step."""
        axes = " x ".join(
            f"{n}={s}" for n, s in zip(self.mesh.axis_names, self.mesh.shape, strict=True)
        )
        lines = [
            f"ParallelPlan ({self.mode} mode) on {axes}: parallel axis {self.tp_axis!r}, "
            f"data axes {list(self.dp_axes)}; local shapes of rank {rank}",
            "",
        ]
        rows = [
            (
                p.fqn,
                "x".join(map(str, p.global_shape)) or "()",
                _placements(p.layout),
                "x".join(map(str, p.local_shape(rank))) or "()",
                p.reduction.describe() if p.reduction else "-",
                _slot(p.flat),
                p.optimizer_group or "-",
            )
            for p in self.params
        ]
        lines += _format(
            ("parameter", "global", "placements", "local", "grad reduction", "flat", "optim"),
            rows,
        )
        if self.boundaries:
            lines += ["", "boundaries (on the parallel axis):"]
            brows = [
                (
                    b.module or "<root>",
                    b.style,
                    b.where,
                    repr(b.arrives) if b.arrives else "any",
                    repr(b.leaves) if b.leaves else "same",
                    ", ".join(b.forward) or "-",
                    ", ".join(b.backward) or "-",
                )
                for b in self.boundaries
            ]
            lines += _format(
                ("module", "style", "where", "arrives", "leaves", "forward", "backward"), brows
            )
        size = self.mesh.axis_size(self.tp_axis)
        details = [(m.name or "<root>", m.style, m.sharding.describe(size)) for m in self.modules]
        details = [d for d in details if d[2]]
        if details:
            lines += ["", "modules with a plan of their own:"]
            lines += _format(("module", "style", "plan"), details)
        reductions = self.reduction_kinds()
        output = self.model_output()
        lines += [
            "",
            f"collectives per step: {_listed(self.collectives_per_step())}",
            f"  at the boundaries: {_listed(self.boundary_collectives())}"
            + (f" (the model returning the output of {output!r})" if output else ""),
            f"  inside modules: {_listed(self.module_collectives())}",
            "  gradient reductions of their own: "
            + (
                "by the sharder (flat slots), in its own collectives, not counted here"
                if self.sharded()
                else _listed(self.reduction_collectives())
            )
            + f"; {len(reductions)} kind(s): "
            + ("; ".join(r.describe() for r in reductions) or "none"),
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (placements as their repr, shapes as lists)."""
        return {
            "mesh": {
                "shape": list(self.mesh.shape),
                "axis_names": list(self.mesh.axis_names),
                "ranks": list(self.mesh.ranks),
            },
            "tp_axis": self.tp_axis,
            "dp_axes": list(self.dp_axes),
            "mode": self.mode,
            "modules": [
                {
                    "name": m.name,
                    "type": m.module_type,
                    "style": m.style,
                    "plan": m.sharding.describe(self.mesh.axis_size(self.tp_axis)),
                }
                for m in self.modules
            ],
            "params": [_param_dict(p) for p in self.params],
            "boundaries": [
                {
                    "module": b.module,
                    "style": b.style,
                    "where": b.where,
                    "arrives": repr(b.arrives) if b.arrives else None,
                    "leaves": repr(b.leaves) if b.leaves else None,
                    "forward": list(b.forward),
                    "backward": list(b.backward),
                }
                for b in self.boundaries
            ],
            "model_output": self.model_output(),
            "collectives_per_step": self.collectives_per_step(),
        }

    def to_json(self, indent: int | None = 1) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    # Internals ----------------------------------------------------------------------------

    @functools.cached_property
    def _by_name(self) -> dict[str, ParamPlan]:
        """Every parameter by each of its names (executors look up every parameter once)."""
        return {n: p for p in self.params for n in (p.fqn, *p.aliases)}

    def _has(self, name: str) -> bool:
        return name in self._by_name


def _listed(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"


def _placements(layout: Layout) -> str:
    return ", ".join(
        f"{axis}: {p!r}" for axis, p in zip(layout.mesh.axis_names, layout.placements, strict=True)
    )


def _slot(slot: ParamFlatSlot | None) -> str:
    if slot is None:
        return "-"
    return f"{slot.group or '<root>'}[{slot.index}] @{slot.offset}+{slot.numel}"


def _param_dict(p: ParamPlan) -> dict[str, Any]:
    return {
        "fqn": p.fqn,
        "aliases": list(p.aliases),
        "global_shape": list(p.global_shape),
        "dtype": p.dtype,
        "placements": [repr(x) for x in p.layout.placements],
        "module": p.module,
        "style": p.style,
        "reduction": (
            None
            if p.reduction is None
            else {
                "axes": [[axis, op.value] for axis, op in p.reduction.axes],
                "when": p.reduction.when.value,
            }
        ),
        "flat": None if p.flat is None else {**p.flat.__dict__},
        "optimizer_group": p.optimizer_group,
    }


def _format(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    rows = [tuple(header), *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    out = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


# Resolution -----------------------------------------------------------------------------------


def _full_placements(
    placement: Placement | tuple[Placement, ...], mesh: Mesh, axis_index: int, where: str
) -> tuple[Placement, ...]:
    if isinstance(placement, tuple):
        if len(placement) != mesh.ndim:
            raise PlanError(
                f"{where}: {len(placement)} placements for a {mesh.ndim}-axis mesh; give one per "
                "axis, or a single placement for the parallel axis"
            )
        return placement
    out: list[Placement] = [Replicate()] * mesh.ndim
    out[axis_index] = placement
    return tuple(out)


def _reduction(
    mesh: Mesh, placements: Sequence[Placement], tp_axis: str, dp_axes: Sequence[str], mode: Mode
) -> GradReductionPlan | None:
    """Production mode: sum over the parallel axis, average over data axes (DDP); validation
    mode: sum over every replicated axis (its DTensor loss is global)."""
    axes: list[tuple[str, ReduceOp]] = []
    for axis, size, p in zip(mesh.axis_names, mesh.shape, placements, strict=True):
        if not isinstance(p, Replicate) or size == 1:
            continue
        if mode == "validation" or axis == tp_axis:
            axes.append((axis, ReduceOp.SUM))
        elif axis in dp_axes:
            axes.append((axis, ReduceOp.AVG))
    return GradReductionPlan(tuple(axes)) if axes else None


_COLLECTIVE_KINDS = {
    StepKind.ALL_GATHER: "all_gather",
    StepKind.REDUCE_SCATTER: "reduce_scatter",
    StepKind.ALL_REDUCE: "all_reduce",
    StepKind.ALL_TO_ALL: "all_to_all",
}


def _collectives(src: Placement, dst: Placement, size: int) -> tuple[str, ...]:
    """The collectives converting ``src`` into ``dst`` on an axis of ``size`` ranks (planned
    on a representative 3-d activation whose dims all split evenly)."""
    if src == dst or size == 1:
        return ()
    if isinstance(dst, Partial) and not isinstance(src, Partial):
        # Into a partial sum is local (zeros beside this rank's piece): the adjoint of a slice.
        return ()
    mesh = Mesh((size,), ("axis",))
    shape = (2 * size, 2 * size, 2 * size)
    try:
        plan = plan_redistribute(Layout(shape, mesh, [src]), Layout(shape, mesh, [dst]))
    except (ValueError, NotImplementedError) as exc:
        raise PlanError(f"no conversion from {src!r} to {dst!r}: {exc}") from exc
    return tuple(_COLLECTIVE_KINDS[s.kind] for s in plan.steps if s.kind in _COLLECTIVE_KINDS)


def _normalized(placement: Placement | None) -> Placement | None:
    """``Shard(-1)`` of the representative 3-d activation is ``Shard(2)``."""
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim % 3)
    return placement


def _boundary(module: str, style: str, where: str, boundary: Boundary, size: int) -> BoundaryPlan:
    arrives, leaves = _normalized(boundary.layout), _normalized(boundary.target)
    forward: tuple[str, ...] = ()
    backward: tuple[str, ...] = ()
    if arrives is not None and leaves is not None:
        forward = _collectives(arrives, leaves, size)
        backward = _collectives(dual_placement(leaves), dual_placement(arrives), size)
    return BoundaryPlan(module, style, where, boundary.layout, boundary.target, forward, backward)


def _boundaries(name: str, sharding: ShardingPlan, size: int) -> list[BoundaryPlan]:
    out: list[BoundaryPlan] = []
    for i, b in enumerate(sharding.inputs):
        if b is not None:
            out.append(_boundary(name, sharding.style, f"input {i}", b, size))
    for key, b in sharding.kwarg_inputs.items():
        out.append(_boundary(name, sharding.style, f"input {key!r}", b, size))
    outputs = sharding.outputs
    if isinstance(outputs, Boundary):
        out.append(_boundary(name, sharding.style, "output", outputs, size))
    elif outputs is not None:
        for i, b in enumerate(outputs):
            if b is not None:
                out.append(_boundary(name, sharding.style, f"output {i}", b, size))
    return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _grid(mesh: object) -> Mesh:
    """The rank grid of an ``hp_layout.Mesh``, of our DeviceMesh or of a torch DeviceMesh."""
    if isinstance(mesh, Mesh):
        return mesh
    grid = getattr(mesh, "mesh", None)
    if isinstance(grid, Mesh):
        return grid
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    if isinstance(mesh, TorchDeviceMesh):
        from hp_dtensor.interop import mesh_from_torch

        return mesh_from_torch(mesh)
    raise TypeError(
        f"resolve: mesh is a {type(mesh).__name__}; give an hp_layout.Mesh, an "
        "hp_dtensor.DeviceMesh or a torch.distributed.device_mesh.DeviceMesh"
    )


def _planned_placements(
    module: nn.Module, lowered: Sequence[tuple[str, ShardingPlan]], grid: Mesh, axis_index: int
) -> tuple[dict[int, tuple[Placement, ...]], dict[int, str]]:
    """Each planned parameter's placements over every mesh axis and the style that placed it,
    by ``id`` of the parameter (a parameter shared by two modules must be placed alike)."""
    placements: dict[int, tuple[Placement, ...]] = {}
    styled: dict[int, str] = {}
    for name, sharding in lowered:
        submodule = module.get_submodule(name)
        for param_name, placement in sharding.params.items():
            param = submodule.get_parameter(param_name)  # dotted: a submodule's parameter
            where = f"parameter {name + '.' if name else ''}{param_name}"
            full = _full_placements(placement, grid, axis_index, where)
            previous = placements.get(id(param))
            if previous is not None and previous != full:
                raise PlanError(
                    f"{where} is shared with another module that places it as {previous}; a "
                    f"shared parameter needs one placement, got {full} too"
                )
            placements[id(param)] = full
            styled[id(param)] = sharding.style
    return placements, styled


def _param_plans(
    module: nn.Module,
    grid: Mesh,
    placements: Mapping[int, tuple[Placement, ...]],
    styled: Mapping[int, str],
    tp_axis: str,
    data_axes: tuple[str, ...],
    mode: Mode,
) -> tuple[ParamPlan, ...]:
    """One :class:`ParamPlan` per distinct parameter in ``named_modules`` order (unplanned ones
    replicated), a shared parameter's other names as its aliases."""
    params: dict[int, ParamPlan] = {}
    order: list[int] = []
    for module_name, sub in module.named_modules():
        for attr, param in sub.named_parameters(recurse=False):
            fqn = f"{module_name}.{attr}" if module_name else attr
            key = id(param)
            if key in params:
                params[key] = replace(params[key], aliases=(*params[key].aliases, fqn))
                continue
            full = placements.get(key, (Replicate(),) * grid.ndim)
            layout = Layout(tuple(param.shape), grid, full)
            if any(isinstance(p, RaggedShard) for p in full):
                raise PlanError(f"parameter {fqn}: RaggedShard is a sharder's placement")
            params[key] = ParamPlan(
                fqn=fqn,
                global_shape=tuple(param.shape),
                dtype=_dtype_name(param.dtype),
                layout=layout,
                module=module_name,
                style=styled.get(key),
                reduction=_reduction(grid, full, tp_axis, data_axes, mode)
                if param.requires_grad
                else None,
            )
            order.append(key)
    return tuple(params[k] for k in order)


def resolve(
    module: nn.Module,
    mesh: Mesh | DeviceMesh | Any,
    plan: Mapping[str, ParallelStyle | ShardingPlan] | ParallelStyle | ShardingPlan,
    *,
    mode: Mode = "production",
    tp_axis: str | None = None,
    dp_axes: Sequence[str] | None = None,
) -> ParallelPlan:
    """The :class:`ParallelPlan` of ``plan`` applied to ``module`` over ``mesh`` (pure: no
    process group, no tensor touched; a ``meta`` model is enough).

    Args:
        module: the model.
        mesh: an ``hp_layout.Mesh``, a :class:`~hp_dtensor.DeviceMesh` or a torch
            ``DeviceMesh`` (only its rank grid is read).
        plan: module-name patterns (``*`` matches one dotted component) to styles, or one
            style for ``module`` itself.
        mode: ``"production"`` or ``"validation"``.
        tp_axis: the mesh axis the styles shard over (default: the only axis).
        dp_axes: axes over which inputs are split by batch (default: every other axis).

    Raises:
        PlanError: as :func:`hp_dtensor.parallel.parallelize_module` (an entry naming no module,
            a style that cannot shard its module, a module named twice, placements that do not
            fit the mesh, a shared parameter placed two ways).
    """
    grid = _grid(mesh)
    if not isinstance(plan, Mapping):
        plan = {"": plan}
    if mode not in ("production", "validation"):
        raise ValueError(f"mode must be 'production' or 'validation', got {mode!r}")
    names = grid.axis_names
    if tp_axis is None:
        if grid.ndim != 1:
            raise PlanError(f"{grid!r} has several axes; say which is tp_axis")
        tp_axis = names[0]
    axis_index = grid.axis_index(tp_axis)
    data_axes = tuple(n for n in names if n != tp_axis) if dp_axes is None else tuple(dp_axes)
    for axis in data_axes:
        grid.axis_index(axis)
    lowered = lower_plan(module, plan)
    placements, styled = _planned_placements(module, lowered, grid, axis_index)
    params = _param_plans(module, grid, placements, styled, tp_axis, data_axes, mode)
    size = grid.axis_size(tp_axis)
    boundaries = [b for name, sharding in lowered for b in _boundaries(name, sharding, size)]
    modules = tuple(
        ModulePlan(name, type(module.get_submodule(name)).__name__, sharding)
        for name, sharding in lowered
    )
    return ParallelPlan(
        mesh=grid,
        tp_axis=tp_axis,
        dp_axes=data_axes,
        mode=mode,
        modules=modules,
        params=params,
        boundaries=tuple(boundaries),
    )

"""``hyper_parallel.core.shard.api``: :func:`shard_module`, upstream's general sharding entry
point, lowered to ``hp_dtensor.parallel.parallelize_module`` in validation mode (parameters
become hp-dtensor DTensors, every op runs by its sharding rule, as upstream's DTensor dispatch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from torch import nn

from hp_dtensor import DeviceMesh, Placement, Replicate, Shard
from hp_dtensor.parallel import Boundary, ParallelStyle, parallelize_module
from hp_dtensor.parallel import ShardingPlan as HpShardingPlan
from hyper_parallel.core.shard.sharding_plan import IOPlacements, ShardingPlan
from hyper_parallel.errors import not_offered
from hyper_parallel.migration import adapts

__all__ = ["shard_module"]

_Placements = tuple[Placement, ...]
_M = TypeVar("_M", bound=nn.Module)


def _is_placement(value: object) -> bool:
    return isinstance(value, Placement)


def _placements(value: object, what: str, ndim: int) -> _Placements:
    if isinstance(value, str) or (
        isinstance(value, Sequence) and any(isinstance(v, str | Sequence) for v in value)
    ):
        raise not_offered(
            f"{what} = {value!r} (alias placements such as ('dp', 'None'))",
            "write one placement per mesh axis, e.g. (Shard(0), Replicate())",
        )
    if not isinstance(value, Sequence) or not all(_is_placement(v) for v in value):
        raise TypeError(
            f"shard_module: {what} must be one placement per mesh axis, e.g. "
            f"(Shard(0), Replicate()); got {value!r}"
        )
    if len(value) != ndim:
        raise ValueError(
            f"shard_module: {what} gives {len(value)} placements {tuple(value)!r} for a mesh of "
            f"{ndim} axes; give one per axis"
        )
    return tuple(value)


def _module_of(key: str, suffix: str, plan_field: str) -> str:
    module_name, _, last = key.rpartition(".")
    if last != suffix:
        raise ValueError(
            f"shard_module: {plan_field} key {key!r} must end with {suffix!r} "
            f"({suffix!r} for the model itself, 'layer.{suffix}' for a submodule)"
        )
    return module_name


def _is_single(value: object) -> bool:
    """One placement tuple (or alias tuple) rather than a sequence of them."""
    return isinstance(value, Sequence) and bool(value) and not isinstance(value[0], Sequence)


def _io(
    value: IOPlacements | object, what: str, ndim: int
) -> tuple[tuple[_Placements | None, ...], dict[str, _Placements]]:
    """(positional placements, keyword placements) of an input_plan/output_plan value."""
    if value is None:
        return (), {}
    if isinstance(value, Mapping):
        keyword = {
            str(k): _placements(v, f"{what}[{k!r}]", ndim)
            for k, v in value.items()
            if v is not None
        }
        return (), keyword
    if isinstance(value, str) or _is_single(value):
        return (_placements(value, what, ndim),), {}
    if not isinstance(value, Sequence):
        raise TypeError(f"shard_module: {what} must be placements, a sequence or a mapping")
    return tuple(
        None if v is None else _placements(v, f"{what}[{i}]", ndim) for i, v in enumerate(value)
    ), {}


def _tp_axis(names: Sequence[str], params: Mapping[str, Mapping[str, _Placements]]) -> int:
    """The one axis the parameters are sharded on (hp-dtensor's parallel axis)."""
    sharded = sorted(
        {
            axis
            for placements in (p for owned in params.values() for p in owned.values())
            for axis, placement in enumerate(placements)
            if not isinstance(placement, Replicate)
        }
    )
    if len(sharded) > 1:
        raise ValueError(
            f"shard_module: the plan shards parameters over mesh axes "
            f"{[names[a] for a in sharded]}; hp-dtensor shards parameters over one "
            "(tensor-parallel) axis: replicate them on the others and shard those with "
            "hyper_parallel.fully_shard(model, mesh=mesh[<data axis>])"
        )
    if sharded:
        return sharded[0]
    if len(names) == 1:
        return 0
    if "tp" in names:
        return list(names).index("tp")
    raise ValueError(
        f"shard_module: no parameter is sharded, so the tensor-parallel axis of the mesh "
        f"{tuple(names)} cannot be told; shard a parameter on it or name it 'tp'"
    )


def _data_axes(
    names: Sequence[str], tp: int, io: Sequence[tuple[str, _Placements]]
) -> tuple[str, ...] | None:
    """The axes over which inputs and outputs are split by batch (hp-dtensor's data axes)."""
    if not io:
        return None
    axes = []
    for axis, name in enumerate(names):
        if axis == tp:
            continue
        kinds: dict[str, list[str]] = {}
        for what, placements in io:
            placement = placements[axis]
            if isinstance(placement, Shard) and placement.dim == 0:
                kind = "split by batch (Shard(0))"
            elif isinstance(placement, Replicate):
                kind = "whole (Replicate())"
            else:
                kind = f"placed {placement!r}"
            kinds.setdefault(kind, []).append(what)
        if len(kinds) > 1 or not any(k.startswith(("split", "whole")) for k in kinds):
            found = "; ".join(f"{', '.join(w)} {k}" for k, w in kinds.items())
            raise not_offered(
                f"shard_module with inputs/outputs on mesh axis {name!r} as: {found}",
                "hp-dtensor moves activations over the tensor-parallel axis "
                f"({names[tp]!r}) only; on every other axis the inputs and outputs must be all "
                "split by batch (Shard(0)) or all whole (Replicate())",
            )
        if next(iter(kinds)).startswith("split"):
            axes.append(name)
    return tuple(axes)


def _boundary(placements: _Placements | None, tp: int) -> Boundary | None:
    return None if placements is None else Boundary(None, placements[tp])


@adapts(
    "hp_dtensor.parallel.parallelize_module",
    "an upstream `ShardingPlan` lowered to hp-dtensor's per-module plans, validation mode",
)
def shard_module(model: _M, device_mesh: DeviceMesh, sharding_plan: ShardingPlan) -> _M:
    """Shard ``model`` in place as upstream's ``sharding_plan`` says; return it.

    Parameters named in ``sharding_plan.plan`` become hp-dtensor DTensors with those
    placements (the others are replicated), the inputs and outputs named in ``input_plan`` /
    ``output_plan`` are redistributed on the way in and out, and every op in between runs on
    DTensors by its sharding rule (``hp_dtensor.parallel.parallelize_module`` in validation
    mode, which also checks each op against the plan). Gradients of parameters replicated over
    a data axis are summed there; ``hyper_parallel.fully_shard`` can then shard the model over
    that axis. ``model`` may be on ``meta`` (:func:`~hyper_parallel.no_init_parameters`).

    The mesh axis the parameters are sharded on is the tensor-parallel axis; on every other
    axis the inputs and outputs must be all split by batch (``Shard(0)``: a data axis) or all
    whole (``Replicate()``).

    Raises:
        NotOfferedError: ``return_local_tensor``, alias placements, or inputs/outputs placed
            on a data axis otherwise than above (the message says what to write).
        hp_dtensor.parallel.PlanError: a name that matches no module or parameter.
    """
    if isinstance(sharding_plan, HpShardingPlan):
        raise TypeError(
            "shard_module takes upstream's hyper_parallel.ShardingPlan(plan=, input_plan=, "
            "output_plan=); an hp_dtensor.parallel.ShardingPlan goes to "
            "hyper_parallel.parallelize_module(model, mesh, {module_name: plan})"
        )
    if not isinstance(sharding_plan, ShardingPlan):
        raise TypeError(
            f"shard_module needs a hyper_parallel.ShardingPlan, got {type(sharding_plan).__name__}"
        )
    if not isinstance(model, nn.Module):
        raise not_offered(
            f"shard_module on a {type(model).__name__} (a callable)",
            "shard an nn.Module; call functions on DTensors directly",
        )
    if sharding_plan.return_local_tensor:
        raise not_offered(
            f"ShardingPlan(return_local_tensor={list(sharding_plan.return_local_tensor)!r})",
            "call .to_local() on those modules' outputs",
        )
    names, ndim = device_mesh.mesh_dim_names, device_mesh.ndim
    params: dict[str, dict[str, _Placements]] = {}
    for key, placements in (sharding_plan.plan or {}).items():
        module_name, _, param = key.rpartition(".")
        params.setdefault(module_name, {})[param] = _placements(placements, f"plan[{key!r}]", ndim)
    inputs: dict[str, tuple[tuple[_Placements | None, ...], dict[str, _Placements]]] = {}
    outputs: dict[str, tuple[_Placements | None, ...]] = {}
    io: list[tuple[str, _Placements]] = []
    for key, value in (sharding_plan.input_plan or {}).items():
        positional, keyword = _io(value, f"input_plan[{key!r}]", ndim)
        inputs[_module_of(key, "input", "input_plan")] = (positional, keyword)
        io += [(f"input_plan[{key!r}]", p) for p in (*positional, *keyword.values()) if p]
    for key, value in (sharding_plan.output_plan or {}).items():
        if isinstance(value, Mapping):
            raise TypeError(
                f"shard_module: output_plan[{key!r}] must be placements or a sequence of them "
                "(one per output), not a mapping"
            )
        positional, _ = _io(value, f"output_plan[{key!r}]", ndim)
        outputs[_module_of(key, "output", "output_plan")] = positional
        io += [(f"output_plan[{key!r}]", p) for p in positional if p]
    tp = _tp_axis(names, params)
    dp_axes = _data_axes(names, tp, io)
    plan: dict[str, ParallelStyle | HpShardingPlan] = {}
    for module_name in sorted({*params, *inputs, *outputs}):
        positional, keyword = inputs.get(module_name, ((), {}))
        out = outputs.get(module_name, ())
        plan[module_name] = HpShardingPlan(
            params=params.get(module_name, {}),
            inputs=tuple(_boundary(p, tp) for p in positional),
            kwarg_inputs={k: Boundary(None, p[tp]) for k, p in keyword.items()},
            outputs=(
                _boundary(out[0], tp) if len(out) == 1 else tuple(_boundary(p, tp) for p in out)
            ),
            style="shard_module",
        )
    parallelize_module(
        model, device_mesh, plan, mode="validation", tp_axis=names[tp], dp_axes=dp_axes
    )
    return model

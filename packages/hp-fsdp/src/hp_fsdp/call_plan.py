"""What one ``fully_shard`` call plans, as a pure function: :func:`plan_fully_shard`.

``fully_shard`` decides which parameters a call manages (those of its module(s) outside modules
a nested call already shards, each parameter object once however often it is registered: tied
weights and shared modules are aliases), splits them by storage dtype (one flat buffer each),
and plans each part with :func:`hp_fsdp.group_plan.plan_group`. Those rules live here, once:
``fully_shard`` runs them on the live module before it allocates, and a planner runs them on a
``meta`` copy of the model, with no process group, through :func:`plan_fully_shard`. Both get
the same :class:`~hp_fsdp.group_plan.GroupPlan` values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from hp_dtensor import DeviceMesh, DTensor
from hp_fsdp._group import Alias
from hp_fsdp._mesh import as_hp_mesh, fsdp_axes
from hp_fsdp._state import fsdp_state
from hp_fsdp.group_plan import GroupPlan, ParamSpec, plan_group, spec_of
from hp_fsdp.policy import MixedPrecisionPolicy, as_mixed_precision
from hp_layout import Mesh

__all__ = [
    "CallParams",
    "by_storage_dtype",
    "check_param_layout",
    "check_shardable",
    "collect_call",
    "members_of",
    "plan_fully_shard",
    "plan_parts",
]

# Set on the original parameters a group took over, to refuse sharing across groups.
OWNER_ATTR = "_hp_fsdp_owner"

PARAM_LAYOUTS = ("flat", "per_param")

Managed = tuple[nn.Module, str, str, nn.Parameter]


@dataclass
class CallParams:
    """The parameters one fully_shard call manages (mutable: it holds live modules).

    Attributes:
        members: the modules of the call (one, or the list's).
        params: ``(module, name, fqn, parameter)`` per managed parameter, in module order;
            ``fqn`` is relative to its member, prefixed ``"<member index>."`` for a list (the
            names the group's plan uses).
        member_of: which member holds each of ``params``.
        aliases: further registrations of a managed parameter, by ``id`` of the parameter.
        owner: the label naming the call in messages (the members' class names, ``+``-joined).
    """

    members: list[nn.Module]
    params: list[Managed]
    member_of: list[int]
    aliases: dict[int, list[Alias]]
    owner: str


def check_param_layout(param_layout: str) -> None:
    """Raises ValueError: ``param_layout`` is neither ``"flat"`` nor ``"per_param"``."""
    if param_layout not in PARAM_LAYOUTS:
        raise ValueError(
            f"fully_shard: param_layout must be 'flat' or 'per_param', got {param_layout!r}"
        )


def collect_call(
    members: list[nn.Module], nested: Callable[[nn.Module], bool], per_param: bool
) -> CallParams:
    """The parameters a call on ``members`` (:func:`members_of`) manages; ``nested(m)`` says
    whether an earlier call shards submodule ``m`` (whose parameters, and its submodules',
    are then skipped).

    Raises:
        ValueError: a parameter another group already shards; a parameter FSDP cannot shard
            (see :func:`check_shardable`).
        NotImplementedError: a non-contiguous parameter.
    """
    owner = "+".join(type(m).__name__ for m in members)
    seen: set[int] = set()
    aliases: dict[int, list[Alias]] = {}
    params: list[Managed] = []
    member_of: list[int] = []
    for index, member in enumerate(members):
        found = _managed(member, index, seen, aliases, nested)
        if len(members) > 1:
            # Unique names in the group's plan: the member's index, then the name in it.
            found = [(m, name, f"{index}.{fqn}", param) for m, name, fqn, param in found]
        params += found
        member_of += [index] * len(found)
    _check_unowned(params, owner)
    check_shardable(params, per_param)
    return CallParams(members, params, member_of, aliases, owner)


def plan_parts(
    call: CallParams,
    mesh: Mesh,
    shard_axis: str,
    replicate_axis: str | None,
    policy: MixedPrecisionPolicy,
    per_param: bool,
    specs: Mapping[nn.Parameter, ParamSpec] | None = None,
) -> list[tuple[GroupPlan, list[int]]]:
    """The call's group plans, one per storage dtype in order of first appearance, each with
    the indices of ``call.params`` it holds (pure: shapes, layouts and dtypes only).
    ``specs[param]`` replaces what :func:`spec_of` reads off ``param`` (its fqn replaced by
    the call's name for it).

    Raises:
        ValueError, NotImplementedError: see :func:`by_storage_dtype` and ``plan_group``.
    """
    out: list[tuple[GroupPlan, list[int]]] = []
    for part in by_storage_dtype(call.params, policy, call.owner):
        plan = plan_group(
            [_spec(call.params[i], specs or {}) for i in part],
            mesh,
            shard_axis,
            replicate_axis,
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            label=call.owner,
            per_param=per_param,
        )
        out.append((plan, part))
    return out


def _spec(entry: Managed, specs: Mapping[nn.Parameter, ParamSpec]) -> ParamSpec:
    _, _, fqn, param = entry
    given = specs.get(param)
    return spec_of(fqn, param) if given is None else replace(given, fqn=fqn)


def plan_fully_shard(
    module: nn.Module | Iterable[nn.Module],
    mesh: Mesh | DeviceMesh | Any,
    *,
    mp_policy: Any = None,
    param_layout: str = "flat",
    nested: Iterable[nn.Module] = (),
    specs: Mapping[nn.Parameter, ParamSpec] | None = None,
) -> tuple[GroupPlan, ...]:
    """The group plans ``fully_shard(module, mesh=mesh, mp_policy=mp_policy,
    param_layout=param_layout)`` would make, without allocating or communicating.

    Pure: reads the parameters' shapes, dtypes and layouts (``hp_dtensor.layout_of`` and
    ``hp_dtensor.contract.grad_reduction_of``: a tensor-parallel model's parameters, plain
    ones, or ``meta`` ones) and the mesh's rank grid and axis names; no process group is used.
    The plans depend on no rank (every rank of the FSDP mesh plans the same ones).

    Args:
        module: the module, or the list of modules, of one call.
        mesh: the FSDP mesh, as an ``hp_layout.Mesh`` or an hp_dtensor/torch ``DeviceMesh``:
            1-d (its axis shards) or 2-d ``(replicate, shard)``, as ``fully_shard`` reads it.
            For ``fully_shard(mesh=None)`` pass the mesh it builds: ``Mesh((world,),
            ("dim0",))`` (torch's default mesh), or the topology's ``(replicate, shard)`` one.
        mp_policy: the call's mixed-precision policy (its ``param_dtype`` and
            ``reduce_dtype`` are planned); None: none.
        param_layout: ``"flat"`` or ``"per_param"``, as ``fully_shard``.
        nested: the modules earlier (nested) calls shard: their parameters, and those of their
            submodules, are theirs. Modules fully_shard already sharded count without being
            named; a planner working on an unsharded (e.g. meta) copy names them here.
        specs: by parameter object, what to plan it with instead of what
            ``hp_fsdp.group_plan.spec_of`` reads off it (the fqn is the call's own): for a
            meta model a tensor-parallel plan was resolved for but not applied (applying it
            needs a process group), ``{p: spec_from_plan(tp_plan.param(name), rank)}``
            (``hp_dtensor.parallel.resolve``; ``rank`` any rank of this FSDP mesh's
            tensor-parallel coordinate).

    Returns:
        one plan per storage dtype of the managed parameters, in order of first appearance
        (one for a model of one dtype). Each plan's ``owner`` is ``""``: ``fully_shard``
        records the module's name relative to the outermost sharded module once that is known
        (``GroupPlan.with_owner``); ``fully_shard(plan=...)`` does not compare it.

    Raises:
        ValueError, TypeError, NotImplementedError: what ``fully_shard`` raises for the same
            modules, mesh and policies before it allocates.
    """
    check_param_layout(param_layout)
    skip = {id(m) for m in nested}
    per_param = param_layout == "per_param"
    members = members_of(module)
    policy = as_mixed_precision(mp_policy)
    call = collect_call(members, lambda m: id(m) in skip or fsdp_state(m) is not None, per_param)
    grid = _grid(mesh)
    shard_axis, replicate_axis = fsdp_axes(grid)
    parts = plan_parts(call, grid, shard_axis, replicate_axis, policy, per_param, specs)
    return tuple(plan for plan, _ in parts)


def _grid(mesh: object) -> Mesh:
    """The rank grid and axis names of ``mesh``."""
    if isinstance(mesh, Mesh):
        return mesh
    hp = as_hp_mesh(mesh)
    if hp is None:
        raise TypeError(
            "plan_fully_shard needs the FSDP mesh (an hp_layout.Mesh or a DeviceMesh), got None"
        )
    return hp.mesh


def members_of(module: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    """The modules one fully_shard call shards as one group.

    Raises:
        TypeError: something other than a module or modules.
        ValueError: none, a repeated one, one inside another, or one already sharded.
    """
    members = [module] if isinstance(module, nn.Module) else list(module)
    if not members:
        raise ValueError("fully_shard got an empty list of modules")
    for m in members:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard takes modules, got {type(m).__name__}")
        if fsdp_state(m) is not None:
            raise ValueError(
                f"{type(m).__name__} is already fully_shard'ed; apply fully_shard once per module"
            )
    for i, a in enumerate(members):
        for j, b in enumerate(members):
            if i != j and any(sub is a for sub in b.modules()):
                raise ValueError(
                    f"fully_shard got module {i} ({type(a).__name__}) inside module {j} "
                    f"({type(b).__name__}); pass modules that do not contain each other"
                )
    return members


def _managed(
    module: nn.Module,
    member: int,
    seen: set[int],
    aliases: dict[int, list[Alias]],
    nested: Callable[[nn.Module], bool],
) -> list[Managed]:
    """Parameters of ``module`` (member ``member`` of the call) not owned by a nested
    fully_shard call, in module order, each once: a parameter object already in ``seen``
    (which grows), registered again by another module or name (tied weights, a shared
    module), is added to ``aliases[id(param)]`` instead, so the group shards it once and
    registers the same objects at every place."""
    out: list[Managed] = []
    places: set[tuple[int, str]] = set()

    def visit(prefix: str, m: nn.Module) -> None:
        if m is not module and nested(m):
            return
        for name, param in m._parameters.items():
            if param is None or (id(m), name) in places:
                continue  # a module registered twice is visited twice
            places.add((id(m), name))
            if id(param) in seen:
                aliases.setdefault(id(param), []).append(Alias(m, name, f"{prefix}{name}", member))
                continue
            seen.add(id(param))
            out.append((m, name, f"{prefix}{name}", param))
        for child_name, child in m._modules.items():
            if child is not None:
                visit(f"{prefix}{child_name}.", child)

    visit("", module)
    return out


def _check_unowned(params: Sequence[Managed], owner: str) -> None:
    for _, _, fqn, param in params:
        earlier = getattr(param, OWNER_ATTR, None)
        if earlier is not None:
            raise ValueError(
                f"parameter {fqn!r} of {owner} is already sharded by the fully_shard group of "
                f"{earlier}; a parameter shared by modules (tied weights) must be sharded by "
                "one call that covers all of them: fully_shard their common parent, or pass "
                "them together, fully_shard([module_a, module_b])"
            )


def check_shardable(params: Sequence[Managed], per_param: bool) -> None:
    """FSDP2's restrictions on a parameter, with its exception types.

    Raises:
        ValueError: a 0-d parameter in the per-parameter layout (no dim 0 to shard; the flat
            layout packs it into the flat buffer like any other).
        NotImplementedError: a non-contiguous parameter (``channels_last``, a transposed
            view): sharding would silently hand back a contiguous one.
    """
    for _, _, fqn, param in params:
        local = param.to_local() if isinstance(param, DTensor) else param
        if per_param and param.ndim == 0:
            raise ValueError(
                "fully_shard doesn't support scalar parameters. "
                f"Change {fqn} to a 1D tensor with numel equal to 1 (or use "
                "param_layout='flat', which packs 0-d parameters)."
            )
        if not local.is_contiguous():
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet: {fqn} has shape "
                f"{tuple(local.shape)} and stride {local.stride()}; make it contiguous before "
                "fully_shard (param.data = param.data.contiguous())"
            )


def by_storage_dtype(
    params: Sequence[Managed], policy: MixedPrecisionPolicy, owner: str
) -> list[list[int]]:
    """Indices of ``params`` per storage dtype, in order of first appearance: one flat buffer
    each. Several storage dtypes need a ``param_dtype`` (all of them compute in it), unless the
    parameters of all but one are frozen (``requires_grad=False``, e.g. FP8 weights beside
    trainable fp32 ones): as FSDP2, only the trainable parameters must share a dtype; frozen
    ones compute in their own.

    Raises:
        ValueError: trainable parameters of several storage dtypes without ``param_dtype``.
    """
    parts: dict[torch.dtype, list[int]] = {}
    for index, (_, _, _, param) in enumerate(params):
        parts.setdefault(param.dtype, []).append(index)
    trainable = {
        dtype for dtype, ix in parts.items() if any(params[i][3].requires_grad for i in ix)
    }
    if len(trainable) > 1 and policy.param_dtype is None:
        example = {str(dtype): params[ix[0]][2] for dtype, ix in parts.items()}
        raise ValueError(
            f"fully_shard({owner!r}): parameters of several dtypes in one group without a "
            f"MixedPrecisionPolicy ({example}); give param_dtype (one flat buffer per storage "
            "dtype, all computing in it), or shard the modules separately"
        )
    return list(parts.values())

"""``fully_shard``: FSDP2-compatible entry point and the methods it adds to a module."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from hp_dtensor import DTensor
from hp_dtensor.contract import hand_over_grad_reduction, record_flat_slots
from hp_fsdp._group import FSDPParam, FSDPParamGroup
from hp_fsdp._mesh import FSDPMesh, as_hp_mesh, resolve_mesh
from hp_fsdp._state import FSDPState, attach_fsdp_state, fsdp_state
from hp_fsdp.call_plan import (
    OWNER_ATTR,
    CallParams,
    Managed,
    check_param_layout,
    collect_call,
    members_of,
    plan_parts,
)
from hp_fsdp.compat import REFUSED_METHODS, UnshardHandle, refusal
from hp_fsdp.group_plan import GroupPlan
from hp_fsdp.plan_check import check_group_plans
from hp_fsdp.policy import (
    CPUOffloadPolicy,
    LowPrecisionCommPolicy,
    MixedPrecisionPolicy,
    PrefetchPolicy,
    as_mixed_precision,
    as_offload,
)
from hp_fsdp.state_dict import register_state_dict_hooks
from hp_kernels.precision import warn_if_bf16_is_slow
from hp_layout import Topology

__all__ = ["FSDPModule", "fully_shard"]


class FSDPModule:
    """Methods every fully_shard'ed module gets (mixed into its class)."""

    def _fsdp_state(self) -> FSDPState:
        state = fsdp_state(cast(nn.Module, self))
        assert state is not None
        return state

    def _states(self, recurse: bool) -> list[FSDPState]:
        module = cast(nn.Module, self)
        if not recurse:
            return [self._fsdp_state()]
        out: list[FSDPState] = []
        for m in module.modules():
            state = fsdp_state(m)
            if state is not None and all(state is not s for s in out):
                out.append(state)  # a list's state once, though each member carries it
        return out

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module._apply`` (behind ``to_empty``, ``to``, ``cuda``, ``cpu``): the group's
        flat chunks get ``fn`` as whole tensors and the sharded parameters (the same objects)
        become views of the results; everything else as usual. ``to_empty(device=...)`` of a
        meta model thus allocates this rank's shards only."""
        state = self._fsdp_state()
        hidden: list[FSDPParam] = []
        for group in state.groups:
            group.apply_to_storage(fn)
            for p in group.params:
                if p.module._parameters.get(p.name) is p.sharded:
                    hidden.append(p)
                    p.place(None)
        try:
            return cast(Any, super())._apply(fn, recurse)
        finally:
            for p in hidden:
                p.place(p.sharded)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now; with ``async_op``, issue the all-gathers
        and return a handle whose ``wait()`` finishes them (FSDP2's ``UnshardHandle``)."""
        groups = self._fsdp_state().groups
        for group in groups:
            group.unshard(async_op=True)

        def wait() -> None:
            for group in groups:
                group.wait()

        if async_op:
            return UnshardHandle(wait)
        wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters."""
        for group in self._fsdp_state().groups:
            group.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """With False, backward accumulates unsharded gradients without reducing them
        (gradient accumulation); the next backward with True reduces everything."""
        for state in self._states(recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2: whether the next backward is the last of the optimizer step; with False,
        FSDP2 may leave that backward's last gradient reductions pending (an overlap for
        microbatched pipelines), with the same gradients once the step's last backward ends.
        hp-fsdp finishes its reductions at the end of every backward, so either value gives
        those gradients; the setting is kept (``is_last_backward``) and changes nothing else.
        Gradient accumulation without reducing is :meth:`set_requires_gradient_sync`."""
        if not isinstance(is_last_backward, bool):
            raise ValueError(f"is_last_backward should be a bool, got {type(is_last_backward)}")
        for state in self._states(True):
            state.is_last_backward = is_last_backward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP gradient accumulation: with False, backward still reduce-scatters over the
        shard axis every micro-step (the unsharded gradients are freed) but skips the
        all-reduce over the replicate (slow) axis, keeping the shard-reduced sum aside; the
        sharded gradients are not updated until a backward with True all-reduces the sum of
        every micro-step since, once. Without a replicate axis it changes nothing. As in
        FSDP2, set True again before the last micro-step of each optimizer step."""
        for state in self._states(recurse):
            state.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        """Whether parameters are freed after forward (and gathered again in backward), the
        root's included (as FSDP2: an explicit setting replaces the default that keeps the
        root's)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for state in self._states(recurse):
            state.reshard_after_forward = reshard_after_forward
            state.auto_reshard_after_forward = False

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2 compatibility: hp-fsdp's collectives always reduce with SUM and divide
        afterwards (by :meth:`set_gradient_divide_factor`'s factor), which is what FSDP2 does
        with ``enable=True``; both settings give the same gradients here."""
        del enable

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether parameters are freed after backward (keep them for the next forward)."""
        for state in self._states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the number of data-parallel ranks
        (1.0 when the loss is already a global mean, e.g. a DTensor loss in validation mode)."""
        if factor <= 0:
            raise ValueError(f"the gradient divide factor must be positive, got {factor}")
        for state in self._states(recurse=True):
            state.gradient_divide_factor = factor

    def set_implicit_prefetch(
        self,
        forward: bool,
        backward: bool | None = None,
        *,
        max_bytes: int | None = None,
        recurse: bool = True,
    ) -> None:
        """Prefetch the next module in forward order (``forward``: the order forwards started
        in the first forward) and the next one backward needs (``backward``, the same as
        ``forward`` when not given: the reverse of the order forwards finished in), backward
        prefetch only for groups of at most ``max_bytes`` unsharded bytes (what it adds to the
        step's peak; None: any). The default is :func:`hp_fsdp.policy.default_prefetch`: both
        directions, no limit. A group whose shard axis has one rank is never prefetched
        (:func:`hp_fsdp.prefetch_plan.decide_prefetch`)."""
        policy = PrefetchPolicy(forward, forward if backward is None else backward, max_bytes)
        for state in self._states(recurse):
            state.implicit_prefetch = policy

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Modules whose all-gather is issued when this module's forward starts."""
        self._fsdp_state().forward_prefetch = [m._fsdp_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Modules whose all-gather is issued when this module's backward starts."""
        self._fsdp_state().backward_prefetch = [m._fsdp_state() for m in modules]


for _name, _reason in REFUSED_METHODS.items():
    setattr(FSDPModule, _name, refusal(_name, _reason))

_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


def fully_shard(
    module: nn.Module | Iterable[nn.Module],
    *,
    mesh: Any = None,
    reshard_after_forward: bool | None = None,
    shard_placement_fn: Any = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: Any = None,
    dp_mesh_dims: Any = None,
    topology: Topology | None = None,
    comm_policy: LowPrecisionCommPolicy | None = None,
    param_layout: str = "flat",
    plan: GroupPlan | Sequence[GroupPlan] | None = None,
) -> Any:
    """Shard ``module``'s parameters (those not owned by nested calls) over the mesh.

    Apply bottom-up: to each block, then to the root. The module's class gains the
    :class:`FSDPModule` methods; its registered parameters become this rank's 1-d pieces of
    the flat buffer, annotated with their layouts.

    Args:
        module: the module, or a list of modules sharded as one group (all-gathered when the
            first of them runs forward, resharded after the last; e.g. the final norm with the
            output head). Parameters may be on ``meta``: the buffers are planned from shapes,
            ``to_empty(device=...)`` allocates this rank's chunk only, and
            ``hp_dtensor.parallel.materialize`` fills it with a single-device init's values.
        mesh: 1-d (shard) or 2-d (replicate, shard) device mesh (an hp_dtensor or a torch
            ``DeviceMesh``); default: all ranks, or the topology's (replicate, shard) mesh.
        reshard_after_forward: free the unsharded parameters after forward (all-gather again
            in backward). None (the default) is True, except for the root, which keeps them
            (FSDP2's rule); an explicit True reshards the root too. An int (FSDP2: reshard to
            a smaller mesh) is refused.
        shard_placement_fn, ignored_params, dp_mesh_dims: FSDP2 arguments hp-fsdp refuses
            (``NotImplementedError``) unless None.
        mp_policy: mixed precision (this package's or torch's ``MixedPrecisionPolicy``).
            Parameters of several storage dtypes (fp32 norms beside bf16 weights) get one flat
            buffer per dtype.
        offload_policy: ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy(pin_memory=...)``:
            sharded parameters, their gradients (and so the optimizer state and step) in host
            memory (torch's classes of those names are accepted too).
        topology: link tiers; the shard axis must lie on the faster tier.
        comm_policy: what the collectives put on the wire (FP8 parameter all-gather, bf16/FP8
            gradient reduction per tier); None: the dtypes of ``mp_policy``.
        param_layout: ``"flat"`` (the default): the module holds this rank's 1-d pieces of
            one flat buffer, annotated with their layouts; the all-gather and the
            reduce-scatter work in place (no copy). ``"per_param"``: FSDP2's layout: each
            parameter a torch ``DTensor`` of its global shape, ``Shard(0)`` on the shard axis,
            whose local rows are views of the flat chunk (shape-aware optimizers,
            ``param.full_tensor()``, torch's state-dict and clipping functions work on them);
            it costs one copy out of the all-gather and one into the reduce-scatter per group
            and step, as FSDP2. Not with tensor parallelism or a ``comm_policy`` yet.
        plan: the group plan(s) a planner made for this call (:func:`plan_fully_shard`, one
            per storage dtype); checked against what the call plans, every field but ``owner``,
            before anything is allocated: a ``ValueError`` names the first difference.

    Returns:
        ``module`` (the list, for a list).
    """
    _refuse_unsupported(reshard_after_forward, shard_placement_fn, ignored_params, dp_mesh_dims)
    check_param_layout(param_layout)
    members = members_of(module)
    policy, offload = as_mixed_precision(mp_policy), as_offload(offload_policy)
    per_param = param_layout == "per_param"
    call = collect_call(members, lambda m: fsdp_state(m) is not None, per_param)
    fsdp = _fsdp_mesh(call, mesh, topology, policy, offload, comm_policy)
    grid, shard, replicate = fsdp.mesh.mesh, fsdp.shard_axis, fsdp.replicate_axis
    parts = plan_parts(call, grid, shard, replicate, policy, per_param)
    if plan is not None:  # before anything is allocated or changed
        check_group_plans(call.owner, [p for p, _ in parts], plan)
    groups = _allocate(call, parts, fsdp, policy, comm_policy, offload)
    _attach(call, groups, policy, reshard_after_forward)
    return module


def _fsdp_mesh(
    call: CallParams,
    mesh: Any,
    topology: Topology | None,
    policy: MixedPrecisionPolicy,
    offload: CPUOffloadPolicy | None,
    comm_policy: LowPrecisionCommPolicy | None,
) -> FSDPMesh:
    """The call's FSDP mesh (``resolve_mesh``), checked against its policies.

    Raises:
        ValueError: pinned offload on a CPU mesh; a replicate-axis reduce dtype without one.
    """
    owner = call.owner
    fsdp = resolve_mesh(as_hp_mesh(mesh), topology, _device_type(call.params))
    if policy.param_dtype == torch.bfloat16 and fsdp.mesh.device_type == "cpu":
        warn_if_bf16_is_slow("cpu", "MixedPrecisionPolicy(param_dtype=torch.bfloat16)")
    if offload is not None and offload.pin_memory and fsdp.mesh.device_type == "cpu":
        raise ValueError(
            f"fully_shard({owner!r}): CPUOffloadPolicy(pin_memory=True) pins host memory for "
            "copies to an accelerator, but the mesh is on the CPU; pass "
            "CPUOffloadPolicy(pin_memory=False)"
        )
    if (
        comm_policy is not None
        and comm_policy.replicate_reduce_dtype is not None
        and fsdp.replicate_axis is None
    ):
        raise ValueError(
            f"fully_shard({owner!r}): comm_policy.replicate_reduce_dtype="
            f"{comm_policy.replicate_reduce_dtype} needs a 2-d (replicate, shard) mesh, got "
            f"{fsdp.mesh!r}; use shard_reduce_dtype for the gradient reduction of a 1-d mesh"
        )
    return fsdp


def _allocate(
    call: CallParams,
    parts: Sequence[tuple[GroupPlan, list[int]]],
    fsdp: FSDPMesh,
    policy: MixedPrecisionPolicy,
    comm_policy: LowPrecisionCommPolicy | None,
    offload: CPUOffloadPolicy | None,
) -> list[FSDPParamGroup]:
    """Allocate one group per planned part and take the parameters over (marked as this
    call's, their tensor-parallel gradient reduction handed over to the group)."""
    params, owner = call.params, call.owner
    groups = [
        FSDPParamGroup(
            plan,
            [params[i] for i in part],
            fsdp,
            policy,
            owner,
            comm_policy,
            offload,
            [call.member_of[i] for i in part],
            call.aliases,
        )
        for plan, part in parts
    ]
    if len(call.members) > 1:
        for group in groups:
            for p in group.params:
                p.fqn = p.fqn.split(".", 1)[1]  # relative to its member, as for one module
    for _, _, _, param in params:
        setattr(param, OWNER_ATTR, owner)
        # This group's reduce-scatter reduces the plan's axes too (group_plan's tail).
        hand_over_grad_reduction(param)
    return groups


def _attach(
    call: CallParams,
    groups: list[FSDPParamGroup],
    policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | None,
) -> None:
    """Give every member the call's state, its hooks, the FSDPModule methods and its slots."""
    input_dtype = policy.param_dtype if policy.cast_forward_inputs else None
    state = FSDPState(
        call.members,
        groups,
        True if reshard_after_forward is None else reshard_after_forward,
        policy.output_dtype,
        input_dtype,
        auto_reshard_after_forward=reshard_after_forward is None,
    )
    for member in call.members:
        attach_fsdp_state(member, state)
        member.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
        member.register_forward_hook(state.post_forward)
        register_state_dict_hooks(member)
        member.__class__ = _fsdp_class(type(member))
        _record_slots(member)


def _state_of(module: nn.Module) -> FSDPState | None:
    """FSDP2's ``fully_shard.state(module)``: the fully_shard state of ``module`` (shared by
    the modules of one list call), or None for a module fully_shard has not sharded."""
    return fsdp_state(module)


fully_shard.state = _state_of  # type: ignore[attr-defined]


def _refuse_unsupported(
    reshard_after_forward: object,
    shard_placement_fn: object,
    ignored_params: object,
    dp_mesh_dims: object,
) -> None:
    """FSDP2 arguments hp-fsdp does not implement: named, never ignored.

    Raises:
        NotImplementedError: one of them is set.
    """
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fully_shard(reshard_after_forward={reshard_after_forward!r}): resharding to a "
            "smaller mesh after forward is not implemented; pass True or False"
        )
    refused = {
        "shard_placement_fn": (shard_placement_fn, "every parameter is sharded on dim 0"),
        "ignored_params": (ignored_params, "leave those parameters out of the module instead"),
        "dp_mesh_dims": (dp_mesh_dims, "pass the data-parallel (sub-)mesh as mesh="),
    }
    for name, (value, instead) in refused.items():
        if value is not None:
            raise NotImplementedError(
                f"fully_shard({name}=...) (torch FSDP2) is not implemented; {instead}"
            )


def _device_type(params: Sequence[Managed]) -> str:
    """The device type of the default mesh: the parameters' (CPU for meta ones)."""
    for _, _, _, param in params:
        local = param.to_local() if isinstance(param, DTensor) else param
        if not local.is_meta:
            return local.device.type
    return "cpu"


def _record_slots(module: nn.Module) -> None:
    """Record the flat slots of ``module``'s groups and of every group nested in it, each named
    by its module's name relative to ``module`` (``hp_dtensor.contract.record_flat_slots``).

    Postcondition: ``parallel_plan_of(module)`` has every sharded parameter's slot, whose
    ``group`` is the name of the module owning it relative to ``module`` (the names of the
    modules of one list joined by ``+``).
    """
    where: dict[int, tuple[FSDPState, dict[int, tuple[str, nn.Module]]]] = {}
    for prefix, sub in module.named_modules():
        state = fsdp_state(sub)
        if state is not None:
            found = where.setdefault(id(state), (state, {}))[1]
            found[state.member_index(sub)] = (prefix, sub)
    for state, found in where.values():
        owner = "+".join(found[i][0] for i in sorted(found))
        for group in state.groups:
            group.plan = group.plan.with_owner(owner)
        for index, (_, sub) in found.items():
            slots = {}
            for group in state.groups:
                by_plan_name = group.plan.flat_slots()
                for p, plan_name in zip(group.params, group.plan.fqns, strict=True):
                    if p.member == index:
                        slots[p.fqn] = by_plan_name[plan_name]
            record_flat_slots(sub, slots)

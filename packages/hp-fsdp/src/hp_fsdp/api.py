"""``fully_shard``: FSDP2-compatible entry point and the methods it adds to a module."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.contract import record_flat_slots
from hp_fsdp._group import FSDPParamGroup, plan_params
from hp_fsdp._mesh import FSDPMesh, resolve_mesh
from hp_fsdp._state import FSDPState
from hp_fsdp.policy import LowPrecisionCommPolicy, MixedPrecisionPolicy, OffloadPolicy
from hp_fsdp.state_dict import register_state_dict_hooks
from hp_layout import Topology

__all__ = ["FSDPModule", "fully_shard"]

_STATE = "_hp_fsdp_state"
# Set on the original parameters a group took over, to refuse sharing across groups.
_OWNER = "_hp_fsdp_owner"


class FSDPModule:
    """Methods every fully_shard'ed module gets (mixed into its class)."""

    def _fsdp_state(self) -> FSDPState:
        state: FSDPState = getattr(self, _STATE)
        return state

    def _states(self, recurse: bool) -> list[FSDPState]:
        module = cast(nn.Module, self)
        if not recurse:
            return [self._fsdp_state()]
        return [s for m in module.modules() if (s := getattr(m, _STATE, None)) is not None]

    def unshard(self, async_op: bool = False) -> None:
        """All-gather this module's parameters now (``async_op``: issue only)."""
        group = self._fsdp_state().group
        if group is not None:
            group.unshard(async_op=async_op)

    def reshard(self) -> None:
        """Free this module's unsharded parameters."""
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """With False, backward accumulates unsharded gradients without reducing them
        (gradient accumulation); the next backward with True reduces everything."""
        for state in self._states(recurse):
            state.requires_gradient_sync = requires_gradient_sync

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

    def set_implicit_prefetch(self, enabled: bool, *, recurse: bool = True) -> None:
        """Prefetch the next module in forward and backward order (the order of the first
        forward). On by default for accelerators, off on CPU (it costs one group's unsharded
        parameters of memory)."""
        for state in self._states(recurse):
            state.implicit_prefetch = enabled

    def set_modules_to_forward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Modules whose all-gather is issued when this module's forward starts."""
        self._fsdp_state().forward_prefetch = [m._fsdp_state() for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Sequence[FSDPModule]) -> None:
        """Modules whose all-gather is issued when this module's backward starts."""
        self._fsdp_state().backward_prefetch = [m._fsdp_state() for m in modules]


_CLASSES: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _CLASSES[cls]


def _managed(module: nn.Module) -> list[tuple[nn.Module, str, str, nn.Parameter]]:
    """Parameters of ``module`` not owned by a nested fully_shard call, in module order."""
    out: list[tuple[nn.Module, str, str, nn.Parameter]] = []
    seen: set[int] = set()

    def visit(prefix: str, m: nn.Module) -> None:
        if m is not module and hasattr(m, _STATE):
            return
        for name, param in m._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            out.append((m, name, f"{prefix}{name}", param))
        for child_name, child in m._modules.items():
            if child is not None:
                visit(f"{prefix}{child_name}.", child)

    visit("", module)
    return out


def fully_shard(
    module: nn.Module | Iterable[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    topology: Topology | None = None,
    comm_policy: LowPrecisionCommPolicy | None = None,
) -> Any:
    """Shard ``module``'s parameters (those not owned by nested calls) over the mesh.

    Apply bottom-up: to each block, then to the root. The module's class gains the
    :class:`FSDPModule` methods; its registered parameters become this rank's 1-d pieces of
    the flat buffer, annotated with their layouts.

    Args:
        module: the module (or a list of modules sharing one group is not supported: pass one).
        mesh: 1-d (shard) or 2-d (replicate, shard) device mesh; default: all ranks, or the
            topology's (replicate, shard) mesh.
        reshard_after_forward: free the unsharded parameters after forward (all-gather again
            in backward); the root keeps them.
        mp_policy: mixed precision.
        offload_policy: only ``OffloadPolicy()`` (no offload) is implemented.
        topology: link tiers; the shard axis must lie on the faster tier.
        comm_policy: what the collectives put on the wire (FP8 parameter all-gather, bf16/FP8
            gradient reduction per tier); None: the dtypes of ``mp_policy``.
    """
    if not isinstance(module, nn.Module):
        raise NotImplementedError("fully_shard of several modules as one group is not supported")
    if hasattr(module, _STATE):
        raise ValueError(
            f"{type(module).__name__} is already fully_shard'ed; apply fully_shard once per module"
        )
    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise NotImplementedError(
            f"{type(offload_policy).__name__} is not implemented; hp-offload provides parameter "
            "offload, and OffloadPolicy() (no offload) is the default"
        )
    policy = mp_policy or MixedPrecisionPolicy()
    params = _managed(module)
    owner = type(module).__name__
    for _, _, fqn, param in params:
        earlier = getattr(param, _OWNER, None)
        if earlier is not None:
            raise ValueError(
                f"parameter {fqn!r} of {owner} is already sharded by the fully_shard group of "
                f"{earlier}; a parameter shared by modules must be sharded by one call that "
                "covers all of them (fully_shard their common parent)"
            )
    device = params[0][3].device if params else torch.device("cpu")
    fsdp = resolve_mesh(mesh, topology, device.type)
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
    group = _plan_and_allocate(params, fsdp, policy, owner, comm_policy)
    for _, _, _, param in params:
        setattr(param, _OWNER, owner)
    input_dtype = policy.param_dtype if policy.cast_forward_inputs else None
    state = FSDPState(module, group, reshard_after_forward, policy.output_dtype, input_dtype)
    setattr(module, _STATE, state)
    module.register_forward_pre_hook(state.pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(state.post_forward)
    register_state_dict_hooks(module)
    module.__class__ = _fsdp_class(type(module))
    _record_slots(module)
    return module


def _plan_and_allocate(
    params: Sequence[tuple[nn.Module, str, str, nn.Parameter]],
    fsdp: FSDPMesh,
    policy: MixedPrecisionPolicy,
    owner: str,
    comm_policy: LowPrecisionCommPolicy | None,
) -> FSDPParamGroup | None:
    """Plan the group of ``params`` (pure), then allocate it; None without parameters."""
    if not params:
        return None
    plan = plan_params(params, fsdp, policy, owner)
    return FSDPParamGroup(plan, params, fsdp, policy, owner, comm_policy)


def _record_slots(module: nn.Module) -> None:
    """Record the flat slots of ``module``'s group and of every group nested in it, each named
    by its module's name relative to ``module`` (``hp_dtensor.contract.record_flat_slots``).

    Postcondition: ``parallel_plan_of(module)`` has every sharded parameter's slot, whose
    ``group`` is the name of the module owning it relative to ``module``.
    """
    for prefix, sub in module.named_modules():
        state: FSDPState | None = getattr(sub, _STATE, None)
        if state is None or state.group is None:
            continue
        state.group.plan = state.group.plan.with_owner(prefix)
        record_flat_slots(sub, state.group.plan.flat_slots())

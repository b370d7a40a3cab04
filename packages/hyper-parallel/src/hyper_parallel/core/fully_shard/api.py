"""``hyper_parallel.core.fully_shard.api``: upstream's ``fully_shard`` (HSDP) on
``hp_fsdp.fully_shard``.

Upstream, like torch FSDP2, hands the model DTensors of each parameter's global shape, so the
usual ``p.ndim == 2`` rule picks Muon's matrices. hp-fsdp's default flat layout hands out 1-d
pieces instead; this adapter asks for hp-fsdp's per-parameter layout
(``param_layout="per_param"``: torch DTensors of the global shape, ``Shard(0)``) wherever hp-fsdp
offers it, i.e. for every group without tensor-parallel parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

from torch import nn

from hp_dtensor import DeviceMesh, DTensor
from hp_fsdp import FSDPModule, GroupPlan, MixedPrecisionPolicy, OffloadPolicy
from hp_fsdp import fully_shard as hp_fully_shard
from hp_fsdp.group_plan import spec_of
from hyper_parallel.errors import not_offered
from hyper_parallel.migration import adapts

__all__ = ["fully_shard"]

_M = TypeVar("_M", bound=nn.Module)


def _modules(module: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    return [module] if isinstance(module, nn.Module) else list(module)


def _own_parameters(member: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters one ``fully_shard`` call on ``member`` takes: those of its subtree outside
    modules an earlier (nested) call already sharded."""
    out: list[tuple[str, nn.Parameter]] = []
    pending: list[tuple[str, nn.Module]] = [("", member)]
    while pending:
        prefix, module = pending.pop()
        out += [(prefix + name, p) for name, p in module.named_parameters(recurse=False)]
        pending += [
            (f"{prefix}{name}.", child)
            for name, child in module.named_children()
            if not isinstance(child, FSDPModule)
        ]
    return out


def _param_layout(modules: list[nn.Module]) -> str:
    """``"per_param"`` (FSDP2's global-shape DTensors, as upstream) unless a parameter is
    already laid out by tensor parallelism (``shard_module``, ``parallelize_module``), for which
    hp-fsdp offers only its flat layout: 1-d pieces annotated with their layouts (hp-muon reads
    their global shapes through ``hp_dtensor.layout_of``)."""
    tensor_parallel = any(
        spec_of(name, p).base is not None for m in modules for name, p in _own_parameters(m)
    )
    return "flat" if tensor_parallel else "per_param"


@overload
def fully_shard(
    module: _M,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    mp_policy: MixedPrecisionPolicy | Any | None = None,
    offload_policy: OffloadPolicy | Any | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    replicate_params: set[nn.Parameter] | None = None,
    comm_fusion: bool = False,
    comm_fusion_zero_copy: bool | None = None,
    sharded_accumulated_grad: bool = False,
    plan: GroupPlan | Sequence[GroupPlan] | None = None,
) -> _M: ...


@overload
def fully_shard(
    module: list[_M],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    mp_policy: MixedPrecisionPolicy | Any | None = None,
    offload_policy: OffloadPolicy | Any | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    replicate_params: set[nn.Parameter] | None = None,
    comm_fusion: bool = False,
    comm_fusion_zero_copy: bool | None = None,
    sharded_accumulated_grad: bool = False,
    plan: GroupPlan | Sequence[GroupPlan] | None = None,
) -> list[_M]: ...


@adapts(
    "hp_fsdp.fully_shard",
    "upstream's HSDP arguments; parameters are DTensors of their global shape "
    "(`param_layout='per_param'`; flat 1-d pieces under tensor parallelism); DTensor "
    "(`shard_module`) parameters' gradients summed",
)
def fully_shard(
    module: Any,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Callable[[nn.Parameter], object] | None = None,
    mp_policy: MixedPrecisionPolicy | Any | None = None,
    offload_policy: OffloadPolicy | Any | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    replicate_params: set[nn.Parameter] | None = None,
    comm_fusion: bool = False,
    comm_fusion_zero_copy: bool | None = None,
    sharded_accumulated_grad: bool = False,
    plan: GroupPlan | Sequence[GroupPlan] | None = None,
) -> Any:
    """Shard ``module``'s parameters over ``mesh`` (1-d: shard; 2-d: replicate x shard, HSDP).

    Apply bottom-up (each block, then the root), as upstream. The arguments are upstream's:

    * ``mesh``: default all ranks; a model sharded by :func:`~hyper_parallel.shard_module`
      needs its data-parallel sub-mesh (``mesh["dp"]``);
    * ``reshard_after_forward``, ``mp_policy``, ``offload_policy``: as hp-fsdp (its
      ``MixedPrecisionPolicy`` / ``CPUOffloadPolicy``, or torch's);
    * ``comm_fusion``, ``comm_fusion_zero_copy``: accepted, nothing to choose: hp-fsdp always
      runs one all-gather and one reduce-scatter per group on one flat buffer (the
      per-parameter layout copies each parameter's rows out of it and into it, as FSDP2);
    * ``shard_placement_fn``, ``ignored_params``, ``replicate_params``,
      ``sharded_accumulated_grad``: not offered (the error says what to use);
    * ``plan`` (hp-fsdp's, not upstream's): the group plan(s) a planner made for the call
      (``hp_fsdp.plan_fully_shard``), checked before anything is allocated.

    The sharded parameters are what upstream and torch FSDP2 hand out: torch DTensors of each
    parameter's global shape, ``Shard(0)`` over the mesh (``Replicate`` on HSDP's replicate
    axis), hp-fsdp's ``param_layout="per_param"``; so ``p.ndim`` and ``p.shape`` are the whole
    parameter's and a ``p.ndim == 2`` rule picks Muon's matrices. Exception: parameters a
    tensor-parallel plan already laid out (:func:`~hyper_parallel.shard_module`,
    :func:`~hyper_parallel.parallelize_module`) are sharded in hp-fsdp's flat layout, the only
    one it offers under tensor parallelism: this rank's 1-d pieces, whose global shape is
    ``hp_dtensor.layout_of(p).global_shape`` (what ``hp_muon.split_params`` and hp-muon's
    ``Muon`` read).

    Gradients of DTensor parameters (a :func:`~hyper_parallel.shard_module` model, whose loss
    is a global DTensor value) are summed over the data-parallel ranks, upstream's default for
    DTensor paths; gradients of plain parameters are averaged (each rank's loss is its own
    mean), as upstream and FSDP2.

    Returns:
        ``module`` (the list, for a list: its modules are sharded as one group).
    """
    _refuse_not_offered(
        shard_placement_fn, ignored_params, replicate_params, sharded_accumulated_grad
    )
    del comm_fusion, comm_fusion_zero_copy  # always fused and in place here
    modules = _modules(module)
    dtensor_params = any(
        isinstance(p, DTensor) for m in modules for p in m.parameters(recurse=True)
    )
    if mesh is None and dtensor_params:
        raise ValueError(
            "fully_shard: the module holds DTensor parameters (shard_module / "
            "parallelize_module(mode='validation')); pass their data-parallel sub-mesh, e.g. "
            "fully_shard(model, mesh=mesh['dp'])"
        )
    hp_fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        param_layout=_param_layout(modules),
        plan=plan,
    )
    if dtensor_params:
        for sharded in modules:
            # Upstream sums DTensor parameters' gradients (reduce_op_type "sum"): the loss of a
            # DTensor model is already the global value.
            sharded.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    return module


def _refuse_not_offered(
    shard_placement_fn: object,
    ignored_params: set[nn.Parameter] | None,
    replicate_params: set[nn.Parameter] | None,
    sharded_accumulated_grad: bool,
) -> None:
    """Upstream arguments hyper_parallel names but does not offer.

    Raises:
        NotOfferedError: one of them is set (the message says what to use instead).
    """
    if shard_placement_fn is not None:
        raise not_offered(
            "fully_shard(shard_placement_fn=...)",
            "hp-fsdp shards every parameter on dim 0 of a flat buffer",
        )
    if ignored_params or replicate_params:
        which = "ignored_params" if ignored_params else "replicate_params"
        raise not_offered(
            f"fully_shard({which}=...)",
            "leave those parameters in a module you do not pass to fully_shard (and, for "
            "replicated ones, all-reduce their gradients yourself, e.g. with "
            "hp_mpmd.all_reduce_gradients)",
        )
    if sharded_accumulated_grad:
        raise not_offered(
            "fully_shard(sharded_accumulated_grad=True) (MindSpore only upstream)",
            "under pipelining, hp_mpmd.PipelineSchedule(before_weight_gradients=...) with "
            "hp-fsdp's set_requires_all_reduce(last) reduce-scatters every microbatch and "
            "all-reduces once per step",
        )

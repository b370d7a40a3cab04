"""State dicts of fully_shard'ed models and their optimizers, FSDP2-compatible.

``model.state_dict()`` gives, for every parameter fully_shard manages, a torch ``DTensor`` of
the parameter's original global shape laid out as torch FSDP2 lays it out: ``Shard(0)`` over
the FSDP shard axis, ``Replicate`` over the replicate axis (HSDP), tensor-parallel placements
kept (the FSDP shard nests inside them: ``_StridedShard`` where torch needs it). Each one is
built from this rank's flat ``RaggedShard`` piece by a planned redistribution
(``hp_layout.plan_redistribute``, run by ``hp_dtensor.execute_plan``): an all-gather along the
shard axis, so **every rank must call** ``state_dict()`` (and ``load_state_dict``) together.
``torch.distributed.checkpoint`` saves the result and reloads it at any world size or layout.

``model.load_state_dict(sd)`` takes torch DTensors of any layout (any mesh: one on another
mesh is gathered whole first), our DTensors, or plain whole tensors of the global shape, and
copies each parameter's piece into the sharded flat buffer in place: the 1-d parameters the
optimizer holds stay the same objects. Unlike FSDP2's, the state dict does not alias the
parameters (a RaggedShard piece is not a torch placement), so a checkpoint is loaded in two
steps::

    sd = model.state_dict()
    osd = get_optimizer_state_dict(model, optimizer)
    torch.distributed.checkpoint.load({"model": sd, "optim": osd}, checkpoint_id=path)
    model.load_state_dict(sd)
    set_optimizer_state_dict(model, optimizer, osd)

Optimizer states are keyed by parameter FQN, as ``torch.distributed.checkpoint.state_dict``
keys them: ``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``;
per-parameter state tensors shaped like the rank's 1-d piece (AdamW's moments) become torch
DTensors like the parameter, other entries (``step``, scalars) are kept as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from hp_dtensor import DeviceMesh, DTensor, execute_plan, from_torch_dtensor
from hp_dtensor.interop import (
    InteropError,
    is_torch_dtensor,
    to_torch_dtensor,
    torch_dtensor_like,
    torch_placements,
)
from hp_dtensor.redistribute import plan_for
from hp_fsdp._group import FSDPParam, ShardedState
from hp_fsdp._state import fsdp_state
from hp_layout import Layout, Replicate, Shard, plan_redistribute

__all__ = [
    "checkpoint_layout",
    "fsdp_params",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "init_optimizer_state",
    "register_state_dict_hooks",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]


# Layouts --------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def checkpoint_layout(layout: Layout) -> Layout:
    """The layout a parameter of FSDP layout ``layout`` has in a state dict.

    The ``RaggedShard`` axis becomes ``Shard(0)``, nested inside the other shards of dim 0
    (torch FSDP2's order); where torch cannot express that for this shape, the FSDP shard is
    applied first instead, and as a last resort the axis is replicated. A layout without a
    ``RaggedShard`` is returned as it is.
    """
    axis = layout.ragged_axis
    if axis is None:
        return layout
    index = layout.mesh.axis_index(axis)
    others = tuple(n for n in layout.shard_order if n != axis)
    candidates: list[Layout] = []
    if layout.ndim > 0:
        sharded = list(layout.placements)
        sharded[index] = Shard(0)
        candidates += [
            layout.with_placements(sharded, order) for order in ((*others, axis), (axis, *others))
        ]
    replicated = list(layout.placements)
    replicated[index] = Replicate()
    candidates.append(layout.with_placements(replicated, others))
    for candidate in candidates:
        try:
            torch_placements(candidate)
        except InteropError:
            continue
        return candidate
    raise InteropError(
        f"no torch DTensor expresses a parameter laid out as {layout!r}; its other placements "
        "have no torch counterpart"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain local tensor of a parameter or state (our DTensor's local shard, a torch
    DTensor's local rows)."""
    if isinstance(t, DTensor) or is_torch_dtensor(t):
        local: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
        return local
    return t


def _per_param(fp: FSDPParam) -> bool:
    """Whether ``fp`` is in the per-parameter layout (a torch DTensor parameter)."""
    return is_torch_dtensor(fp.sharded)


def _device_mesh(fp: FSDPParam) -> DeviceMesh:
    return DeviceMesh.lookup(fp.sharded.device.type, fp.layout.mesh)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage of its own (a slice of a gathered buffer would drag the whole buffer
    into a checkpoint)."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


# Sharded piece <-> checkpoint tensor ------------------------------------------------------------


def _to_checkpoint(local: torch.Tensor, fp: FSDPParam) -> torch.Tensor:
    """This rank's piece ``local`` (1-d, in ``fp.layout``) as a torch DTensor of the
    checkpoint layout (collective over the parameter's mesh)."""
    target = checkpoint_layout(fp.layout)
    mesh = _device_mesh(fp)
    with torch.no_grad():
        out = execute_plan(local.detach(), plan_redistribute(fp.layout, target), mesh)
    return to_torch_dtensor(DTensor(_owned(out), target, mesh))


class _SizeMismatchError(ValueError):
    """A state-dict entry does not have its parameter's global shape."""


def _source(value: torch.Tensor, fp: FSDPParam, key: str) -> tuple[torch.Tensor, Layout]:
    """``value`` as ``(this rank's local tensor, its layout on the parameter's mesh)``."""
    if is_torch_dtensor(value):
        value = from_torch_dtensor(value)  # type: ignore[arg-type]
    shape = fp.layout.global_shape
    if tuple(value.shape) != shape:
        raise _SizeMismatchError(
            f"size mismatch for {key}: the checkpoint holds shape {tuple(value.shape)}, the "
            f"parameter has global shape {shape}"
        )
    if isinstance(value, DTensor):
        if value.dist_layout.mesh == fp.layout.mesh:
            return value.to_local(), value.dist_layout
        # Another mesh: gather the whole tensor (collective over the value's mesh).
        value = value.full_tensor()
    whole = Layout(shape, fp.layout.mesh, [Replicate()] * fp.layout.mesh.ndim)
    return value, whole


def _from_checkpoint(value: torch.Tensor, fp: FSDPParam, key: str) -> torch.Tensor:
    """This rank's 1-d piece (in ``fp.layout``) of the global ``value`` (a torch DTensor of
    any layout, our DTensor, or a whole tensor); collective over the parameter's mesh."""
    with torch.no_grad():
        local, layout = _source(value.detach(), fp, key)
        piece = execute_plan(local, plan_for(layout, fp.layout), _device_mesh(fp))
    return piece.reshape(-1)


# Which parameters are whose --------------------------------------------------------------------


def _module_params(module: nn.Module) -> list[FSDPParam]:
    state = fsdp_state(module)
    if state is None:
        return []
    member = state.member_index(module)
    params: list[FSDPParam] = []
    for group in state.groups:
        group.adopt_registered()
        params += [p for p in group.params if p.member == member]
    return params


def _module_entries(module: nn.Module) -> list[tuple[FSDPParam, list[str]]]:
    """Each parameter registered in fully_shard'ed ``module`` (one member of its call) with
    its names there: the owning one first, then those of its aliases (tied weights); a
    parameter whose only registrations in ``module`` are aliases is listed by those."""
    state = fsdp_state(module)
    if state is None:
        return []
    member = state.member_index(module)
    out: list[tuple[FSDPParam, list[str]]] = []
    for group in state.groups:
        group.adopt_registered()
        for p in group.params:
            names = [p.fqn] if p.member == member else []
            names += [a.fqn for a in p.aliases if a.member == member]
            if names:
                out.append((p, names))
    return out


def fsdp_params(model: nn.Module) -> dict[str, FSDPParam]:
    """Every parameter fully_shard manages under ``model``, by FQN from ``model``."""
    out: dict[str, FSDPParam] = {}
    for prefix, module in model.named_modules():
        for fp in _module_params(module):
            out[f"{prefix}.{fp.fqn}" if prefix else fp.fqn] = fp
    return out


def _by_tensor(model: nn.Module) -> dict[int, tuple[str, FSDPParam | None]]:
    """``id`` of each parameter object an optimizer may hold -> (FQN, its FSDP parameter)."""
    out: dict[int, tuple[str, FSDPParam | None]] = {}
    unsharded: set[int] = set()
    for fqn, fp in fsdp_params(model).items():
        out[id(fp.sharded)] = (fqn, fp)
        if fp.unsharded is not None:
            unsharded.add(id(fp.unsharded))
    for fqn, param in model.named_parameters():
        if id(param) not in out and id(param) not in unsharded:
            out[id(param)] = (fqn, None)
    return out


# Module hooks ----------------------------------------------------------------------------------


class _StateDictHooks:
    """The state-dict hooks of one fully_shard'ed module (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        self.loaded: list[str] = []
        module.register_state_dict_post_hook(self.post_state_dict)
        module.register_load_state_dict_pre_hook(self.pre_load)
        module.register_load_state_dict_post_hook(self.post_load)

    @staticmethod
    def post_state_dict(
        module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
    ) -> None:
        """Replace each managed parameter's entry by its checkpoint DTensor."""
        del local_metadata
        for fp, names in _module_entries(module):
            keys = [prefix + name for name in names if prefix + name in state_dict]
            if not keys:
                continue
            # Per-parameter layout: the parameter itself (aliasing it, as FSDP2's does). A
            # tied parameter's names all get this one tensor.
            value = (
                fp.sharded.detach() if _per_param(fp) else _to_checkpoint(_local(fp.sharded), fp)
            )
            for key in keys:
                state_dict[key] = value

    def pre_load(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Copy each managed parameter's entry into the flat buffer and take it out of the
        (per-call copy of the) state dict, so the default loader leaves it alone."""
        del local_metadata, strict, missing_keys, unexpected_keys
        state = fsdp_state(module)
        assert state is not None
        for group in state.groups:
            if group.state is not ShardedState.SHARDED:
                # The unsharded copy would be stale: drop it (the next forward gathers again).
                group.reshard()
        for fp, names in _module_entries(module):
            # A tied parameter loads from its first name present; every name of it here is
            # taken out (the default loader would copy a global tensor into the piece).
            keys = [prefix + name for name in names if prefix + name in state_dict]
            if not keys:
                continue
            if fp.sharded.is_meta:
                # Copying into a meta piece would load nothing and say nothing.
                raise NotImplementedError(
                    f"load_state_dict into {keys[0]!r}, a fully_shard parameter still on meta "
                    "(torch FSDP2: load_state_dict(..., assign=True) onto a meta model) is not "
                    "implemented; allocate the model first (hp_dtensor.parallel.materialize("
                    "model), or model.to_empty(device=...) in the per-parameter layout), "
                    "then load"
                )
            values = [state_dict.pop(key) for key in keys]
            self.loaded += keys
            key, value = keys[0], values[0]
            try:
                piece = _from_checkpoint(value, fp, key)
            except _SizeMismatchError as error:
                error_msgs.append(str(error))
                continue
            with torch.no_grad():
                _local(fp.sharded).view(-1).copy_(piece)

    def post_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        """The entries taken out in ``pre_load`` were loaded, not missing."""
        del module
        loaded = set(self.loaded)
        self.loaded.clear()
        missing: list[str] = incompatible_keys.missing_keys
        missing[:] = [k for k in missing if k not in loaded]


def register_state_dict_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` / ``load_state_dict`` handle the parameters of
    ``module``'s fully_shard group (fully_shard calls this on every module it shards)."""
    _StateDictHooks(module)


def get_model_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` (collective; see the module docstring)."""
    return dict(model.state_dict())


def set_model_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> Any:
    """``model.load_state_dict(state_dict, strict=strict)`` (collective); returns its
    missing and unexpected keys."""
    return model.load_state_dict(state_dict, strict=strict)


# Optimizer state -------------------------------------------------------------------------------


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (a step with zero gradients at learning rate 0) when it
    has none, so that a checkpoint has tensors to load into (as torch's state-dict API does).
    Collective when the optimizer's step is (Muon's exchange): every rank calls it together.
    Postcondition: the state has the tensors of a stepped optimizer; parameters unchanged
    (learning rate 0)."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    rates = []
    for group in optimizer.param_groups:
        rate = group.get("lr")
        rates.append(rate)
        if rate is not None:
            group["lr"] = torch.tensor(0.0) if isinstance(rate, torch.Tensor) else 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        if rate is not None:
            group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def _is_piece_state(value: Any, fp: FSDPParam) -> bool:
    if isinstance(value, DTensor):
        return value.dist_layout == fp.layout
    local = _local(fp.sharded)
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape


def _param_entries(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> list[list[tuple[torch.Tensor, str, FSDPParam | None]]]:
    """Per optimizer param group: (parameter, FQN, FSDP parameter or None)."""
    lookup = _by_tensor(model)
    out: list[list[tuple[torch.Tensor, str, FSDPParam | None]]] = []
    for group in optimizer.param_groups:
        entries = []
        for p in group["params"]:
            found = lookup.get(id(p))
            if found is None:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not a "
                    "parameter of the model (build the optimizer after fully_shard, from "
                    "model.parameters())"
                )
            entries.append((p, *found))
        out.append(entries)
    return out


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQN, per-parameter tensors as checkpoint
    DTensors (collective; an optimizer without state gets it created first)."""
    init_optimizer_state(optimizer)
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    all_entries = _param_entries(model, optimizer)
    for group, entries in zip(optimizer.param_groups, all_entries, strict=True):
        for p, fqn, fp in entries:
            values = optimizer.state.get(p)
            if not values:
                continue
            state[fqn] = {
                name: (
                    _to_checkpoint(_local(value), fp)
                    if fp is not None and _is_piece_state(value, fp)
                    else value
                )
                for name, value in values.items()
            }
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = [fqn for _, fqn, _ in entries]
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def _restored(value: Any, fp: FSDPParam | None, key: str) -> Any:
    if fp is None or not isinstance(value, torch.Tensor):
        return value
    whole = tuple(value.shape) == fp.layout.global_shape and value.dim() > 0
    if not (is_torch_dtensor(value) or isinstance(value, DTensor) or whole):
        return value
    piece = _from_checkpoint(value, fp, key).clone()
    if not _per_param(fp):
        return piece
    # A state of the parameter's shape, laid out like it (a torch DTensor of its rows).
    like: Any = fp.sharded
    return torch_dtensor_like(piece.view(like.to_local().shape), like)


def set_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load a state dict of :func:`get_optimizer_state_dict`'s form (saved at any world size
    or layout) into ``optimizer`` (collective)."""
    saved_groups: list[dict[str, Any]] = list(state_dict["param_groups"])
    saved_state: Mapping[str, Mapping[str, Any]] = state_dict["state"]
    entries = _param_entries(model, optimizer)
    if len(saved_groups) != len(entries):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups, the optimizer {len(entries)}"
        )
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for saved, group_entries in zip(saved_groups, entries, strict=True):
        fqns = [fqn for _, fqn, _ in group_entries]
        if list(saved["params"]) != fqns:
            raise ValueError(
                f"param group holds {fqns} in the optimizer but {list(saved['params'])} in the "
                "state dict; build the optimizer's groups as they were saved"
            )
        ids = []
        for _, fqn, fp in group_entries:
            values = saved_state.get(fqn)
            if values is not None:
                state[index] = {
                    name: _restored(value, fp, f"state.{fqn}.{name}")
                    for name, value in values.items()
                }
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})

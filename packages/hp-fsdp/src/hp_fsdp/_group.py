"""One FSDP group: its parameters as views of persistent flat buffers, and their collectives.

The group is planned first, as frozen data (:func:`hp_fsdp.group_plan.plan_group`: the order of
its parameters, the flat buffer, their layouts, the order of the gradient reductions); the group
then allocates and copies what its plan says. The parameters are packed end to end
(``hp_layout.plan_flat_buffer``) into a buffer cut into equal per-rank chunks. This rank keeps
its chunk in ``sharded_flat``; each parameter's piece of it is a 1-d view registered on the
module and handed to optimizers, annotated with its layout (a RaggedShard over the shard axis).
Unsharding all-gathers the chunks straight into ``unsharded_flat``, whose views are the
module's parameters during compute (no copy-out); each parameter's gradient, as autograd
produced it, is held until the group is reduced and then copied once into ``unsharded_grad``
(allocated then, never zero-filled), the input of the reduce-scatter; the reduce-scatter
writes this rank's reduced chunk into a view of the root's gradient arena, whose views are the
sharded parameters' gradients.

With a :class:`LowPrecisionCommPolicy`, the all-gather may move this rank's shard as
block-scaled FP8 (quantized once per optimizer step: cached on the shard's version counter
and the process's count of optimizer steps, ``_optimizer_steps``, since torch's foreach ops do
not always bump the counter) and dequantize it into the unsharded buffer; the reduce-scatter
may move bf16/FP8 records and sum them in fp32 (``_lowp_comm``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DTensor, annotate_layout
from hp_dtensor.contract import set_grad_layout, set_materialize_target
from hp_dtensor.device import local_device
from hp_dtensor.interop import is_torch_dtensor, torch_dtensor_like
from hp_dtensor.watchdog import watch, watch_async
from hp_fsdp._collectives import (
    ReduceScatterPrimitive,
    all_gather,
    reduce_scatter,
    reduce_scatter_primitive,
)
from hp_fsdp._lowp_comm import Deferred, WireCodec, all_gather_records, reduce_scatter_lowp
from hp_fsdp._mesh import FSDPMesh
from hp_fsdp._optimizer_steps import optimizer_steps
from hp_fsdp._purpose import collective_purpose
from hp_fsdp._rows import as_torch_dtensor, copy_in, copy_out, local_shape, pack_rows
from hp_fsdp.group_plan import GroupPlan, torch_dtype
from hp_fsdp.policy import CPUOffloadPolicy, LowPrecisionCommPolicy, MixedPrecisionPolicy
from hp_layout import FlatBufferLayout, Layout, ReduceOp

__all__ = ["Alias", "FSDPParam", "FSDPParamGroup", "ShardedState"]


class ShardedState(enum.Enum):
    """Where a group's parameters are."""

    SHARDED = "sharded"
    """Only this rank's chunk exists; the module holds the sharded parameters."""
    UNSHARDING = "unsharding"
    """An all-gather into the unsharded buffer was issued and not waited for."""
    UNSHARDED = "unsharded"
    """The unsharded buffer holds every parameter; the module holds its views."""


class Alias(NamedTuple):
    """A further registration of a parameter the group shards (a tied or shared weight).

    Attributes:
        module: the module registering it.
        name: its attribute name on ``module``.
        fqn: its name there from the fully_shard'ed member module.
        member: which of the modules passed to fully_shard holds ``module``.
    """

    module: nn.Module
    name: str
    fqn: str
    member: int


@dataclass
class FSDPParam:
    """One parameter of a group.

    Attributes:
        module: the module owning it.
        name: its attribute name on ``module``.
        fqn: its name from the root of the fully_shard call.
        shape: the shape of the unsharded parameter (a tensor-parallel shard's, if any).
        base: its layout before FSDP (tensor parallel), or None for a whole parameter.
        layout: its layout with FSDP (RaggedShard on the shard axis).
        sharded: the 1-d view of this rank's piece, registered on the module when sharded.
        unsharded: the view of the unsharded buffer, registered during compute.
        leaf: the autograd leaf aliasing the unsharded buffer (the local tensor of a DTensor).
        member: which of the modules passed to fully_shard owns it (0 for a single module).
        aliases: the other places the same parameter object is registered (tied weights,
            shared modules): they get the same sharded and unsharded objects as ``module``.
    """

    module: nn.Module
    name: str
    fqn: str
    shape: tuple[int, ...]
    base: Layout | None
    layout: Layout
    sharded: nn.Parameter
    unsharded: nn.Parameter | None = None
    leaf: torch.Tensor | None = None
    member: int = 0
    aliases: list[Alias] = field(default_factory=list)

    def place(self, tensor: nn.Parameter | None) -> None:
        """Register ``tensor`` as this parameter on its module and on every alias."""
        self.module._parameters[self.name] = tensor
        for alias in self.aliases:
            alias.module._parameters[alias.name] = tensor

    def registered(self) -> list[nn.Parameter | None]:
        """What its module and then each alias hold now."""
        return [self.module._parameters.get(self.name)] + [
            a.module._parameters.get(a.name) for a in self.aliases
        ]


_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX}

_Param = tuple[nn.Module, str, str, nn.Parameter]


def _in_plan_order(params: Sequence[_Param], plan: GroupPlan) -> list[_Param]:
    """``params`` in the plan's buffer order.

    Raises:
        ValueError: ``params`` are not the planned parameters.
    """
    by_name = {fqn: (module, name, fqn, param) for module, name, fqn, param in params}
    if sorted(by_name) != sorted(plan.fqns) or len(by_name) != len(params):
        raise ValueError(f"the parameters {sorted(by_name)} are not the planned {plan.fqns}")
    return [by_name[fqn] for fqn in plan.fqns]


def _local(param: torch.Tensor) -> torch.Tensor:
    """The data FSDP packs for ``param`` (its tensor-parallel shard, or a per-parameter
    torch DTensor's rows, detached)."""
    if isinstance(param, DTensor) or is_torch_dtensor(param):
        local: torch.Tensor = cast(Any, param).to_local()
        return local.detach()
    return param.detach()


def _on_meta(locals_: Sequence[torch.Tensor], fqns: Sequence[str], owner: str) -> bool:
    """Whether the group's parameters are on ``meta`` (all of them or none).

    Raises:
        ValueError: some are on meta and some are not.
    """
    meta = [fqn for fqn, t in zip(fqns, locals_, strict=True) if t.is_meta]
    if meta and len(meta) != len(fqns):
        real = sorted(set(fqns) - set(meta))
        raise ValueError(
            f"fully_shard({owner!r}): parameters {meta} are on meta but {real} are not; build "
            "the module on one device (all on meta for deferred initialization)"
        )
    return bool(meta)


def _on_wire(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` as a collective moves it: one-byte floats (FP8 parameters, frozen beside
    trainable ones) as their bytes, which every backend can gather (gloo has no FP8 type)."""
    if buffer.is_floating_point() and buffer.element_size() == 1:
        return buffer.view(torch.uint8)
    return buffer


def repoint(param: torch.Tensor, data: torch.Tensor) -> None:
    """Make the parameter object ``param`` hold ``data`` (a view of a flat buffer) as its
    (local) tensor, keeping the object and its attributes, so optimizers and user references
    stay valid."""
    torch_dtensor = is_torch_dtensor(param)
    if (
        not isinstance(param, DTensor)
        and not torch_dtensor
        and param.device.type == data.device.type
    ):
        param.data = data
        return
    inner: torch.Tensor = data
    if isinstance(param, DTensor):
        inner = DTensor(data, param.dist_layout, param.device_mesh)
    elif torch_dtensor:
        inner = torch_dtensor_like(data, param)
    new = nn.Parameter(inner, param.requires_grad)
    for key, value in vars(param).items():
        if key not in vars(new):
            setattr(new, key, value)  # layout annotations and the like
    # A new tensor type (meta to a device, or a DTensor's local tensor): swap the objects'
    # contents so the object the optimizer and the module hold becomes the new one.
    torch.utils.swap_tensors(param, new)


class FSDPParamGroup:
    """The parameters of one fully_shard call (excluding those of nested calls), allocated
    and laid out as their :class:`~hp_fsdp.group_plan.GroupPlan` says."""

    def __init__(
        self,
        plan: GroupPlan,
        params: Sequence[_Param],
        fsdp: FSDPMesh,
        policy: MixedPrecisionPolicy,
        owner: str,
        comm_policy: LowPrecisionCommPolicy | None = None,
        offload: CPUOffloadPolicy | None = None,
        members: Sequence[int] | None = None,
        aliases: Mapping[int, Sequence[Alias]] | None = None,
    ) -> None:
        """Allocate the buffers of ``plan`` and copy ``params``' data into this rank's chunk
        (``members[i]``: which fully_shard'ed module owns ``params[i]``; ``aliases[id(p)]``:
        the further registrations of parameter ``p``, which share its sharded and unsharded
        objects).

        Postconditions: the modules hold the sharded parameters (views of ``sharded_flat``,
        laid out as ``plan.layouts``); the unsharded buffer has no storage yet. Meta
        parameters give a meta ``sharded_flat``, allocated by ``to_empty`` (see
        :meth:`apply_to_storage`) or by ``hp_dtensor.parallel.materialize``, which writes
        each shard into it. With ``offload``, ``sharded_flat`` (and the sharded gradients)
        live in host memory and the collectives run on the mesh's device.
        """
        self.plan = plan
        self.fsdp = fsdp
        self.owner = owner
        self.policy = policy
        self.comm_policy = comm_policy or LowPrecisionCommPolicy()
        # The quantized shard, and the (shard version, optimizer steps) it was made at.
        self._gather_cache: tuple[tuple[int, int], torch.Tensor] | None = None
        owners = members if members is not None else [0] * len(params)
        member_of = {id(param): m for (_, _, _, param), m in zip(params, owners, strict=True)}
        ordered = _in_plan_order(params, plan)
        self.flat: FlatBufferLayout = plan.flat
        self.rows = plan.rows
        self.coordinate = fsdp.mesh.get_local_rank(fsdp.shard_axis)
        if self.rows is not None and self.comm_policy != LowPrecisionCommPolicy():
            raise NotImplementedError(
                f"fully_shard({owner!r}): a LowPrecisionCommPolicy with "
                "param_layout='per_param' is not implemented; use the flat layout for "
                "low-precision collectives"
            )
        self.extra_reduce = plan.extra_reduce
        self.extra_start = plan.extra_start
        self.storage_dtype = torch_dtype(plan.storage_dtype)
        self.param_dtype = torch_dtype(plan.param_dtype)
        self.reduce_dtype = torch_dtype(plan.reduce_dtype)
        self.offload = offload
        locals_ = [_local(param) for _, _, _, param in ordered]
        meta = _on_meta(locals_, plan.fqns, owner)
        if meta or offload is not None:
            self.device = local_device(fsdp.mesh.device_type)
        else:
            self.device = locals_[0].device if locals_ else torch.device("cpu")
        self.storage_device = torch.device("cpu") if offload is not None else self.device
        self.sharded_flat = self._meta_chunk() if meta else self._pack(locals_)
        self.params: list[FSDPParam] = [
            self._sharded_param(index, entry, member_of[id(entry[3])])
            for index, entry in enumerate(ordered)
        ]
        for p, (_, _, _, original) in zip(self.params, ordered, strict=True):
            p.aliases = list((aliases or {}).get(id(original), ()))
        if meta:
            for index, p in enumerate(self.params):
                set_materialize_target(p.sharded, self._materialize_target(index))
        # The last function applied to the storage (module._apply reaches a group once per
        # member module).
        self.applied: object = None
        self._unsharded_flat: torch.Tensor | None = None
        self.unsharded_grad: torch.Tensor | None = None
        # Gradients held until the group is reduced (see prepare_gradients); None: none.
        self._arrived: list[torch.Tensor | None] | None = None
        self._plan_wire()
        # Inputs of in-flight collectives (cast copies) are kept alive until they complete.
        self._keep_alive: torch.Tensor | None = None
        self.state = ShardedState.SHARDED
        self._pending: Any = None
        self._version = 0
        self.register_sharded()

    def _pack(self, locals_: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's chunk of the flat buffer, holding its pieces of ``locals_``.

        Raises:
            ValueError: a tensor's shape is not the planned one.
        """
        for fqn, shape, tensor in zip(self.plan.fqns, self.plan.shapes, locals_, strict=True):
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"parameter {fqn!r} has shape {tuple(tensor.shape)}, planned {shape}"
                )
        coordinate = self.coordinate
        chunk = self._host_or_device_chunk(self.storage_device)
        if self.rows is not None:
            pack_rows(self.rows, coordinate, locals_, chunk)
            return chunk
        for span in self.flat.spans(coordinate):
            piece = locals_[span.index].reshape(-1)[span.start : span.stop]
            chunk[span.chunk_offset : span.chunk_offset + piece.numel()].copy_(piece)
        return chunk

    @property
    def unsharded_bytes(self) -> int:
        """Bytes the group's unsharded parameters take while unsharded (in the compute dtype)."""
        return self.flat.padded_numel * self.param_dtype.itemsize

    @property
    def unsharded_flat(self) -> torch.Tensor:
        """The unsharded buffer (whose views the module computes with); created at the first
        unshard, on the compute device, and without storage while the group is sharded."""
        if self._unsharded_flat is None:
            # Allocated right before the first all-gather fills it (never while initializing).
            flat = torch.empty(self.flat.padded_numel, dtype=self.param_dtype, device=self.device)
            flat.untyped_storage().resize_(0)
            self._unsharded_flat = flat
        return self._unsharded_flat

    def _meta_chunk(self) -> torch.Tensor:
        return torch.empty(self.plan.chunk_numel, dtype=self.storage_dtype, device="meta")

    def _host_or_device_chunk(self, device: torch.device) -> torch.Tensor:
        """A zeroed chunk on ``device`` (pinned host memory when the offload policy says so)."""
        pin = self.offload is not None and self.offload.pin_memory
        return torch.zeros(
            self.plan.chunk_numel, dtype=self.storage_dtype, device=device, pin_memory=pin
        )

    def _materialize_target(self, index: int) -> Any:
        """Where ``hp_dtensor.parallel.materialize`` writes parameter ``index``'s piece: its
        view of ``sharded_flat``, allocated (zeroed) on first use."""

        def target(device: torch.device) -> torch.Tensor:
            if self.sharded_flat.is_meta:
                self._set_storage(self._host_or_device_chunk(self._storage_for(device)))
            return self.local_view(index)

        return target

    def local_shape(self, index: int) -> tuple[int, ...]:
        """The shape of parameter ``index``'s local tensor: its 1-d piece (flat layout) or its
        rows (per-parameter layout)."""
        if self.rows is not None:
            return local_shape(self.rows, index, self.plan.shapes[index], self.coordinate)
        return (self.chunk_range(index)[1],)

    def local_view(self, index: int, chunk: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter ``index``'s local tensor as a view of ``chunk`` (default: this rank's
        sharded chunk)."""
        start, length = self.chunk_range(index)
        source = self.sharded_flat if chunk is None else chunk
        return source[start : start + length].view(self.local_shape(index))

    def _storage_for(self, device: torch.device) -> torch.device:
        """Where the shards live when the model is put on ``device``.

        Raises:
            ValueError: offloaded shards asked to live on an accelerator.
        """
        if self.offload is not None and device.type != "cpu":
            raise ValueError(
                f"fully_shard({self.owner!r}) has a CPUOffloadPolicy: its sharded parameters "
                f"live in host memory, not on {device}; initialize them on 'cpu' (e.g. "
                "to_empty(device='cpu')); the collectives still run on the mesh's device"
            )
        return device

    def _set_storage(self, chunk: torch.Tensor) -> None:
        """Make ``chunk`` this rank's storage and (unless offloaded) the compute device its."""
        self.sharded_flat = chunk
        if self.offload is None:
            self.device = chunk.device
        self.storage_device = chunk.device
        self._unsharded_flat = None
        self._gather_cache = None
        for p in self.params:
            p.unsharded, p.leaf = None, None

    def apply_to_storage(self, fn: Any) -> None:
        """Apply ``nn.Module._apply``'s ``fn`` (``to_empty``, ``to``, ``cuda``, ...) to this
        rank's flat chunk as one tensor, and point the sharded parameters (the same objects)
        at views of the result; nothing is allocated beyond the chunk.

        Raises:
            NotImplementedError: ``fn`` changes the dtype (cast before fully_shard, or use a
                MixedPrecisionPolicy).
        """
        if self.applied is fn:
            return
        self.applied = fn
        with_grads = [p.fqn for p in self.params if p.sharded.grad is not None]
        if with_grads:
            raise NotImplementedError(
                f"fully_shard({self.owner!r}): moving or re-allocating parameters that have "
                f"gradients ({with_grads}); call zero_grad(set_to_none=True) first"
            )
        self.reshard()
        old = self.sharded_flat
        new = fn(old)
        if new is old:
            return
        if new.dtype != old.dtype or new.shape != old.shape:
            raise NotImplementedError(
                f"fully_shard({self.owner!r}): converting the sharded parameters from "
                f"{old.dtype} to {new.dtype} is not supported; convert the module before "
                "fully_shard, or keep the storage dtype and set MixedPrecisionPolicy(param_dtype)"
            )
        self._storage_for(new.device)
        self._set_storage(new.contiguous())
        for index, p in enumerate(self.params):
            repoint(p.sharded, self.local_view(index))

    def adopt_registered(self) -> None:
        """Take over parameter objects that replaced the sharded ones on the modules since
        the last call (``hp_dtensor.parallel.materialize``, a user assigning a parameter):
        copy their data into the flat chunk unless they alias it already, and point them at
        their views of it, so optimizers holding them update the flat buffer.

        Raises:
            ValueError: a replacement has another shape or dtype than the sharded piece, or
                is still on meta while the chunk is not.
        """
        if self.state is not ShardedState.SHARDED:
            return
        for index, p in enumerate(self.params):
            # A replacement on any registration (materialize replaces each module's).
            replaced = [t for t in p.registered() if t is not None and t is not p.sharded]
            if not replaced:
                continue
            current = replaced[0]
            local = _local(current)
            expected = self.local_shape(index)
            if tuple(local.shape) != expected or local.dtype != self.storage_dtype:
                raise ValueError(
                    f"fully_shard({self.owner!r}): parameter {p.fqn!r} was replaced by a "
                    f"{tuple(local.shape)} {local.dtype} local tensor; this rank's sharded "
                    f"piece is {expected} {self.storage_dtype}: assign values with "
                    "load_state_dict or in place (param.copy_)"
                )
            if self.sharded_flat.is_meta and not local.is_meta:
                self._set_storage(self._host_or_device_chunk(self._storage_for(local.device)))
            view = self.local_view(index)
            if local.is_meta and not view.is_meta:
                raise ValueError(
                    f"fully_shard({self.owner!r}): parameter {p.fqn!r} was replaced by a meta "
                    "tensor after the group was materialized"
                )
            if local.data_ptr() != view.data_ptr() or local.is_meta:
                view.copy_(local)
                repoint(current, view)
            p.sharded = current
            p.place(current)  # the tie holds: every registration is the one object again

    def _sharded_param(self, index: int, entry: _Param, member: int = 0) -> FSDPParam:
        """Parameter ``index``'s sharded piece: a view of ``sharded_flat`` with its layout."""
        module, name, fqn, param = entry
        layout, base = self.plan.layouts[index], self.plan.bases[index]
        view = self.local_view(index)
        if self.rows is not None:
            dtensor = as_torch_dtensor(
                view, self.fsdp.mesh, self.fsdp.shard_axis, self.plan.shapes[index]
            )
            sharded = nn.Parameter(dtensor, requires_grad=param.requires_grad)
            return FSDPParam(
                module, name, fqn, self.plan.shapes[index], base, layout, sharded, member=member
            )
        sharded = self._wrap(view, layout, param.requires_grad, isinstance(param, DTensor))
        if isinstance(sharded, DTensor):
            # After the reductions the sharded gradient has the parameter's layout.
            set_grad_layout(sharded, layout)
        else:
            annotate_layout(sharded, layout, rank=self.fsdp.mesh.get_rank())
        return FSDPParam(
            module, name, fqn, self.plan.shapes[index], base, layout, sharded, member=member
        )

    def _plan_wire(self) -> None:
        """The byte records of the low-precision collectives (fixed for the group's life)."""
        comm = self.comm_policy
        chunk = self.plan.chunk_numel
        self.gather_codec: WireCodec | None = None
        if comm.param_all_gather_dtype is not None:
            if not self.storage_dtype.is_floating_point:
                raise ValueError(
                    f"fully_shard({self.owner!r}): an FP8 parameter all-gather "
                    f"({comm.param_all_gather_dtype}) needs floating-point parameters, got "
                    f"{self.storage_dtype}; leave param_all_gather_dtype None for this module"
                )
            self.gather_codec = WireCodec(comm.param_all_gather_dtype, chunk, comm.block_size)
            optimizer_steps()  # starts the count before any step this cache must see
        self.reduce_codec: WireCodec | None = None
        # Chosen at the first reduce-scatter (the process group exists by then, not always at
        # construction, e.g. for meta-device planning).
        self._reduce_scatter_primitive: ReduceScatterPrimitive | None = None
        wire = comm.shard_reduce_dtype
        if wire is not None and wire != torch.float32:
            self.reduce_codec = WireCodec(wire, chunk, comm.block_size)
        self.param_quantizations = 0
        """Times this rank's shard was quantized for the all-gather (once per step)."""

    def chunk_range(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of parameter ``index``'s piece in this rank's chunk."""
        ranges = self.__dict__.get("_chunk_ranges")
        if ranges is None and self.rows is not None:
            ranges = {
                i: (slot.offset, slot.local_rows(self.coordinate) * slot.inner)
                for i, slot in enumerate(self.rows.slots)
            }
            self.__dict__["_chunk_ranges"] = ranges
        if ranges is None:
            ranges = {
                s.index: (s.chunk_offset, s.stop - s.start)
                for s in self.flat.spans(self.coordinate)
            }
            self.__dict__["_chunk_ranges"] = ranges
        found: tuple[int, int] = ranges.get(index, (0, 0))
        return found

    def _wrap(
        self, view: torch.Tensor, layout: Layout, requires_grad: bool, as_dtensor: bool
    ) -> nn.Parameter:
        if not as_dtensor:
            return nn.Parameter(view, requires_grad=requires_grad)
        from hp_dtensor import DeviceMesh

        device_mesh = DeviceMesh.lookup(self.device.type, layout.mesh)
        return nn.Parameter(DTensor(view, layout, device_mesh), requires_grad=requires_grad)

    # Registration ---------------------------------------------------------------------------

    def register_sharded(self) -> None:
        """Put the sharded parameters on the modules."""
        for p in self.params:
            p.place(p.sharded)

    def _register_unsharded(self) -> None:
        for p in self.params:
            if p.unsharded is None:
                self._make_unsharded(p)
            assert p.unsharded is not None
            p.place(p.unsharded)

    def _make_unsharded(self, p: FSDPParam) -> None:
        slot = self.flat.slots[self.params.index(p)]
        view = self.unsharded_flat[slot.offset : slot.end].view(p.shape)
        requires_grad = p.sharded.requires_grad
        if p.base is not None and isinstance(p.sharded, DTensor):
            from hp_dtensor import DeviceMesh

            mesh = DeviceMesh.lookup(self.device.type, p.base.mesh)
            wrapped = nn.Parameter(DTensor(view, p.base, mesh), requires_grad)
            p.unsharded = wrapped
            # nn.Parameter detaches: its local tensor is the leaf aliasing the buffer.
            p.leaf = cast(DTensor, wrapped).to_local()
        else:
            # A leaf aliasing the buffer (and sharing its version counter).
            p.unsharded = nn.Parameter(view, requires_grad=requires_grad)
            p.leaf = p.unsharded

    # Unshard / reshard ---------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """All-gather the parameters (asynchronously with ``async_op``; see ``wait``)."""
        if self.state is not ShardedState.SHARDED:
            return
        self.adopt_registered()
        if self.sharded_flat.is_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training: "
                f"fully_shard({self.owner!r}): the parameters are still on meta; allocate them "
                "with module.to_empty(device=...) and initialize them, or run "
                "hp_dtensor.parallel.materialize(module)"
            )
        storage = self.unsharded_flat.untyped_storage()
        storage.resize_(self.unsharded_flat.numel() * self.unsharded_flat.element_size())
        self._version = self.unsharded_flat._version
        if self.gather_codec is not None:
            self._pending = self._unshard_quantized(self.gather_codec)
        else:
            source = self.sharded_flat
            if self.offload is not None:
                # Host to device (a real copy even when the mesh's device is the CPU).
                source = torch.empty_like(source, dtype=self.param_dtype, device=self.device)
                source.copy_(self.sharded_flat, non_blocking=self.offload.pin_memory)
            elif self.param_dtype != self.storage_dtype:
                source = source.to(self.param_dtype)
            if self.rows is not None:
                self._pending = self._unshard_rows(source)
            elif self.fsdp.shard_size == 1:
                self.unsharded_flat.copy_(source)
                self._pending = None
            else:
                group = self.fsdp.mesh.get_group(self.fsdp.shard_axis)
                with collective_purpose("param_all_gather"):
                    self._pending = all_gather(
                        _on_wire(self.unsharded_flat),
                        _on_wire(source),
                        group,
                        self.fsdp.shard_size,
                    )
                self._keep_alive = source
        self.state = ShardedState.UNSHARDING
        if not async_op:
            self.wait()

    def _unshard_rows(self, source: torch.Tensor) -> Deferred:
        """Per-parameter layout: all-gather the chunks (rank-major), then copy each parameter
        out into the unsharded buffer when waited for."""
        rows = self.rows
        assert rows is not None
        world = self.fsdp.shard_size
        gathered = torch.empty(world * rows.chunk_numel, dtype=self.param_dtype, device=self.device)
        work = None
        if world == 1:
            gathered.copy_(source)
        else:
            group = self.fsdp.mesh.get_group(self.fsdp.shard_axis)
            with collective_purpose("param_all_gather"):
                work = watch_async(
                    "all_gather (FSDP parameters)",
                    group,
                    dist.all_gather_single(
                        _on_wire(gathered), _on_wire(source), group=group, async_op=True
                    ),
                )

        def finish() -> None:
            copy_out(rows, gathered, self.flat, self.unsharded_flat)

        return Deferred(work, finish, gathered, source)

    def quantized_shard(self) -> torch.Tensor:
        """This rank's shard as an FP8 record (``uint8``: data, then scales), quantized only
        when the shard may have changed since the last call: its version counter moved, or an
        optimizer stepped (:mod:`hp_fsdp._optimizer_steps`: foreach updates under a dispatch
        mode leave the counter where it was)."""
        codec = self.gather_codec
        assert codec is not None
        version = (self.sharded_flat._version, optimizer_steps())
        if self._gather_cache is not None and self._gather_cache[0] == version:
            return self._gather_cache[1]
        # No all-gather reading the previous record is in flight: they complete within the
        # step, and the shard only changes between steps.
        record = (
            self._gather_cache[1]
            if self._gather_cache is not None
            else torch.empty(codec.nbytes, dtype=torch.uint8, device=self.storage_device)
        )
        codec.encode(self.sharded_flat, record)
        self.param_quantizations += 1
        self._gather_cache = (version, record)
        return record

    def _unshard_quantized(self, codec: WireCodec) -> Deferred:
        record = self.quantized_shard()
        if self.offload is not None:
            record = record.to(self.device, copy=True)
        chunk, world = codec.numel, self.fsdp.shard_size
        if world == 1:
            # Quantized all the same, so one rank computes with what n ranks would.
            gathered, work = record.view(1, -1), None
        else:
            group = self.fsdp.mesh.get_group(self.fsdp.shard_axis)
            gathered, work = all_gather_records(record, world, group, "param_all_gather")

        def dequantize() -> None:
            for r in range(world):
                piece = codec.decode(gathered[r], self.param_dtype)
                self.unsharded_flat[r * chunk : (r + 1) * chunk].copy_(piece)

        return Deferred(work, dequantize, gathered)

    def wait(self) -> None:
        """Finish a pending unshard and put the unsharded parameters on the modules."""
        if self.state is ShardedState.UNSHARDING:
            if self._pending is not None:
                self._pending.wait()
                self._pending = None
                self._keep_alive = None
            # The collective wrote the buffer in place; the parameters' saved views stay valid.
            torch._C._autograd._unsafe_set_version_counter((self.unsharded_flat,), (self._version,))
            self.state = ShardedState.UNSHARDED
        if self.state is ShardedState.UNSHARDED:
            self._register_unsharded()

    def reshard(self) -> None:
        """Free the unsharded parameters; the modules hold the sharded ones again."""
        if self.state is ShardedState.UNSHARDING:
            self.wait()
        if self.state is ShardedState.SHARDED:
            return
        self.register_sharded()
        if self._unsharded_flat is not None:
            self._unsharded_flat.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED

    # Gradients ------------------------------------------------------------------------------

    @property
    def trainable(self) -> bool:
        """Whether any parameter of the group requires a gradient."""
        return any(p.sharded.requires_grad for p in self.params)

    def prepare_gradients(self) -> None:
        """Get ready to collect this backward's gradients (nothing for a group of frozen
        parameters: there is nothing to reduce).

        Autograd accumulates each parameter's gradient into the parameter as usual (stealing
        the tensor its backward produced) and :meth:`take_gradient` holds it, adding any later
        part (a parameter whose gradient arrives in several parts, through reentrant activation
        checkpointing, or over micro-steps without gradient sync). The flat buffer the
        reduce-scatter reads is allocated only when the group is reduced (:meth:`flatten`, one
        copy per parameter), never zero-filled, and not at the start of backward, where the
        step's memory peaks: a whole block's gradient buffer there would add a block to the
        peak (``tests/test_memory.py``)."""
        if not self.trainable:
            return
        if self._arrived is None:
            self._arrived = [None] * len(self.params)

    @property
    def has_gradients(self) -> bool:
        """Whether gradients are being collected for a reduce-scatter."""
        return self._arrived is not None or self.unsharded_grad is not None

    def take_gradient(self, index: int) -> None:
        """Hold parameter ``index``'s accumulated gradient (``leaf.grad``), added to what it
        already holds, and drop it from the parameter."""
        leaf = self.params[index].leaf
        if leaf is None or leaf.grad is None:
            return
        grad, leaf.grad = leaf.grad, None
        self.prepare_gradients()  # a no-op when this backward already prepared the group
        assert self._arrived is not None
        held = self._arrived[index]
        self._arrived[index] = grad if held is None else held.add_(grad)

    def flatten(self) -> torch.Tensor:
        """The flat gradient buffer: every held gradient copied into its slot, zeros where no
        gradient arrived (unused or frozen parameters, alignment padding)."""
        if self.unsharded_grad is None:
            arrived = self._arrived or [None] * len(self.params)
            grad = torch.empty(self.flat.padded_numel, dtype=self.param_dtype, device=self.device)
            start = 0
            for p, slot, held in zip(self.params, self.flat.slots, arrived, strict=True):
                if held is None:
                    continue
                if slot.offset > start:
                    grad[start : slot.offset].zero_()
                grad[slot.offset : slot.end].view(p.shape).copy_(held)
                start = slot.end
            if start < grad.numel():
                grad[start:].zero_()
            self.unsharded_grad = grad
        self._arrived = None
        return self.unsharded_grad

    def reduce_scatter(self, output: torch.Tensor) -> Any:
        """Reduce-scatter the flat gradient into ``output`` (this rank's chunk, reduce dtype);
        returns the async work handle (None when nothing is communicated)."""
        self.flatten()
        assert self.unsharded_grad is not None
        if self.extra_reduce and self.extra_start < self.flat.padded_numel:
            tail = self.unsharded_grad[self.extra_start :]
            for axis, op in self.extra_reduce:
                mesh = self.params[-1].layout.mesh
                from hp_dtensor import DeviceMesh

                group = DeviceMesh.lookup(self.device.type, mesh).get_group(axis)
                with (
                    collective_purpose("grad_extra_all_reduce"),
                    watch("all_reduce (FSDP gradient tail)", group),
                ):
                    dist.all_reduce(tail, op=_TORCH_OPS[op], group=group)
        if self.fsdp.shard_size > 1 and self.reduce_codec is not None:
            # Encode the gradient as computed (param dtype, no cast to the reduce dtype first);
            # the receivers accumulate in fp32.
            group = self.fsdp.mesh.get_group(self.fsdp.shard_axis)
            return reduce_scatter_lowp(
                self.unsharded_grad, output, self.reduce_codec, self.fsdp.shard_size, group
            )
        source = self.unsharded_grad
        if self.rows is not None:
            # Rank-major, padding zeroed (the rows past a parameter's last reduce to zero).
            rank_major = torch.zeros(
                self.fsdp.shard_size * self.rows.chunk_numel,
                dtype=self.reduce_dtype,
                device=self.device,
            )
            copy_in(self.rows, source, self.flat, rank_major)
            source = rank_major
        elif self.reduce_dtype != self.param_dtype:
            source = source.to(self.reduce_dtype)
        if self.fsdp.shard_size == 1:
            output.copy_(source)
            return None
        group = self.fsdp.mesh.get_group(self.fsdp.shard_axis)
        if self._reduce_scatter_primitive is None:
            self._reduce_scatter_primitive = reduce_scatter_primitive(group)
        with collective_purpose("grad_reduce_scatter"):
            work = reduce_scatter(
                output, source, group, self.fsdp.shard_size, self._reduce_scatter_primitive
            )
        self._keep_alive = source
        return work

    def release_gradients(self) -> None:
        """Drop the unsharded gradients (after their reduce-scatter)."""
        for p in self.params:
            if p.leaf is not None:
                p.leaf.grad = None
        self.unsharded_grad = None
        self._arrived = None
        self._keep_alive = None

    def assign_sharded_gradients(self, chunk: torch.Tensor, accumulate: bool = False) -> None:
        """Make views of ``chunk`` (this rank's reduced chunk) the sharded parameters' grads,
        or, with ``accumulate``, add them to the gradients they have. Gradients take the
        storage dtype and device (host memory when offloaded: a copy of the chunk there)."""
        if self.offload is not None or chunk.dtype != self.storage_dtype:
            pin = self.offload is not None and self.offload.pin_memory
            staged = torch.empty(
                chunk.shape, dtype=self.storage_dtype, device=self.storage_device, pin_memory=pin
            )
            chunk = staged.copy_(chunk)
        for index, p in enumerate(self.params):
            if not p.sharded.requires_grad:
                continue
            grad = self.local_view(index, chunk)
            if self.rows is not None:
                grad = torch_dtensor_like(grad, p.sharded)  # the parameter's placements
            target = p.sharded.to_local() if isinstance(p.sharded, DTensor) else p.sharded
            if target.grad is None or not accumulate:
                target.grad = grad
            else:
                target.grad.add_(grad)

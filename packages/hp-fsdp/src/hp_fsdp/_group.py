"""One FSDP group: its parameters as views of persistent flat buffers, and their collectives.

The group is planned first, as frozen data (:func:`hp_fsdp.group_plan.plan_group`: the order of
its parameters, the flat buffer, their layouts, the order of the gradient reductions); the group
then allocates and copies what its plan says. The parameters are packed end to end
(``hp_layout.plan_flat_buffer``) into a buffer cut into equal per-rank chunks. This rank keeps
its chunk in ``sharded_flat``; each parameter's piece of it is a 1-d view registered on the
module and handed to optimizers, annotated with its layout (a RaggedShard over the shard axis).
Unsharding all-gathers the chunks straight into ``unsharded_flat``, whose views are the
module's parameters during compute (no copy-out); gradients accumulate into views of
``unsharded_grad`` (no copy-in), which is the input of the reduce-scatter; the reduce-scatter
writes this rank's reduced chunk into a view of the root's gradient arena, whose views are the
sharded parameters' gradients.

With a :class:`LowPrecisionCommPolicy`, the all-gather may move this rank's shard as
block-scaled FP8 (quantized once per optimizer step: cached on the shard's version counter,
which every in-place update of a sharded parameter bumps) and dequantize it into the unsharded
buffer; the reduce-scatter may move bf16/FP8 records and sum them in fp32 (``_lowp_comm``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor import DTensor, annotate_layout
from hp_dtensor.contract import set_grad_layout
from hp_fsdp._lowp_comm import Deferred, WireCodec, all_gather_records, reduce_scatter_lowp
from hp_fsdp._mesh import FSDPMesh
from hp_fsdp.counting import collective_purpose
from hp_fsdp.group_plan import GroupPlan, plan_group, spec_of, torch_dtype
from hp_fsdp.policy import LowPrecisionCommPolicy, MixedPrecisionPolicy
from hp_layout import FlatBufferLayout, Layout, ReduceOp

__all__ = ["FSDPParam", "FSDPParamGroup", "ShardedState", "plan_params"]


class ShardedState(enum.Enum):
    """Where a group's parameters are."""

    SHARDED = "sharded"
    """Only this rank's chunk exists; the module holds the sharded parameters."""
    UNSHARDING = "unsharding"
    """An all-gather into the unsharded buffer was issued and not waited for."""
    UNSHARDED = "unsharded"
    """The unsharded buffer holds every parameter; the module holds its views."""


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


_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MAX: dist.ReduceOp.MAX}

_Param = tuple[nn.Module, str, str, nn.Parameter]


def plan_params(
    params: Sequence[_Param], fsdp: FSDPMesh, policy: MixedPrecisionPolicy, label: str
) -> GroupPlan:
    """The plan of the group of ``params`` (pure: reads shapes, layouts and dtypes only).

    Postcondition: ``plan.fqns`` names each of ``params`` once (see :func:`plan_group`).
    """
    return plan_group(
        [spec_of(fqn, param) for _, _, fqn, param in params],
        fsdp.mesh.mesh,
        fsdp.shard_axis,
        fsdp.replicate_axis,
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        label=label,
    )


def _in_plan_order(params: Sequence[_Param], plan: GroupPlan) -> list[_Param]:
    """``params`` in the plan's buffer order.

    Raises:
        ValueError: ``params`` are not the planned parameters.
    """
    by_name = {fqn: (module, name, fqn, param) for module, name, fqn, param in params}
    if sorted(by_name) != sorted(plan.fqns) or len(by_name) != len(params):
        raise ValueError(f"the parameters {sorted(by_name)} are not the planned {plan.fqns}")
    return [by_name[fqn] for fqn in plan.fqns]


def _local(param: nn.Parameter, fqn: str, owner: str) -> torch.Tensor:
    """The data FSDP packs for ``param`` (its tensor-parallel shard, detached).

    Raises:
        ValueError: the parameter is on meta.
    """
    if param.is_meta or (isinstance(param, DTensor) and param.to_local().is_meta):
        raise ValueError(
            f"fully_shard({owner!r}): parameter {fqn!r} is on meta; materialize the model "
            "(hp_dtensor.parallel.materialize) before sharding it"
        )
    return param.to_local().detach() if isinstance(param, DTensor) else param.detach()


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
    ) -> None:
        """Allocate the buffers of ``plan`` and copy ``params``' data into this rank's chunk.

        Postconditions: the modules hold the sharded parameters (views of ``sharded_flat``,
        laid out as ``plan.layouts``); the unsharded buffer has no storage yet.
        """
        self.plan = plan
        self.fsdp = fsdp
        self.owner = owner
        self.policy = policy
        self.comm_policy = comm_policy or LowPrecisionCommPolicy()
        ordered = _in_plan_order(params, plan)
        self.flat: FlatBufferLayout = plan.flat
        self.extra_reduce = plan.extra_reduce
        self.extra_start = plan.extra_start
        self.storage_dtype = torch_dtype(plan.storage_dtype)
        self.param_dtype = torch_dtype(plan.param_dtype)
        self.reduce_dtype = torch_dtype(plan.reduce_dtype)
        self.device = ordered[0][3].device if ordered else torch.device("cpu")
        locals_ = [_local(param, fqn, owner) for _, _, fqn, param in ordered]
        self.sharded_flat = self._pack(locals_)
        self.params: list[FSDPParam] = [
            self._sharded_param(index, entry) for index, entry in enumerate(ordered)
        ]
        self.unsharded_flat = torch.empty(
            self.flat.padded_numel, dtype=self.param_dtype, device=self.device
        )
        self.unsharded_flat.untyped_storage().resize_(0)
        self.unsharded_grad: torch.Tensor | None = None
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
        coordinate = self.fsdp.mesh.get_local_rank(self.fsdp.shard_axis)
        chunk = torch.zeros(self.flat.chunk_numel, dtype=self.storage_dtype, device=self.device)
        for span in self.flat.spans(coordinate):
            piece = locals_[span.index].reshape(-1)[span.start : span.stop]
            chunk[span.chunk_offset : span.chunk_offset + piece.numel()].copy_(piece)
        return chunk

    def _sharded_param(self, index: int, entry: _Param) -> FSDPParam:
        """Parameter ``index``'s sharded piece: a view of ``sharded_flat`` with its layout."""
        module, name, fqn, param = entry
        layout, base = self.plan.layouts[index], self.plan.bases[index]
        start, length = self.chunk_range(index)
        view = self.sharded_flat[start : start + length]
        sharded = self._wrap(view, layout, param.requires_grad, isinstance(param, DTensor))
        if isinstance(sharded, DTensor):
            # After the reductions the sharded gradient has the parameter's layout.
            set_grad_layout(sharded, layout)
        else:
            annotate_layout(sharded, layout, rank=self.fsdp.mesh.get_rank())
        return FSDPParam(module, name, fqn, self.plan.shapes[index], base, layout, sharded)

    def _plan_wire(self) -> None:
        """The byte records of the low-precision collectives (fixed for the group's life)."""
        comm = self.comm_policy
        chunk = self.flat.chunk_numel
        self.gather_codec: WireCodec | None = None
        if comm.param_all_gather_dtype is not None:
            if not self.storage_dtype.is_floating_point:
                raise ValueError(
                    f"fully_shard({self.owner!r}): an FP8 parameter all-gather "
                    f"({comm.param_all_gather_dtype}) needs floating-point parameters, got "
                    f"{self.storage_dtype}; leave param_all_gather_dtype None for this module"
                )
            self.gather_codec = WireCodec(comm.param_all_gather_dtype, chunk, comm.block_size)
        self.reduce_codec: WireCodec | None = None
        wire = comm.shard_reduce_dtype
        if wire is not None and wire != torch.float32:
            self.reduce_codec = WireCodec(wire, chunk, comm.block_size)
        # The quantized shard and the version of ``sharded_flat`` it was made from.
        self._gather_cache: tuple[int, torch.Tensor] | None = None
        self.param_quantizations = 0
        """Times this rank's shard was quantized for the all-gather (once per step)."""

    def chunk_range(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of parameter ``index``'s piece in this rank's chunk."""
        ranges = self.__dict__.get("_chunk_ranges")
        if ranges is None:
            coordinate = self.fsdp.mesh.get_local_rank(self.fsdp.shard_axis)
            ranges = {
                s.index: (s.chunk_offset, s.stop - s.start) for s in self.flat.spans(coordinate)
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
            p.module._parameters[p.name] = p.sharded

    def _register_unsharded(self) -> None:
        for p in self.params:
            if p.unsharded is None:
                self._make_unsharded(p)
            assert p.unsharded is not None
            p.module._parameters[p.name] = p.unsharded

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
        storage = self.unsharded_flat.untyped_storage()
        storage.resize_(self.unsharded_flat.numel() * self.unsharded_flat.element_size())
        self._version = self.unsharded_flat._version
        if self.gather_codec is not None:
            self._pending = self._unshard_quantized(self.gather_codec)
        else:
            source = self.sharded_flat
            if self.param_dtype != self.storage_dtype:
                source = source.to(self.param_dtype)
            if self.fsdp.shard_size == 1:
                self.unsharded_flat.copy_(source)
                self._pending = None
            else:
                group = self.fsdp.mesh.get_group(self.fsdp.shard_axis)
                with collective_purpose("param_all_gather"):
                    self._pending = dist.all_gather_single(
                        self.unsharded_flat, source, group=group, async_op=True
                    )
                self._keep_alive = source
        self.state = ShardedState.UNSHARDING
        if not async_op:
            self.wait()

    def quantized_shard(self) -> torch.Tensor:
        """This rank's shard as an FP8 record (``uint8``: data, then scales), quantized only
        when the shard changed since the last call (its version counter moved)."""
        codec = self.gather_codec
        assert codec is not None
        version = self.sharded_flat._version
        if self._gather_cache is not None and self._gather_cache[0] == version:
            return self._gather_cache[1]
        # No all-gather reading the previous record is in flight: they complete within the
        # step, and the shard only changes between steps.
        record = (
            self._gather_cache[1]
            if self._gather_cache is not None
            else torch.empty(codec.nbytes, dtype=torch.uint8, device=self.device)
        )
        codec.encode(self.sharded_flat, record)
        self.param_quantizations += 1
        self._gather_cache = (self.sharded_flat._version, record)
        return record

    def _unshard_quantized(self, codec: WireCodec) -> Deferred:
        record = self.quantized_shard()
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
        self.unsharded_flat.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED

    # Gradients ------------------------------------------------------------------------------

    def prepare_gradients(self) -> None:
        """Point every unsharded parameter's gradient at the flat gradient buffer."""
        if self.unsharded_grad is None:
            self.unsharded_grad = torch.zeros(
                self.flat.padded_numel, dtype=self.param_dtype, device=self.device
            )
        for p, slot in zip(self.params, self.flat.slots, strict=True):
            assert p.leaf is not None
            if p.leaf.requires_grad and p.leaf.grad is None:
                p.leaf.grad = self.unsharded_grad[slot.offset : slot.end].view(p.shape)

    def reduce_scatter(self, output: torch.Tensor) -> Any:
        """Reduce-scatter the flat gradient into ``output`` (this rank's chunk, reduce dtype);
        returns the async work handle (None when nothing is communicated)."""
        assert self.unsharded_grad is not None
        if self.extra_reduce and self.extra_start < self.flat.padded_numel:
            tail = self.unsharded_grad[self.extra_start :]
            for axis, op in self.extra_reduce:
                mesh = self.params[-1].layout.mesh
                from hp_dtensor import DeviceMesh

                group = DeviceMesh.lookup(self.device.type, mesh).get_group(axis)
                with collective_purpose("grad_extra_all_reduce"):
                    dist.all_reduce(tail, op=_TORCH_OPS[op], group=group)
        if self.fsdp.shard_size > 1 and self.reduce_codec is not None:
            # Encode the gradient as computed (param dtype, no cast to the reduce dtype first);
            # the receivers accumulate in fp32.
            group = self.fsdp.mesh.get_group(self.fsdp.shard_axis)
            return reduce_scatter_lowp(
                self.unsharded_grad, output, self.reduce_codec, self.fsdp.shard_size, group
            )
        source = self.unsharded_grad
        if self.reduce_dtype != self.param_dtype:
            source = source.to(self.reduce_dtype)
        if self.fsdp.shard_size == 1:
            output.copy_(source)
            return None
        group = self.fsdp.mesh.get_group(self.fsdp.shard_axis)
        with collective_purpose("grad_reduce_scatter"):
            work = dist.reduce_scatter_single(output, source, group=group, async_op=True)
        self._keep_alive = source
        return work

    def release_gradients(self) -> None:
        """Drop the unsharded gradients (after their reduce-scatter)."""
        for p in self.params:
            if p.leaf is not None:
                p.leaf.grad = None
        self.unsharded_grad = None
        self._keep_alive = None

    def assign_sharded_gradients(self, chunk: torch.Tensor, accumulate: bool = False) -> None:
        """Make views of ``chunk`` (this rank's reduced chunk) the sharded parameters' grads,
        or, with ``accumulate``, add them to the gradients they have."""
        for index, p in enumerate(self.params):
            if not p.sharded.requires_grad:
                continue
            start, length = self.chunk_range(index)
            grad = chunk[start : start + length]
            target = p.sharded.to_local() if isinstance(p.sharded, DTensor) else p.sharded
            if target.grad is None or not accumulate:
                target.grad = grad
            else:
                target.grad.add_(grad)

"""One fully_shard group planned as frozen data, before anything is allocated.

:func:`plan_group` reads only shapes, layouts, dtypes and mesh axis names (no process group,
no tensor, so a ``meta`` model's parameters plan as well as real ones) and returns a
:class:`GroupPlan`: the order of the parameters in the flat buffer, the buffer's
``hp_layout.FlatBufferLayout``, each parameter's FSDP layout, and the order of the gradient
reductions (the tail reduced over a tensor-parallel axis first, then the reduce-scatter).
``fully_shard`` plans a group, then allocates and copies what the plan says
(``FSDPParamGroup``), and records :meth:`GroupPlan.flat_slots` on the module it shards, so
``hp_dtensor.contract.parallel_plan_of(root)`` shows every parameter's slot.

Planning is deterministic and plans compare by value: equal inputs give equal plans, so the
ranks of one data-parallel group (which see the same shapes and mesh) plan the same group.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hp_dtensor import DTensor, layout_of
from hp_dtensor.contract import ParamFlatSlot, grad_reduction_of
from hp_dtensor.parallel import ParamPlan
from hp_layout import (
    FlatBufferLayout,
    Layout,
    Mesh,
    ReduceOp,
    Replicate,
    Shard,
    plan_flat_buffer,
)

__all__ = [
    "GroupPlan",
    "ParamSpec",
    "RowShardLayout",
    "RowSlot",
    "dtype_name",
    "plan_group",
    "spec_from_plan",
    "spec_of",
    "torch_dtype",
]

# Every parameter's shard starts on a 16-byte boundary.
ALIGN_BYTES = 16

Reduction = tuple[tuple[str, ReduceOp], ...]


@dataclass(frozen=True)
class ParamSpec:
    """What planning reads of one parameter.

    Attributes:
        fqn: its name relative to the module fully_shard is called on.
        shape: the shape FSDP packs: the tensor-parallel local shard's, or the whole shape.
        dtype: its storage dtype, e.g. ``"float32"`` (see :func:`dtype_name`).
        base: its layout before FSDP (tensor parallel), None for a whole parameter.
        reduction: the ``(axis, op)`` gradient reduction a tensor-parallel plan recorded for
            it (``hp_dtensor.contract.grad_reduction_of``), ``()`` when none.
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    base: Layout | None = None
    reduction: Reduction = ()


@dataclass(frozen=True)
class RowSlot:
    """One parameter in the per-parameter (FSDP2) layout: dim 0 cut with ``torch.chunk``
    semantics, every rank's rows at the same offset of its chunk.

    Attributes:
        offset: the first element of the parameter's rows in every rank's chunk.
        rows: the parameter's dim 0 (a 1-d parameter's rows are its elements, ``inner`` 1).
        rows_per_rank: ``ceil(rows / shard_size)``: the rows a chunk has room for.
        inner: elements per row (the product of the other dims).
    """

    offset: int
    rows: int
    rows_per_rank: int
    inner: int

    @property
    def capacity(self) -> int:
        """Elements reserved for the parameter in each chunk."""
        return self.rows_per_rank * self.inner

    def local_rows(self, coordinate: int) -> int:
        """Rows the rank at ``coordinate`` of the shard axis holds (0 past the last rows).

        Postcondition: the local rows over all coordinates sum to ``rows``.
        """
        return max(0, min(self.rows_per_rank, self.rows - coordinate * self.rows_per_rank))


@dataclass(frozen=True)
class RowShardLayout:
    """Every rank's chunk in the per-parameter layout: each parameter's local rows at its
    slot's offset (aligned), the rest padding. The all-gather of the chunks is rank-major, so
    the unsharded parameters are copied out of it, and gradients copied into that order
    before the reduce-scatter (as FSDP2 does).

    Attributes:
        slots: one per parameter, in buffer order.
        chunk_numel: elements of each rank's chunk.
        shard_size: ranks along the shard axis.
    """

    slots: tuple[RowSlot, ...]
    chunk_numel: int
    shard_size: int


def plan_rows(shapes: Sequence[tuple[int, ...]], shard_size: int, align: int) -> RowShardLayout:
    """The per-parameter layout of parameters of ``shapes`` over ``shard_size`` ranks.

    Postconditions: slots start at multiples of ``align`` and do not overlap; every slot
    holds ``ceil(rows / shard_size)`` rows; ``chunk_numel`` is a multiple of ``align``.

    Raises:
        NotImplementedError: a 0-d parameter (no dim 0 to shard).
    """
    slots: list[RowSlot] = []
    offset = 0
    for shape in shapes:
        if not shape:
            raise NotImplementedError(
                "a 0-d parameter has no dim 0 to shard per parameter; use the flat layout"
            )
        rows, inner = shape[0], 1
        for size in shape[1:]:
            inner *= size
        per_rank = -(-rows // shard_size)
        slots.append(RowSlot(offset, rows, per_rank, inner))
        offset += -(-per_rank * inner // align) * align
    return RowShardLayout(tuple(slots), max(offset, align), shard_size)


@dataclass(frozen=True)
class GroupPlan:
    """One fully_shard group, planned (see the module docstring).

    Attributes:
        owner: the name of the module the group belongs to, relative to the outermost
            fully_shard'ed module above it ("" that module itself, usually the root).
        fqns: the parameters' names relative to the module fully_shard was called on, in
            buffer order: those with an extra tensor-parallel gradient reduction last.
        shapes: each parameter's packed (tensor-parallel local) shape, in buffer order.
        bases: each parameter's layout before FSDP, None for a whole parameter.
        layouts: each parameter's layout with FSDP (a RaggedShard on ``shard_axis``).
        flat: the flat buffer (``hp_layout.plan_flat_buffer`` of ``shapes``).
        extra_start: the first element of the buffer's tail all-reduced over
            ``extra_reduce``'s axes before the reduce-scatter (the buffer's padded length
            when nothing is).
        extra_reduce: the ``(axis, op)`` reductions over axes FSDP does not own (a
            tensor-parallel axis the tail's parameters are replicated on), ``()`` if none.
        storage_dtype: the dtype of the sharded parameters and their flat buffer.
        param_dtype: the dtype of the unsharded parameters (compute).
        reduce_dtype: the dtype gradients are reduced in.
        mesh: the FSDP mesh (1-d shard, or 2-d replicate and shard).
        shard_axis: the mesh axis the buffer is cut over.
        replicate_axes: the mesh axes holding replicas of the buffer (HSDP), ``()`` if none.
        rows: the per-parameter layout of the sharded chunks (``param_layout="per_param"``),
            None for the flat layout (each chunk a contiguous run of ``flat``); ``flat`` then
            only places the unsharded parameters.
    """

    owner: str
    fqns: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    bases: tuple[Layout | None, ...]
    layouts: tuple[Layout, ...]
    flat: FlatBufferLayout
    extra_start: int
    extra_reduce: Reduction
    storage_dtype: str
    param_dtype: str
    reduce_dtype: str
    mesh: Mesh
    shard_axis: str
    replicate_axes: tuple[str, ...] = ()
    rows: RowShardLayout | None = None

    @property
    def chunk_numel(self) -> int:
        """Elements of each rank's chunk of the sharded buffer."""
        return self.rows.chunk_numel if self.rows is not None else self.flat.chunk_numel

    def index(self, fqn: str) -> int:
        """The position of parameter ``fqn`` in the buffer.

        Raises:
            KeyError: no parameter of the group has that name.
        """
        if fqn not in self.fqns:
            raise KeyError(f"no parameter {fqn!r} in the group of {self.owner!r}: {self.fqns}")
        return self.fqns.index(fqn)

    def padding(self, index: int) -> int:
        """Elements between parameter ``index``'s end and the next slot (or the buffer's end).

        Postcondition: the slots' numels and paddings, with the first offset, sum to
        ``flat.padded_numel``.
        """
        slots = self.flat.slots
        nxt = slots[index + 1].offset if index + 1 < len(slots) else self.flat.padded_numel
        return nxt - slots[index].end

    def flat_slot(self, index: int) -> ParamFlatSlot:
        """Parameter ``index``'s slot, as ``hp_dtensor.contract`` records it (per-parameter
        layout: the offset within every rank's chunk, and the rows each holds)."""
        slot = self.flat.slots[index]
        if self.rows is not None:
            row = self.rows.slots[index]
            return ParamFlatSlot(
                group=self.owner,
                index=index,
                offset=row.offset,
                numel=slot.numel,
                padding=row.capacity * self.rows.shard_size - slot.numel,
                buffer_numel=self.rows.chunk_numel * self.rows.shard_size,
                chunk_numel=self.rows.chunk_numel,
                shard_axes=(self.shard_axis,),
                replicate_axes=self.replicate_axes,
                dtype=self.storage_dtype,
                rows_per_rank=row.rows_per_rank,
            )
        return ParamFlatSlot(
            group=self.owner,
            index=index,
            offset=slot.offset,
            numel=slot.numel,
            padding=self.padding(index),
            buffer_numel=self.flat.padded_numel,
            chunk_numel=self.flat.chunk_numel,
            shard_axes=(self.shard_axis,),
            replicate_axes=self.replicate_axes,
            dtype=self.storage_dtype,
        )

    def flat_slots(self) -> dict[str, ParamFlatSlot]:
        """``{fqn: ParamFlatSlot}`` for every parameter, in buffer order (names as in ``fqns``)."""
        return {fqn: self.flat_slot(i) for i, fqn in enumerate(self.fqns)}

    def with_owner(self, owner: str) -> GroupPlan:
        """The same plan belonging to the module named ``owner``."""
        return replace(self, owner=owner)


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``: the name plans store."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a plan's dtype name stands for (inverse of :func:`dtype_name`)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def spec_of(fqn: str, param: torch.Tensor) -> ParamSpec:
    """What planning needs of ``param`` (an hp_dtensor DTensor, a plain parameter annotated
    with a layout, or a whole one); reads no data, so a meta parameter is fine."""
    reduction = grad_reduction_of(param)
    axes = reduction.axes if reduction is not None else ()
    if isinstance(param, DTensor):
        shape = tuple(param.to_local().shape)
        return ParamSpec(fqn, shape, dtype_name(param.dtype), param.dist_layout, axes)
    annotated = layout_of(param)
    return ParamSpec(fqn, tuple(param.shape), dtype_name(param.dtype), _base(annotated), axes)


def spec_from_plan(param: ParamPlan, rank: int) -> ParamSpec:
    """What planning reads of a parameter, from its entry in a resolved tensor-parallel plan
    (``hp_dtensor.parallel.resolve``, pure) instead of from the parallelized parameter: the
    same spec :func:`spec_of` reads off the parameter ``parallelize_module`` makes of it on
    ``rank`` (its local shape there, its layout, its gradient reduction). For a planner whose
    meta model is not parallelized (no process group); see ``plan_fully_shard(specs=...)``."""
    axes = param.reduction.axes if param.reduction is not None else ()
    base = _base(param.layout)
    shape = param.local_shape(rank) if base is not None else param.global_shape
    return ParamSpec(param.fqn, shape, param.dtype, base, axes)


def _base(layout: Layout) -> Layout | None:
    """A parameter's layout before FSDP: None for a whole one (a single-rank layout)."""
    return layout if layout.mesh.size > 1 else None


def plan_group(
    params: Sequence[ParamSpec],
    mesh: Mesh,
    shard_axis: str,
    replicate_axis: str | None = None,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    owner: str = "",
    label: str | None = None,
    per_param: bool = False,
) -> GroupPlan:
    """Plan the group of ``params`` sharded over ``shard_axis`` of the FSDP ``mesh``.

    ``param_dtype`` and ``reduce_dtype`` are the MixedPrecisionPolicy's; ``label`` names the
    module in error messages (default ``owner``). ``per_param``: FSDP2's layout (each
    parameter ``Shard(0)``, see :class:`RowShardLayout`) instead of the flat one.

    A pure function of frozen values, so each distinct group is planned once per process
    (the blocks of a model, the same call on many meshes of a planned job) and the frozen plan
    shared.

    Postconditions: the plan holds every parameter once, those without an extra reduction
    first, each kind in the given order; ``flat == plan_flat_buffer(shapes, shards, align)``
    with ``align`` 16 bytes of the storage dtype; ``extra_start`` is the first extra-reduced
    parameter's offset; nothing is allocated and no process group is used.

    Raises:
        ValueError: parameters of several dtypes, or a base layout FSDP cannot shard.
        NotImplementedError: one group needing several extra reductions, or a non-sum one,
            or storage dtypes that differ under a ``param_dtype``.
    """
    return _plan_group(
        tuple(params),
        mesh,
        shard_axis,
        replicate_axis,
        param_dtype,
        reduce_dtype,
        owner,
        label,
        per_param,
    )


@functools.lru_cache(maxsize=4096)
def _plan_group(
    params: tuple[ParamSpec, ...],
    mesh: Mesh,
    shard_axis: str,
    replicate_axis: str | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    owner: str,
    label: str | None,
    per_param: bool,
) -> GroupPlan:
    name = label if label is not None else owner
    ordered, extra = _order_by_extra_reduction(params, mesh)
    storage = _storage_dtype(ordered, param_dtype, name)
    compute = dtype_name(param_dtype) if param_dtype is not None else storage
    reduced = dtype_name(reduce_dtype) if reduce_dtype is not None else compute
    align = max(1, ALIGN_BYTES // torch_dtype(storage).itemsize)
    shapes = tuple(p.shape for p in ordered)
    flat = plan_flat_buffer(shapes, mesh.axis_size(shard_axis), align)
    rows: RowShardLayout | None = None
    if per_param:
        if any(p.base is not None for p in ordered):
            raise NotImplementedError(
                f"fully_shard({name!r}): param_layout='per_param' with tensor-parallel "
                "parameters is not implemented; use the flat layout (the default) under TP"
            )
        rows = plan_rows(shapes, mesh.axis_size(shard_axis), align)
        layouts = tuple(_row_layout(shape, mesh, shard_axis) for shape in shapes)
    else:
        layouts = tuple(
            flat.layout(i, _mesh_for(p.base, mesh), shard_axis, base=p.base)
            for i, p in enumerate(ordered)
        )
    first_extra = len(ordered) - sum(1 for p in ordered if _extra_axes(p, mesh))
    extra_start = flat.slots[first_extra].offset if extra else flat.padded_numel
    return GroupPlan(
        owner=owner,
        fqns=tuple(p.fqn for p in ordered),
        shapes=shapes,
        bases=tuple(p.base for p in ordered),
        layouts=layouts,
        flat=flat,
        extra_start=extra_start,
        extra_reduce=extra,
        storage_dtype=storage,
        param_dtype=compute,
        reduce_dtype=reduced,
        mesh=mesh,
        shard_axis=shard_axis,
        replicate_axes=(replicate_axis,) if replicate_axis is not None else (),
        rows=rows,
    )


def _row_layout(shape: tuple[int, ...], mesh: Mesh, shard_axis: str) -> Layout:
    """``Shard(0)`` over the shard axis, replicated over the others (FSDP2's placements)."""
    placements = [Shard(0) if axis == shard_axis else Replicate() for axis in mesh.axis_names]
    return Layout(shape, mesh, placements)


def _extra_axes(param: ParamSpec, mesh: Mesh) -> Reduction:
    """The parameter's gradient reductions over axes the FSDP mesh does not own."""
    own = set(mesh.axis_names)
    return tuple((axis, op) for axis, op in param.reduction if axis not in own)


def _order_by_extra_reduction(
    params: Sequence[ParamSpec], mesh: Mesh
) -> tuple[list[ParamSpec], Reduction]:
    """The parameters with those needing an extra reduction last, and that reduction."""
    plain = [p for p in params if not _extra_axes(p, mesh)]
    extra = [p for p in params if _extra_axes(p, mesh)]
    kinds = {_extra_axes(p, mesh) for p in extra}
    if len(kinds) > 1:
        raise NotImplementedError(
            f"parameters of one group need different gradient reductions {sorted(kinds)}; "
            "shard them in separate fully_shard calls"
        )
    for p in extra:
        for _axis, op in _extra_axes(p, mesh):
            if op is not ReduceOp.SUM:
                raise NotImplementedError(f"gradient reduction {op} over a non-FSDP axis")
    return plain + extra, next(iter(kinds)) if kinds else ()


def _storage_dtype(params: Sequence[ParamSpec], param_dtype: torch.dtype | None, name: str) -> str:
    """The one storage dtype of the group (float32 for an empty one)."""
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        example = {f"torch.{p.dtype}": p.fqn for p in params}
        if param_dtype is None:
            raise ValueError(
                f"fully_shard({name!r}): parameters of several dtypes in one group without "
                f"a MixedPrecisionPolicy ({example}); give param_dtype, or shard the "
                "modules separately"
            )
        raise NotImplementedError(
            f"fully_shard({name!r}): one group with storage dtypes {example}; one flat "
            "buffer per dtype is not implemented yet; shard those modules separately"
        )
    return next(iter(dtypes)) if dtypes else "float32"


def _mesh_for(base: Layout | None, mesh: Mesh) -> Mesh:
    """The hp_layout mesh the parameter's FSDP layout lives on (``mesh`` for a whole one).

    Raises:
        ValueError: ``base`` lacks one of the FSDP axes or is not replicated along it.
    """
    if base is None:
        return mesh
    for axis in mesh.axis_names:
        if axis not in base.mesh.axis_names:
            raise ValueError(
                f"the FSDP mesh axis {axis!r} is not an axis of the parameter's mesh "
                f"{base.mesh!r}; pass fully_shard the data-parallel sub-mesh of the mesh used "
                "for tensor parallelism"
            )
        if not isinstance(base.placement(axis), Replicate):
            raise ValueError(
                f"a parameter laid out as {base!r} is not replicated along the FSDP axis "
                f"{axis!r}; FSDP can only shard data-parallel replicas"
            )
    return base.mesh

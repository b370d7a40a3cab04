"""Deferred initialization: build on ``meta``, materialize each rank's shard with the values a
single-device construction under the same seed gives.

A model built under ``torch.device("meta")`` (and possibly parallelized already) holds meta
tensors of three kinds, each materialized as the same kind:

* a meta :class:`~hp_dtensor.DTensor` (validation mode): a DTensor with the same layout and
  mesh whose local tensor is this rank's region;
* a plain meta tensor annotated with :func:`hp_dtensor.annotate_layout` (production mode: the
  tensor is the local shard, :func:`hp_dtensor.layout_of` gives the global layout), or named
  in ``layouts``: this rank's region, annotated with the layout again;
* a plain meta tensor without a layout: the whole tensor (replicated);
* a meta torch ``DTensor`` (a sharder's per-parameter layout, FSDP2's): a torch DTensor with
  the same mesh, placements and global shape whose local tensor is this rank's region.

:func:`materialize` replays the initializers module by module, in ``module.modules()`` order,
on full-size temporary tensors, then keeps each rank's region (``Layout.local_region``;
``RaggedShard`` regions are flat ranges of the box). Every rank draws every full tensor from
the global generator, so ranks seeded identically stay in step and hold exactly the slices of
a single-device construction (see :mod:`hp_dtensor.parallel.random`). Peak extra memory is one
module's tensors at full size.

Bit-exactness holds when the replay consumes the generator as the constructor did, which is
the case for models whose modules initialize their own tensors in their ``__init__`` (through
``reset_parameters`` or an equivalent ``init_fn``) and are registered in construction order:
``nn.Linear``, ``nn.Embedding``, the norms, and models composed of them. It does not hold for
constructors that draw in another order, e.g. a parent that re-initializes its children after
building them (a ``self.apply(_init_weights)`` pass, ``nn.MultiheadAttention``): initialize
such models after materializing, on the sharded tensors
(:func:`hp_dtensor.parallel.random.random_region` draws a global initializer and keeps a
region).

Buffers: a meta buffer is materialized like a parameter (whole when it has no layout). Its
values come from ``buffer_fn`` (typically a module method that recomputes tables such as
rotary ``cos``/``sin``), else from the module's ``reset_parameters`` / ``init_fn``; see
:func:`materialize`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from hp_dtensor.device_mesh import DeviceMesh
from hp_dtensor.dtensor import DTensor
from hp_dtensor.interop import (
    LAYOUT_ATTRIBUTE,
    annotate_layout,
    is_torch_dtensor,
    layout_of,
    torch_dtensor_like,
)
from hp_dtensor.parallel._grad_reduction import install_grad_reductions
from hp_dtensor.parallel.random import take_region
from hp_layout import Layout

__all__ = [
    "MaterializeError",
    "MaterializeTarget",
    "ModuleInit",
    "materialize",
    "materialize_target_of",
    "set_materialize_target",
]

ModuleInit = Callable[[nn.Module], object]
"""An initializer for one module: writes the module's (full-size) tensors in place."""

MaterializeTarget = Callable[[torch.device], torch.Tensor]
"""Where a sharder keeps a meta tensor's local data once materialized: called with the device,
it returns the (allocated) tensor of the local shape and dtype that materialize fills."""

_TARGET = "_hp_dtensor_materialize_target"

# Attributes of the old tensor object that describe the old tensor itself, not the parameter.
_OWN_ATTRIBUTES = frozenset(
    {
        "_local",
        "_dist_layout",
        "_device_mesh",
        "_is_param",
        "_local_tensor",
        "_spec",
        LAYOUT_ATTRIBUTE,
        _TARGET,
    }
)


def set_materialize_target(tensor: torch.Tensor, target: MaterializeTarget) -> None:
    """Make :func:`materialize` write ``tensor``'s local values into ``target(device)`` (a view
    of a sharder's storage) instead of a fresh tensor, so that materializing a sharded model
    never holds two copies of its shards. The materialized parameter aliases that storage."""
    setattr(tensor, _TARGET, target)


def materialize_target_of(tensor: torch.Tensor) -> MaterializeTarget | None:
    """The target :func:`set_materialize_target` recorded on ``tensor``, or None."""
    target = getattr(tensor, _TARGET, None)
    return target if callable(target) else None


class MaterializeError(RuntimeError):
    """A module cannot be materialized as asked (no initializer, or one that misbehaves)."""


@dataclass(frozen=True)
class _Slot:
    """One meta tensor a module owns directly, and how to rebuild it.

    Attributes:
        name: its name in the module (``weight``).
        kind: ``"param"`` or ``"buffer"``.
        original: the meta tensor (a DTensor, an annotated plain tensor, or a plain one).
        layout: its global layout; None for a plain tensor that is whole.
        mesh: the DTensor's mesh; None for a plain tensor.
        rank: the rank whose region is kept.
    """

    name: str
    kind: Literal["param", "buffer"]
    original: torch.Tensor
    layout: Layout | None
    mesh: DeviceMesh | None
    rank: int

    @property
    def global_shape(self) -> tuple[int, ...]:
        return tuple(self.original.shape) if self.layout is None else self.layout.global_shape


def materialize(
    module: nn.Module,
    device: torch.device | str = "cpu",
    *,
    seed: int | None = None,
    layouts: Mapping[str, Layout] | None = None,
    init_fn: ModuleInit | None = None,
    buffer_fn: ModuleInit | None = None,
    rank: int | None = None,
) -> nn.Module:
    """Materialize every meta parameter and buffer of ``module`` on ``device``, in place.

    Args:
        module: the model, built on ``meta`` (tensors not on meta are left as they are).
        device: where the materialized tensors live.
        seed: if given, ``torch.manual_seed(seed)`` is called first.
        layouts: global layouts of plain meta tensors by qualified name
            (``"layers.0.attn.wq.weight"``), for local shards that carry no annotation.
        init_fn: initializer for modules that own meta parameters but have no
            ``reset_parameters`` (and for modules owning only meta buffers, see below).
        buffer_fn: initializer for meta buffers (rotary tables, ...): called, after the
            module's parameter initializer, on every module that owns meta buffers.
        rank: the rank whose regions are kept; defaults to the DTensor mesh's rank, else the
            ``torch.distributed`` rank (0 without it).

    Per module, in ``module.modules()`` order, when it owns meta tensors directly: a
    temporary copy of the module gets full-size tensors (floating ones filled with NaN) for
    all its parameters and buffers, then, under ``torch.no_grad()``:

    * if it owns meta parameters: ``reset_parameters()``, or else ``init_fn(tmp)``, or else
      :class:`MaterializeError` naming the module; then ``buffer_fn(tmp)`` if it owns meta
      buffers and ``buffer_fn`` is given;
    * if it owns only meta buffers: ``buffer_fn(tmp)``, or else ``reset_parameters()``, or
      else ``init_fn(tmp)``, or else :class:`MaterializeError`.

    Initializers may write the tensors in place or assign new ones of the same shape and
    dtype. A floating tensor still holding NaN afterwards was not initialized:
    :class:`MaterializeError` (integer buffers cannot be checked). Each rank then keeps its
    region of each tensor. Tensors shared by several modules (tied weights) take the value
    of the first module in ``modules()`` order; later modules still run their initializer
    on stand-ins so the generator advances as in the constructor.

    The new tensors replace the old ones in the modules' ``_parameters`` / ``_buffers``
    (new objects: build optimizers afterwards). DTensors stay DTensors (same layout and
    mesh), annotated tensors are annotated again, ``requires_grad`` is kept, and any other
    Python attribute set on the old tensor object is copied over.

    Returns ``module``.
    """
    target = torch.device(device)
    if target.type == "meta":
        raise ValueError("materialize: device must be a real device, not meta")
    by_id = _layouts_by_id(module, layouts or {})
    if seed is not None:
        torch.manual_seed(seed)
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for prefix, sub in module.named_modules():
        slots = _meta_slots(sub, by_id, rank)
        if slots:
            _materialize_module(prefix, sub, slots, by_id, target, init_fn, buffer_fn, done)
    # Replaced parameters carry their recorded gradient reductions; hook them again.
    install_grad_reductions(module)
    return module


# Finding the meta tensors -----------------------------------------------------------------------


def _layouts_by_id(module: nn.Module, layouts: Mapping[str, Layout]) -> dict[int, Layout]:
    tensors: dict[str, torch.Tensor] = {
        **dict(module.named_parameters(remove_duplicate=False)),
        **dict(module.named_buffers(remove_duplicate=False)),
    }
    out: dict[int, Layout] = {}
    for name, layout in layouts.items():
        if name not in tensors:
            raise ValueError(
                f"materialize: layouts names {name!r}, which is no parameter or buffer of "
                f"{type(module).__name__}; known names: {sorted(tensors)}"
            )
        if not isinstance(layout, Layout):
            raise TypeError(f"materialize: layouts[{name!r}] is not an hp_layout.Layout")
        tensor = tensors[name]
        if isinstance(tensor, DTensor) and tensor.dist_layout != layout:
            raise ValueError(
                f"materialize: layouts[{name!r}] is {layout!r} but the DTensor has "
                f"{tensor.dist_layout!r}"
            )
        out[id(tensor)] = layout
    return out


def _is_meta(t: torch.Tensor) -> bool:
    if isinstance(t, DTensor) or is_torch_dtensor(t):
        return bool(t.to_local().is_meta)  # type: ignore[attr-defined]
    return bool(t.is_meta)


def _default_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _meta_slots(module: nn.Module, by_id: Mapping[int, Layout], rank: int | None) -> list[_Slot]:
    slots: list[_Slot] = []
    for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
        for name, tensor in table.items():
            if tensor is not None and _is_meta(tensor):
                slots.append(_slot(name, kind, tensor, by_id, rank))  # type: ignore[arg-type]
    return slots


def _slot(
    name: str,
    kind: Literal["param", "buffer"],
    tensor: torch.Tensor,
    by_id: Mapping[int, Layout],
    rank: int | None,
) -> _Slot:
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        me = mesh.get_rank() if rank is None else rank
        return _checked(_Slot(name, kind, tensor, tensor.dist_layout, mesh, me), tensor.to_local())
    if is_torch_dtensor(tensor):
        me = _default_rank() if rank is None else rank
        local = tensor.to_local()  # type: ignore[attr-defined]
        return _checked(_Slot(name, kind, tensor, layout_of(tensor), None, me), local)
    layout = by_id.get(id(tensor), getattr(tensor, LAYOUT_ATTRIBUTE, None))
    if layout is None:
        return _Slot(name, kind, tensor, None, None, 0)
    if not isinstance(layout, Layout):
        raise TypeError(f"materialize: {name!r} has a {LAYOUT_ATTRIBUTE!r} that is no Layout")
    me = _default_rank() if rank is None else rank
    return _checked(_Slot(name, kind, tensor, layout, None, me), tensor)


def _checked(slot: _Slot, local: torch.Tensor) -> _Slot:
    layout = slot.layout
    assert layout is not None
    if layout.has_partial:
        raise MaterializeError(
            f"materialize: {slot.name!r} has the Partial layout {layout!r}; an initial value "
            "has no pieces: give parameters Shard, Replicate or RaggedShard layouts"
        )
    if slot.rank not in layout.mesh:
        raise MaterializeError(f"materialize: rank {slot.rank} is not in the mesh of {layout!r}")
    expected = layout.local_shape(slot.rank)
    if tuple(local.shape) != expected:
        raise MaterializeError(
            f"materialize: {slot.name!r} has local shape {tuple(local.shape)} on rank "
            f"{slot.rank}, but {layout!r} gives it {expected}"
        )
    return slot


# One module ------------------------------------------------------------------------------------


def _materialize_module(
    prefix: str,
    module: nn.Module,
    slots: list[_Slot],
    by_id: Mapping[int, Layout],
    device: torch.device,
    init_fn: ModuleInit | None,
    buffer_fn: ModuleInit | None,
    done: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    temporary = _temporary(module, device, by_id)
    _initialize(_describe(prefix, module), temporary, slots, init_fn, buffer_fn)
    for slot in slots:
        value = _filled(_describe(prefix, module), temporary, slot, device)
        if id(slot.original) not in done:
            done[id(slot.original)] = (slot.original, _rebuild(slot, value, device))
        new = done[id(slot.original)][1]
        if slot.kind == "param":
            module._parameters[slot.name] = new  # type: ignore[assignment]  # a Parameter
        else:
            module._buffers[slot.name] = new


def _describe(prefix: str, module: nn.Module) -> str:
    return f"module {prefix or '<root>'!r} ({type(module).__name__})"


def _global_shape(t: torch.Tensor, by_id: Mapping[int, Layout]) -> tuple[int, ...]:
    if isinstance(t, DTensor):
        return tuple(t.shape)
    layout = by_id.get(id(t), getattr(t, LAYOUT_ATTRIBUTE, None))
    return layout.global_shape if isinstance(layout, Layout) else tuple(t.shape)


def _blank(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.is_floating_point() or out.is_complex():
        out.fill_(float("nan"))
    return out


def _temporary(module: nn.Module, device: torch.device, by_id: Mapping[int, Layout]) -> nn.Module:
    """A shallow copy of ``module`` whose own tensors are full-size blanks on ``device``.

    Every tensor gets a stand-in, materialized ones too, so the initializer never writes a
    real (possibly sharded) tensor and draws exactly what it draws in the constructor.
    """
    params: dict[str, nn.Parameter | None] = {}
    for name, p in module._parameters.items():
        if p is None:
            params[name] = None
        else:
            blank = _blank(_global_shape(p, by_id), p.dtype, device)
            params[name] = nn.Parameter(blank, p.requires_grad)
    buffers = {
        name: None if b is None else _blank(_global_shape(b, by_id), b.dtype, device)
        for name, b in module._buffers.items()
    }
    cls = type(module)
    temporary = cls.__new__(cls)
    temporary.__dict__.update(module.__dict__)
    temporary.__dict__["_parameters"] = params
    temporary.__dict__["_buffers"] = buffers
    return temporary


def _initialize(
    what: str,
    temporary: nn.Module,
    slots: list[_Slot],
    init_fn: ModuleInit | None,
    buffer_fn: ModuleInit | None,
) -> None:
    params = [s.name for s in slots if s.kind == "param"]
    buffers = [s.name for s in slots if s.kind == "buffer"]
    reset = getattr(temporary, "reset_parameters", None)
    with torch.no_grad():
        if params:
            if callable(reset):
                reset()
            elif init_fn is not None:
                init_fn(temporary)
            else:
                raise MaterializeError(
                    f"materialize: {what} owns meta parameters {params} but has no "
                    "reset_parameters(); pass init_fn=, a function that initializes the "
                    "module's full-size tensors in place exactly as its constructor does"
                )
            if buffers and buffer_fn is not None:
                buffer_fn(temporary)
            return
        if buffer_fn is not None:
            buffer_fn(temporary)
        elif callable(reset):
            reset()
        elif init_fn is not None:
            init_fn(temporary)
        else:
            raise MaterializeError(
                f"materialize: {what} owns meta buffers {buffers} but has no "
                "reset_parameters(); pass buffer_fn= (or init_fn=), a function that "
                "recomputes the module's full-size buffers as its constructor does"
            )


def _filled(what: str, temporary: nn.Module, slot: _Slot, device: torch.device) -> torch.Tensor:
    """The initialized full-size tensor of ``slot``, checked."""
    table = temporary._parameters if slot.kind == "param" else temporary._buffers
    value = table.get(slot.name)
    label = f"{what}: {'parameter' if slot.kind == 'param' else 'buffer'} {slot.name!r}"
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        raise MaterializeError(f"materialize: {label} is no plain tensor after initialization")
    if tuple(value.shape) != slot.global_shape or value.dtype != slot.original.dtype:
        raise MaterializeError(
            f"materialize: {label} became {tuple(value.shape)} {value.dtype} in initialization; "
            f"expected {slot.global_shape} {slot.original.dtype}"
        )
    if value.device != device and value.device.type != device.type:
        raise MaterializeError(f"materialize: {label} was moved to {value.device}")
    if (value.is_floating_point() or value.is_complex()) and bool(torch.isnan(value).any()):
        raise MaterializeError(
            f"materialize: {label} still holds values its initializer did not write; make "
            "reset_parameters / init_fn / buffer_fn initialize every tensor the module owns"
        )
    return value.detach()


def _rebuild(slot: _Slot, value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The materialized counterpart of ``slot.original`` from its full value (written into the
    storage a sharder named with :func:`set_materialize_target`, if it did)."""
    data = value
    if slot.layout is not None:
        data = take_region(value, slot.layout.local_region(slot.rank))
    target = materialize_target_of(slot.original)
    if target is not None:
        destination = target(device)
        if tuple(destination.shape) != tuple(data.shape) or destination.dtype != data.dtype:
            raise MaterializeError(
                f"materialize: the target of {slot.name!r} is {tuple(destination.shape)} "
                f"{destination.dtype}, its local value {tuple(data.shape)} {data.dtype}"
            )
        data = destination.copy_(data)
    elif slot.layout is not None:
        data = data.clone(memory_format=torch.contiguous_format)
    requires_grad = bool(slot.original.requires_grad)
    new: torch.Tensor
    if is_torch_dtensor(slot.original):
        wrapped_torch = torch_dtensor_like(data, slot.original)
        new = nn.Parameter(wrapped_torch, requires_grad) if slot.kind == "param" else wrapped_torch
    elif slot.mesh is not None:
        assert slot.layout is not None
        wrapped = DTensor(data, slot.layout, slot.mesh)
        new = nn.Parameter(wrapped, requires_grad) if slot.kind == "param" else wrapped
    else:
        new = nn.Parameter(data, requires_grad) if slot.kind == "param" else data
        if slot.layout is not None:
            annotate_layout(new, slot.layout, rank=slot.rank)
    for key, attribute in vars(slot.original).items():
        if key not in _OWN_ATTRIBUTES:
            setattr(new, key, attribute)
    return new

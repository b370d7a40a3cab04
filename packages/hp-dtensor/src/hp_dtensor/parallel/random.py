"""Distributed RNG: random ops on distributed tensors give the values of a single-device run.

Principle
    Every rank keeps the *single-device* RNG stream. A random op on a distributed tensor draws
    the whole (global-size) random tensor from the global generator, exactly as the op would
    on one device, and then keeps this rank's region of it. Ranks seeded identically (the
    requirement: call ``torch.manual_seed(s)`` with the same ``s`` on every rank) therefore
    draw identical tensors, stay in step whatever their layout, and hold exactly the values a
    single-device run under the same seed would give.

Dropout (:func:`distributed_dropout`)
    ``F.dropout`` on CPU (ATen's composite ``_dropout_impl``) draws its noise as
    ``torch.empty_like(input).bernoulli_(1 - p)``, divides it by ``1 - p`` and multiplies:
    one ``bernoulli_`` call on a tensor of the input's shape and dtype. The channel-wise
    forms draw ``(N, C, 1, ...)``-shaped noise (``dropout1d`` / ``dropout3d`` on unbatched
    inputs first add a batch dim of 1), alpha dropout adds an affine term; ``p == 1`` and
    empty inputs draw nothing. :func:`distributed_dropout` makes the same call on the
    global shape, so on CPU the mask, the output and the gradient of every rank are
    *bit-identical* to the region of a single-device ``F.dropout`` (or variant) under the same
    seed, and the generator advances by exactly the same amount (tested).

    Memory order: CPU ``bernoulli_`` fills its tensor in memory order, and ``empty_like``
    keeps the input's strides, so a single-device dropout of a tensor with a permuted memory
    layout (a transposed view, ``channels_last``) draws a different mask from that of its
    contiguous copy. The distributed draw follows the row-major (contiguous) global tensor;
    call ``.contiguous()`` before dropout where the single-device input is permuted.

Data parallelism
    The layout decides which single-device run is reproduced. A layout over the whole mesh
    (the batch sharded over the data-parallel axis too, as in validation mode) reproduces
    the single-device run on the global batch: every rank draws the global-batch noise. A
    layout over the tensor-parallel axis only (production mode, whose global shape is the
    data-parallel replica's batch) reproduces one device running that replica's batch; ranks
    of different replicas seeded identically then draw identical masks for different samples.
    Seed per replica (``torch.manual_seed(seed + dp_rank)``) where that correlation is unwanted.

Cost
    Each random op materializes a transient random tensor of the *global* size on every rank
    (for element-wise dropout: ``global numel x itemsize`` bytes, freed before the op
    returns; channel-wise dropout only ``N x C`` elements), and generating it costs the
    single-device work, i.e. ``world`` times the local share under ``world``-way sharding.
    A counter-based generator avoids both: CUDA's Philox generator gives element ``i`` of a
    draw from ``(seed, offset + i)``, so each rank could generate only its region by
    starting at its elements' offsets (as ``torch.distributed.tensor``'s offset-based RNG
    tracker does). CPU has no such generator, hence this design; it is not implemented here.
    On accelerators, ``F.dropout`` runs a fused kernel (``native_dropout``) that consumes the
    generator differently, so there the result equals a single-device
    :func:`distributed_dropout` (the same draw on a replicated layout), not necessarily
    ``F.dropout`` bit for bit.

Initialization
    :func:`random_region` draws an initializer on the global shape and keeps a rank's region;
    :func:`hp_dtensor.parallel.init.materialize` does that for whole modules.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import nn

from hp_layout import Layout, Region

__all__ = [
    "DropoutVariant",
    "distributed_dropout",
    "parallel_dropout_forward",
    "random_region",
    "take_region",
]

DropoutVariant = Literal[
    "dropout",
    "alpha_dropout",
    "feature_dropout",
    "feature_alpha_dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
]
"""Which torch dropout a distributed dropout reproduces (the ``torch.nn.functional`` name)."""

_VARIANTS: tuple[str, ...] = get_args(DropoutVariant)

_SELU_ALPHA = 1.7580993408473766
"""The alpha ATen's alpha dropout uses (SELU's negative saturation value)."""


# Regions ---------------------------------------------------------------------------------------


def take_region(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The elements of the global tensor ``full`` that ``region`` names, shaped as local data.

    A box region is a slice (a view); a flat region (after a ``RaggedShard``) is the
    ``[start, stop)`` range of the row-major flattened box (a copy when the box is not
    contiguous in ``full``).
    """
    if full.dim() != len(region.box):
        raise ValueError(
            f"a region of a {len(region.box)}-d tensor cannot be taken from a tensor of shape "
            f"{tuple(full.shape)}"
        )
    box = full[tuple(slice(a, b) for a, b in region.box)] if region.box else full
    if region.flat is None:
        return box
    start, stop = region.flat
    return box.reshape(-1)[start:stop]


def random_region(
    fill: Callable[[torch.Tensor], object],
    layout: Layout,
    rank: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``rank``'s region of a global tensor initialized by ``fill`` (e.g. ``nn.init.normal_``).

    ``fill`` runs in place on a full-size ``torch.empty(layout.global_shape)`` under
    ``torch.no_grad()``, drawing from the global generator exactly as on one device; the
    result is a contiguous copy of this rank's region (the full tensor is freed).
    """
    if layout.has_partial:
        raise ValueError(f"random_region: {layout!r} is Partial; a random value has no pieces")
    full = torch.empty(layout.global_shape, dtype=dtype, device=device)
    with torch.no_grad():
        fill(full)
    region = take_region(full, layout.local_region(rank))
    return region.clone(memory_format=torch.contiguous_format)


# Dropout ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Noise:
    """How a dropout variant draws its noise for one global input shape.

    Attributes:
        draw_shape: the shape ATen draws the Bernoulli noise in.
        mask_shape: the same noise in the input's coordinates (1 where it broadcasts).
        alpha: alpha dropout (an affine term keeps mean and variance).
    """

    draw_shape: tuple[int, ...]
    mask_shape: tuple[int, ...]
    alpha: bool


def _noise(variant: str, shape: tuple[int, ...]) -> _Noise:
    """The noise of ``variant`` on an input of global ``shape`` (torch's dim rules)."""
    if variant not in _VARIANTS:
        raise ValueError(f"unknown dropout variant {variant!r}; use one of {list(_VARIANTS)}")
    alpha = variant in ("alpha_dropout", "feature_alpha_dropout")
    if variant in ("dropout", "alpha_dropout"):
        return _Noise(shape, shape, alpha)
    ndim = len(shape)
    if variant == "dropout1d" and ndim not in (2, 3):
        raise RuntimeError(f"dropout1d: Expected 2D or 3D input, but received a {ndim}D input")
    batched = {"dropout1d": ndim == 3, "dropout3d": ndim == 5}.get(variant, True)
    work = shape if batched else (1, *shape)
    if len(work) < 2:
        raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
    draw = (work[0], work[1], *(1,) * (len(work) - 2))
    return _Noise(draw, draw if batched else draw[1:], alpha)


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def _check_local(x_local: torch.Tensor, layout: Layout, rank: int) -> None:
    if layout.has_partial:
        raise ValueError(
            f"dropout on {layout!r}: a Partial value must be reduced (redistributed to "
            "Replicate) before the mask applies, since the mask multiplies the whole value"
        )
    expected = layout.local_shape(rank)
    if tuple(x_local.shape) != expected:
        raise ValueError(
            f"rank {rank}: a local tensor of shape {tuple(x_local.shape)} is not the local "
            f"shard of {layout!r}, which gives shape {expected}"
        )


def _local_noise(noise: torch.Tensor, shape: tuple[int, ...], region: Region) -> torch.Tensor:
    """This rank's part of ``noise`` (global, ``mask_shape``), broadcastable to its data."""
    if region.flat is not None:
        return take_region(noise.expand(shape), region)
    index = tuple(
        slice(a, b) if n == full else slice(None)
        for (a, b), n, full in zip(region.box, noise.shape, shape, strict=True)
    )
    return noise[index] if index else noise


def _apply(
    x: torch.Tensor, noise: torch.Tensor, p: float, alpha: bool, inplace: bool
) -> torch.Tensor:
    """ATen's ``_dropout_impl`` arithmetic, on this rank's part of the noise."""
    if not alpha:
        scale = noise.div(1 - p)
        return x.mul_(scale) if inplace else x * scale
    a = 1.0 / math.sqrt((_SELU_ALPHA * _SELU_ALPHA * p + 1) * (1 - p))
    shift = noise.add(-1).mul_(_SELU_ALPHA * a).add_(_SELU_ALPHA * a * p)
    scale = noise.mul(a)
    out = x.mul_(scale) if inplace else x * scale
    return out.add_(shift)


def distributed_dropout(
    x_local: torch.Tensor,
    p: float,
    training: bool,
    layout: Layout,
    rank: int,
    *,
    variant: DropoutVariant = "dropout",
    inplace: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Dropout of a distributed tensor: this rank's region of the single-device result.

    Args:
        x_local: this rank's local tensor (a plain tensor, shape ``layout.local_shape(rank)``).
        p: drop probability.
        training: apply dropout (False: the identity, ``x_local`` itself, no draw).
        layout: the layout ``x_local`` is a shard of: any Shard/Replicate/RaggedShard
            combination, nested and uneven (empty) shards included; not Partial (reduce
            first).
        rank: the global rank holding ``x_local``.
        variant: the torch dropout to reproduce (``"dropout"`` for ``F.dropout``,
            ``"dropout2d"`` for ``F.dropout2d``, ...); channel-wise variants share the mask
            over spatial dims exactly as torch does, whatever shards those dims.
        inplace: multiply ``x_local`` in place (as ``F.dropout(..., inplace=True)``).
        generator: draw from this generator instead of the default one of ``x_local``'s
            device (``F.dropout`` itself always uses the default generator).

    Draws the global noise with the same single ``bernoulli_`` call (shape, dtype, device)
    as the single-device op, so on CPU the result and its gradient are bit-identical to the
    region of the single-device result under the same seed, and the generator advances as
    on one device, on every rank. See the module docstring for the cost.
    """
    _check_p(p)
    if not training or p == 0.0:
        return x_local
    _check_local(x_local, layout, rank)
    spec = _noise(variant, layout.global_shape)
    if layout.numel == 0:
        return x_local
    if p == 1.0:
        zero = torch.zeros((), dtype=x_local.dtype, device=x_local.device)
        return x_local.mul_(zero) if inplace else x_local * zero
    noise = torch.empty(spec.draw_shape, dtype=x_local.dtype, device=x_local.device)
    noise.bernoulli_(1 - p, generator=generator)
    local = _local_noise(
        noise.view(spec.mask_shape), layout.global_shape, layout.local_region(rank)
    )
    del noise
    return _apply(x_local, local, p, spec.alpha, inplace)


_MODULE_VARIANTS: tuple[tuple[type[nn.Module], DropoutVariant, bool], ...] = (
    # (module type, variant, whether the module passes its ``inplace`` flag)
    (nn.AlphaDropout, "alpha_dropout", False),
    (nn.FeatureAlphaDropout, "feature_alpha_dropout", False),
    (nn.Dropout1d, "dropout1d", True),
    (nn.Dropout2d, "dropout2d", True),
    (nn.Dropout3d, "dropout3d", True),
    (nn.Dropout, "dropout", True),
)


def parallel_dropout_forward(
    module_or_p: nn.Module | float,
    x_local: torch.Tensor,
    layout: Layout,
    rank: int,
    *,
    training: bool | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The forward of a dropout module (or of ``F.dropout`` with probability ``p``) on a
    local shard, giving this rank's region of the single-device output.

    ``module_or_p`` is ``nn.Dropout``, ``nn.Dropout1d/2d/3d``, ``nn.AlphaDropout``,
    ``nn.FeatureAlphaDropout`` (or a subclass), or a float ``p`` (element-wise dropout).
    ``training`` defaults to the module's mode (True for a float). ``layout`` is the layout
    of the module's input (see :func:`distributed_dropout`). Production mode calls this in
    place of the module's forward.
    """
    if isinstance(module_or_p, nn.Module):
        for kind, variant, passes_inplace in _MODULE_VARIANTS:
            if isinstance(module_or_p, kind):
                inplace = passes_inplace and bool(getattr(module_or_p, "inplace", False))
                return distributed_dropout(
                    x_local,
                    float(getattr(module_or_p, "p", 0.5)),
                    module_or_p.training if training is None else training,
                    layout,
                    rank,
                    variant=variant,
                    inplace=inplace,
                    generator=generator,
                )
        raise TypeError(
            f"parallel_dropout_forward: {type(module_or_p).__name__} is not a torch dropout "
            "module; pass nn.Dropout, nn.Dropout1d/2d/3d, nn.AlphaDropout, "
            "nn.FeatureAlphaDropout or a float p"
        )
    p = float(module_or_p)
    return distributed_dropout(
        x_local, p, True if training is None else training, layout, rank, generator=generator
    )

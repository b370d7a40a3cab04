"""FP8 scales of a tensor-parallel :class:`~hp_kernels.float8.Float8Linear` equal to one rank's.

A split linear holds a piece of its weight (column-parallel: a range of output features, dim 0;
row-parallel: a range of input features, dim 1), and one of its activations is split the same
way (column-parallel: the grad_output's last dim; row-parallel: the input's last dim). A scale
computed from a piece alone would differ from the one the whole tensor gets on one rank, so
the quantized values would too. Here each such operand is quantized with the scale of the
**whole** tensor's block (or of the whole tensor):

* tensorwise: the local amax is reduced (max) over the group, one scalar all-reduce;
* blockwise, pieces starting on block edges (every piece's start a multiple of the block size
  along the split dim): each local block *is* a block of the whole tensor, nothing is sent;
* blockwise, a piece starting inside a block (the block straddles two ranks): the amax of every
  block this rank touches is reduced over the group (one all-reduce of the grid of block
  amaxes, ``ceil(extent / b)`` along the split dim), and each local row or column along the
  split dim takes its whole block's scale. The operand then carries per-row (or per-column)
  scales, block shape ``(rows, 1)`` or ``(1, cols)``: the same values as one rank's, which the
  emulated matmul multiplies exactly (a hardware blockwise kernel would want whole tiles; so
  shards should start on block edges, as they do when ``extent / tp`` is a multiple of ``b``).

The reduction itself is the caller's (``TensorParallelSplit.reduce_max``): a tensor-parallel
executor passes one that its collective watchdog names (hp-dtensor's does), which this package,
below hp-dtensor, cannot import.

Non-finite values stay visible: a NaN amax is sent as ``+inf`` (a max over ranks keeps it,
where a NaN might be dropped) and a non-finite amax gives a NaN scale, as on one rank.
The all-reduces run on every rank of the group in the same order (forward: input then weight;
backward: grad_output), so they pair up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hp_kernels.float8.formats import Float8Format
from hp_kernels.float8.quantize import (
    expand_block_scales,
    quantize_blockwise_2d,
    quantize_tensorwise,
    scale_from_amax,
)

__all__ = [
    "TensorParallelSplit",
    "quantize_split_blockwise",
    "quantize_split_tensorwise",
    "reduce_amax",
]

#: The operands of ``y = x W^T`` that a split along the weight's dim 0 or 1 also splits (their
#: last dim), besides the weight itself.
_SPLIT_ACTIVATION = {0: "grad_output", 1: "input"}


@dataclass(frozen=True)
class TensorParallelSplit:
    """How a linear's weight ``[out, in]`` is split over a tensor-parallel group.

    Attributes:
        group: the process group of the ranks holding the pieces.
        dim: 0 (output features: column-parallel) or 1 (input features: row-parallel).
        bounds: ``(start, stop)`` of each piece along ``dim``, in group-rank order; contiguous
            from 0 (the last ``stop`` is the whole extent).
        index: this rank's position in ``bounds`` (its rank in ``group``).
        reduce_max: replaces a float32 tensor, in place, by its element-wise max over
            ``group`` (collective: every rank of the group calls it in the same order).
    """

    group: Any
    dim: int
    bounds: tuple[tuple[int, int], ...]
    index: int
    reduce_max: Callable[[Tensor], None]

    def __post_init__(self) -> None:
        if self.dim not in (0, 1):
            raise ValueError(
                f"dim must be 0 (output features, column-parallel) or 1 (input features, "
                f"row-parallel), got {self.dim!r}"
            )
        if not self.bounds:
            raise ValueError("bounds must name one (start, stop) per rank of the group, got ()")
        expected = 0
        for start, stop in self.bounds:
            if start != expected or stop < start:
                raise ValueError(
                    f"bounds {self.bounds} are not contiguous pieces from 0: expected a piece "
                    f"starting at {expected}, got ({start}, {stop})"
                )
            expected = stop
        if not 0 <= self.index < len(self.bounds):
            raise ValueError(f"index {self.index} is outside bounds of {len(self.bounds)} ranks")

    @property
    def start(self) -> int:
        """This rank's first index along ``dim``."""
        return self.bounds[self.index][0]

    @property
    def length(self) -> int:
        """This rank's piece length along ``dim``."""
        start, stop = self.bounds[self.index]
        return stop - start

    @property
    def extent(self) -> int:
        """The whole weight's size along ``dim``."""
        return self.bounds[-1][1]

    def splits(self, operand: str) -> bool:
        """Whether ``operand`` (``"input"``, ``"weight"``, ``"grad_output"``) is split."""
        return operand == "weight" or _SPLIT_ACTIVATION[self.dim] == operand

    def on_block_edges(self, block: int) -> bool:
        """Every piece starts on a multiple of ``block`` (no block straddles two ranks)."""
        return all(start % block == 0 for start, _ in self.bounds)


def reduce_amax(amax: Tensor, split: TensorParallelSplit) -> Tensor:
    """The max of ``amax`` (fp32, any shape) over the split's group; a NaN anywhere becomes
    ``+inf`` (non-finite, so its scale is NaN) on every rank."""
    out = torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax.float())
    split.reduce_max(out)
    return out


def quantize_split_tensorwise(
    t: Tensor, fmt: Float8Format, split: TensorParallelSplit
) -> tuple[Tensor, Tensor]:
    """Quantize this rank's piece ``t`` with the whole tensor's dynamic tensorwise scale.

    Returns ``(data, scale)`` as :func:`~hp_kernels.float8.quantize_tensorwise` does for the
    whole tensor, restricted to the piece (collective over ``split.group``).
    """
    amax = t.detach().abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
    scale = scale_from_amax(reduce_amax(amax, split), fmt)
    data, _ = quantize_tensorwise(t, fmt, scale)
    # The fresh scale, not quantize_tensorwise's view of it: torch.compile refuses a view of
    # an intermediate saved for backward by an autograd.Function.
    return data, scale


def quantize_split_blockwise(
    t: Tensor, fmt: Float8Format, block: tuple[int, int], dim: int, split: TensorParallelSplit
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """Quantize this rank's piece ``t`` (2-d, split along ``dim`` as ``split`` says) with the
    scales of the whole tensor's ``block`` tiles.

    Returns ``(data, scales, block_shape)`` with ``t ~= data.float() * expand_block_scales(
    scales, block_shape, t.shape)``: the whole tensor's tiles when the pieces start on block
    edges (no communication), otherwise per-row or per-column scales of the tiles they belong
    to (one all-reduce over ``split.group``; see the module docstring).
    """
    if t.dim() != 2 or dim not in (0, 1):
        raise ValueError(
            f"expected a 2-d piece split along dim 0 or 1, got {tuple(t.shape)}, {dim}"
        )
    if t.shape[dim] != split.length:
        raise ValueError(
            f"the piece has {t.shape[dim]} entries along dim {dim} but its split gives this rank "
            f"{split.bounds[split.index]} ({split.length}); the weight was re-split after "
            "set_tensor_parallel"
        )
    if split.on_block_edges(block[dim]):
        data, scales = quantize_blockwise_2d(t, fmt, block)
        return data, scales, block
    if dim == 0:
        data, scales, shape = _straddling_columns(t.t(), fmt, (block[1], block[0]), split)
        return data.t(), scales.t(), (shape[1], shape[0])
    return _straddling_columns(t, fmt, block, split)


def _straddling_columns(
    t: Tensor, fmt: Float8Format, block: tuple[int, int], split: TensorParallelSplit
) -> tuple[Tensor, Tensor, tuple[int, int]]:
    """Blockwise quantization of a piece split along its columns, tiles straddling pieces."""
    rows_per, cols_per = block
    x = t.detach().float().abs()
    x = torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x)
    m, n = x.shape
    row_tiles = -(-m // rows_per)
    padded = torch.nn.functional.pad(x, (0, 0, 0, row_tiles * rows_per - m))
    per_column = padded.reshape(row_tiles, rows_per, n).amax(dim=1) if m else padded[:0]
    tile_of = (split.start + torch.arange(n, device=x.device)) // cols_per
    grid = x.new_zeros((row_tiles, -(-split.extent // cols_per)))
    grid.scatter_reduce_(1, tile_of.expand(row_tiles, n), per_column, "amax", include_self=True)
    scales = scale_from_amax(reduce_amax(grid, split), fmt)[:, tile_of]
    full = expand_block_scales(scales, (rows_per, 1), (m, n))
    data = torch.clamp(t.detach().float() / full, -fmt.max, fmt.max).to(fmt.dtype)
    return data.contiguous(), scales.contiguous(), (rows_per, 1)

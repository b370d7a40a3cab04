"""``Float8Linear``: an ``nn.Linear`` whose matmuls run in FP8, and ``convert_to_float8``.

Forward ``y = x W^T + b``: ``x`` and ``W`` are quantized to ``config.forward_format``
(e4m3); the matmul is :func:`~hp_kernels.float8.scaled_mm`; ``b`` is added in fp32.
Backward: ``grad_output`` is quantized once to ``config.grad_format`` (e5m2 by default) and
used by both ``grad_input = gO W`` and ``grad_weight = gO^T x``; those reuse the FP8 copies
of ``x`` and ``W`` saved by the forward (so the saved activation is FP8, not the input
dtype). ``grad_bias`` is the sum of the unquantized ``grad_output`` in fp32. Hardware
blockwise kernels would want ``x`` and ``gO`` re-blocked along the token dim for the weight
gradient; the emulation is indifferent to block orientation, so it reuses one copy.

The master weight (``self.weight``) keeps its dtype (fp32 or bf16) and receives a gradient
of that dtype; the output has the input's dtype. Autocast is not consulted.

Pre-quantized weights (for an FP8 parameter all-gather): see
:meth:`Float8Linear.set_prequantized_weight`.

Tensor parallelism: shapes follow ``self.weight`` (a piece of the whole under a
column- or row-parallel plan, ``in_features``/``out_features`` staying the whole's), and
:meth:`Float8Linear.set_tensor_parallel` makes the scales of the split operands those of the
whole tensor (:mod:`hp_kernels.float8.tensor_parallel`), so each rank quantizes its piece
exactly as one rank quantizes the whole; :meth:`Float8Linear.linear_with_bias` is the product
with a bias of the caller's (a row-parallel executor adds the bias on one rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hp_kernels.float8.formats import Float8Format
from hp_kernels.float8.quantize import (
    dequantize_blockwise,
    quantize_blockwise_2d,
    quantize_tensorwise,
)
from hp_kernels.float8.scaled_mm import dequantize_operand, scaled_mm
from hp_kernels.float8.scaling import (
    Float8LinearConfig,
    ScalingGranularity,
    ScalingType,
    delayed_scale,
    push_amax,
)
from hp_kernels.float8.tensor_parallel import (
    TensorParallelSplit,
    quantize_split_blockwise,
    quantize_split_tensorwise,
    reduce_amax,
)

__all__ = ["Float8Linear", "convert_to_float8"]

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HISTORY_NAMES = ("amax_history_input", "amax_history_weight", "amax_history_grad_output")


@dataclass(frozen=True)
class _Operand:
    """A 2-d matmul operand: FP8 ``data`` with ``scale`` (tensorwise when ``block`` is None),
    or, when ``data`` is not FP8, an already dequantized fp32 matrix (``scale`` unused)."""

    data: Tensor
    scale: Tensor
    block: tuple[int, int] | None

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype in _FP8_DTYPES

    def t(self) -> _Operand:
        if not self.is_fp8 or self.block is None:
            return _Operand(self.data.t(), self.scale, self.block)
        return _Operand(self.data.t(), self.scale.t(), (self.block[1], self.block[0]))

    def dense(self) -> Tensor:
        if not self.is_fp8:
            return self.data.float()
        return dequantize_operand(self.data, self.scale, self.block)


def _matmul(a: _Operand, b: _Operand, out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    if a.is_fp8 and b.is_fp8:
        return scaled_mm(
            a.data,
            a.scale,
            b.data,
            b.scale,
            out_dtype,
            bias,
            a_block_shape=a.block,
            b_block_shape=b.block,
        )
    out = a.dense() @ b.dense()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _quantize(
    t: Tensor,
    fmt: Float8Format,
    block: tuple[int, int] | None,
    scaling: ScalingType,
    history: Tensor | None,
    split: tuple[TensorParallelSplit, int] | None = None,
) -> _Operand:
    """Quantize a 2-d tensor per the config; a delayed history is used, then updated.
    ``split``: the tensor is this rank's piece along the given dim, scaled as the whole."""
    t = t.detach()
    if block is not None:
        if split is not None:
            data, scales, shape = quantize_split_blockwise(t, fmt, block, split[1], split[0])
            return _Operand(data, scales, shape)
        data, scales = quantize_blockwise_2d(t, fmt, block)
        return _Operand(data, scales, block)
    if scaling is ScalingType.DYNAMIC:
        if split is not None:
            data, scale = quantize_split_tensorwise(t, fmt, split[0])
        else:
            data, scale = quantize_tensorwise(t, fmt)
        return _Operand(data, scale, None)
    assert history is not None  # buffers exist whenever a tensor uses delayed scaling
    amax = t.abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)
    if split is not None:
        amax = reduce_amax(amax, split[0])
    scale = delayed_scale(history, amax, fmt)
    data, scale = quantize_tensorwise(t, fmt, scale)
    push_amax(history, amax)
    return _Operand(data, scale, None)


@dataclass(frozen=True)
class _Prequantized:
    data: Tensor
    scales: Tensor
    block_size: int | None


class _Float8MatmulFn(torch.autograd.Function):
    """Autograd for ``x W^T + b`` with FP8 operands (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any,
        x2d: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        module: Float8Linear,
        w_op: _Operand | None,
    ) -> Tensor:
        cfg = module.config
        b = cfg.block_size
        blockwise = cfg.granularity is ScalingGranularity.BLOCKWISE
        x_op = _quantize(
            x2d,
            cfg.forward_format,
            (1, b) if blockwise else None,
            cfg.input_scaling,
            module._history("amax_history_input"),
            module._split_of("input"),
        )
        if w_op is None:
            w_op = _quantize(
                weight,
                cfg.forward_format,
                (b, b) if blockwise else None,
                cfg.weight_scaling,
                module._history("amax_history_weight"),
                module._split_of("weight"),
            )
        # Through save_for_backward, so saved-tensor hooks (offload, checkpoint) see the FP8
        # copies; only the block shapes ride on ctx.
        ctx.save_for_backward(x_op.data, x_op.scale, w_op.data, w_op.scale)
        ctx.blocks = (x_op.block, w_op.block)
        ctx.module = module
        ctx.x_dtype = x2d.dtype
        ctx.w_dtype = weight.dtype
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return _matmul(x_op, w_op.t(), x2d.dtype, bias)

    @staticmethod
    def backward(
        ctx: Any, grad_out: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None]:
        module: Float8Linear = ctx.module
        cfg = module.config
        blockwise = cfg.granularity is ScalingGranularity.BLOCKWISE
        g_op = _quantize(
            grad_out,
            cfg.grad_format,
            (1, cfg.block_size) if blockwise else None,
            cfg.grad_output_scaling,
            module._history("amax_history_grad_output"),
            module._split_of("grad_output"),
        )
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        x_op = _Operand(x_data, x_scale, ctx.blocks[0])
        # A weight handed over since the forward (e.g. re-gathered by FSDP before backward)
        # replaces the saved copy, whose storage the caller may have freed by now.
        w_op = module._take_prequantized()
        if w_op is None:
            w_op = _Operand(w_data, w_scale, ctx.blocks[1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _matmul(g_op, w_op, ctx.x_dtype, None)
        if ctx.needs_input_grad[1]:
            grad_w = _matmul(g_op.t(), x_op, ctx.w_dtype, None)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.float().sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` computing in FP8 (see the module docstring); same parameters and
    ``state_dict`` keys as ``nn.Linear``.

    Delayed scaling keeps ``amax_history_input``, ``amax_history_weight`` and
    ``amax_history_grad_output`` (fp32, length ``config.amax_history_len``) as
    **non-persistent** buffers: they are not in the ``state_dict`` (which stays loadable
    into a plain ``nn.Linear``), and after loading a checkpoint the first call bootstraps
    from the tensor's own amax.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        config: Float8LinearConfig | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_float8(config, self.weight.device)

    def _init_float8(self, config: Float8LinearConfig | None, device: torch.device) -> None:
        self.config = config if config is not None else Float8LinearConfig()
        if not isinstance(self.config, Float8LinearConfig):
            raise TypeError(f"config must be a Float8LinearConfig, got {self.config!r}")
        self._prequantized: _Prequantized | None = None
        self._tp_split: TensorParallelSplit | None = None
        kinds = (
            self.config.input_scaling,
            self.config.weight_scaling,
            self.config.grad_output_scaling,
        )
        for name, kind in zip(_HISTORY_NAMES, kinds, strict=True):
            if kind is ScalingType.DELAYED:
                history = torch.zeros(self.config.amax_history_len, device=device)
                self.register_buffer(name, history, persistent=False)

    def _history(self, name: str) -> Tensor | None:
        history = self._buffers.get(name)
        return history

    def set_tensor_parallel(
        self,
        group: Any,
        dim: int,
        bounds: Sequence[tuple[int, int]],
        index: int,
        reduce_max: Callable[[Tensor], None],
    ) -> None:
        """Declare that ``self.weight`` now holds piece ``bounds[index]`` of the whole weight
        along ``dim`` (0: output features, column-parallel; 1: input features, row-parallel),
        the pieces of all ranks of ``group`` being ``bounds`` in group-rank order.

        Afterwards every call quantizes the weight, and the activation split with it (dim 0:
        grad_output; dim 1: input), with the scales the whole tensor gets on one rank (see
        :mod:`hp_kernels.float8.tensor_parallel`): the quantized values of each piece are
        exactly one rank's. Every call is then collective over ``group`` (all its ranks call
        the module's forward and backward in the same order). A tensor-parallel executor calls
        this once it has replaced the weight by the local piece; ``group=None`` is the default
        process group. ``reduce_max`` replaces a float32 tensor in place by its element-wise max
        over ``group`` (the amax reduction; an executor passes one its watchdog names).

        Raises:
            ValueError: ``dim`` not 0 or 1; ``bounds`` not contiguous pieces from 0 covering
                the whole weight's ``in`` or ``out`` features; ``index`` not in ``bounds``;
                ``index`` differing from this rank's rank in ``group``.
        """
        pieces = tuple((int(a), int(b)) for a, b in bounds)
        split = TensorParallelSplit(group, dim, pieces, index, reduce_max)
        if dist.is_initialized() and dist.get_rank(group) != index:
            raise ValueError(
                f"index {index} is not this rank's rank {dist.get_rank(group)} in the group; "
                "bounds must be given in group-rank order"
            )
        whole = self.out_features if dim == 0 else self.in_features
        if split.extent != whole:
            raise ValueError(
                f"bounds {split.bounds} cover {split.extent} features along dim {dim}, the "
                f"linear has {whole}"
            )
        self._tp_split = split

    @property
    def tensor_parallel_split(self) -> TensorParallelSplit | None:
        """The split :meth:`set_tensor_parallel` declared, or None (the weight is whole)."""
        return self._tp_split

    def _split_of(self, operand: str) -> tuple[TensorParallelSplit, int] | None:
        """The split of ``operand`` and its split dim (in its 2-d form), or None."""
        split = self._tp_split
        if split is None or not split.splits(operand):
            return None
        return split, (split.dim if operand == "weight" else 1)

    @classmethod
    def from_float(
        cls, linear: nn.Linear, config: Float8LinearConfig | None = None
    ) -> Float8Linear:
        """A ``Float8Linear`` that shares ``linear``'s ``weight`` and ``bias`` Parameter
        objects (no copy), so optimizers built on them keep working. Hooks registered on
        ``linear`` itself are not carried over."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_float needs an nn.Linear, got {type(linear).__name__}")
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        new._init_float8(config, linear.weight.device)
        return new

    def set_prequantized_weight(
        self, data: Tensor, scales: Tensor, block_size: int | None = None
    ) -> None:
        """Supply the unsharded weight already in FP8, consumed by the **next forward or
        backward** of this module, whichever runs first.

        The hook for an FP8 parameter all-gather: the gathered FP8 bytes are used as the
        weight operand instead of quantizing ``self.weight``, which still receives the weight
        gradient (its value is not read for a call that consumes a pre-quantized weight).

        * Set before a forward: that forward uses it and saves it (by reference, no copy) for
          its backward; the next forward quantizes ``self.weight`` again. Consumed whether or
          not grad is enabled.
        * Set between a forward and its backward (an FSDP pre-backward re-gather after
          resharding): the backward uses it instead of the saved copy. Only then may the
          caller free or reuse the storage handed to the forward; otherwise it must stay
          intact until the backward (an in-place write trips autograd's version check).
        * A recomputed forward (activation checkpointing) consumes a pending weight like any
          forward, and otherwise quantizes ``self.weight``. A module called twice per step
          consumes it in its first call.

        Args:
            data: FP8 (e4m3fn or e5m2) tensor of ``self.weight``'s shape (under tensor
                parallelism its local piece), or flat.
            scales: with ``block_size=None``, one tensorwise scale; otherwise the scales of
                :func:`~hp_kernels.float8.quantize_blockwise` over the row-major flattened
                weight (blocks start at flat offset 0; a sharded quantizer must therefore use
                shard sizes that are multiples of ``block_size``, except the last).
            block_size: flat block size, or None for a tensorwise scale.
        """
        if data.dtype not in _FP8_DTYPES:
            raise TypeError(f"prequantized weight data must be fp8, got {data.dtype}")
        if data.numel() != self.weight.numel() or data.dim() not in (1, 2):
            raise ValueError(
                f"prequantized weight has shape {tuple(data.shape)}; expected "
                f"{tuple(self.weight.shape)} or ({self.weight.numel()},)"
            )
        if block_size is None:
            if scales.numel() != 1:
                raise ValueError(
                    f"a tensorwise prequantized weight needs one scale, got {tuple(scales.shape)};"
                    " pass block_size for flat blockwise scales"
                )
        elif isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")
        elif scales.numel() != -(-data.numel() // block_size):
            raise ValueError(
                f"{data.numel()} weight elements in blocks of {block_size} need "
                f"{-(-data.numel() // block_size)} scales, got {scales.numel()}"
            )
        self._prequantized = _Prequantized(data, scales, block_size)

    def _take_prequantized(self) -> _Operand | None:
        pre, self._prequantized = self._prequantized, None
        if pre is None:
            return None
        # The weight's own shape: under tensor parallelism a piece of the whole.
        shape = (self.weight.shape[0], self.weight.shape[1])
        if pre.block_size is None:
            return _Operand(pre.data.reshape(shape), pre.scales.reshape(()), None)
        if shape[1] % pre.block_size == 0:
            # Flat blocks that never straddle a row are exactly (1, block) tiles.
            scales = pre.scales.reshape(shape[0], -1)
            return _Operand(pre.data.reshape(shape), scales, (1, pre.block_size))
        dense = dequantize_blockwise(
            pre.data.reshape(-1), pre.scales.reshape(-1), pre.block_size, torch.float32
        )
        return _Operand(dense.reshape(shape), dense.new_ones(()), None)

    def forward(self, input: Tensor) -> Tensor:
        return self.linear_with_bias(input, self.bias)

    def linear_with_bias(self, input: Tensor, bias: Tensor | None) -> Tensor:
        """``input @ self.weight^T + bias`` in FP8, with ``bias`` (``[weight rows]`` or None)
        in place of ``self.bias``: what a row-parallel executor calls so that the bias is
        counted on one rank only. Shapes follow ``self.weight``, which under tensor
        parallelism is this rank's piece (``input [..., weight cols] -> [..., weight rows]``).
        """
        rows, cols = self.weight.shape
        split = self._tp_split
        if split is not None and self.weight.shape[split.dim] != split.length:
            raise ValueError(
                f"the weight is {rows}x{cols} but set_tensor_parallel gave this rank the piece "
                f"{split.bounds[split.index]} of dim {split.dim}; declare the split again after "
                "re-splitting the weight"
            )
        if input.shape[-1] != cols:
            raise ValueError(
                f"Float8Linear expects input [..., {cols}] (its weight is {rows}x{cols}), got "
                f"{tuple(input.shape)}"
            )
        lead = input.shape[:-1]
        out: Tensor = _Float8MatmulFn.apply(  # type: ignore[no-untyped-call]
            input.reshape(-1, cols),
            self.weight,
            bias,
            self,
            self._take_prequantized(),
        )
        return out.reshape(*lead, rows)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"{super().extra_repr()}, fwd={c.forward_format.name}, grad={c.grad_format.name}, "
            f"{c.granularity.value}"
            + (f"(block={c.block_size})" if c.granularity is ScalingGranularity.BLOCKWISE else "")
        )


def convert_to_float8(
    module: nn.Module,
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap every selected ``nn.Linear`` in ``module`` for a :class:`Float8Linear`, in place.

    A linear is selected when its type is exactly ``nn.Linear`` (subclasses such as
    attention's ``out_proj``, whose weight is read directly by its owner, are left alone)
    and ``module_filter_fn(linear, fqn)`` is true (all are selected when it is None; ``fqn``
    is the dotted name from ``module``, ``""`` for ``module`` itself). The new modules share
    the original ``weight``/``bias`` Parameter objects, so an optimizer built earlier still
    steps them and ``state_dict`` keys are unchanged. Convert **before** sharding (FSDP,
    tensor parallel): wrappers that replaced parameters or registered hooks on the original
    linears are not re-applied. Returns ``module``, or the new module if ``module`` itself
    was a selected linear.
    """
    selected = [
        (fqn, mod)
        for fqn, mod in module.named_modules()
        if type(mod) is nn.Linear and (module_filter_fn is None or module_filter_fn(mod, fqn))
    ]
    for fqn, mod in selected:
        assert isinstance(mod, nn.Linear)
        new = Float8Linear.from_float(mod, config)
        if fqn == "":
            return new
        parent_name, _, child = fqn.rpartition(".")
        module.get_submodule(parent_name).register_module(child, new)
    return module

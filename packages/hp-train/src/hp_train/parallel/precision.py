"""Numeric formats of a run: FSDP's mixed precision and wire dtypes, FP8 linears, as
``TrainConfig`` names them (``mixed_precision``, ``grad_reduce_dtype``, ``fp8_all_gather``,
``fp8``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hp_fsdp import LowPrecisionCommPolicy, MixedPrecisionPolicy
from hp_train.config.schema import TrainConfig

__all__ = ["FP8_ALL_GATHER_DTYPE", "convert_blocks_to_float8", "fsdp_precision", "is_fp8_linear"]

#: The wire dtype of ``fp8_all_gather`` (precision matters more than range for weights).
FP8_ALL_GATHER_DTYPE = torch.float8_e4m3fn


def fsdp_precision(config: TrainConfig, *, replicated: bool) -> dict[str, Any]:
    """``fully_shard`` keyword arguments for ``config``'s precision (empty for fp32).

    ``mixed_precision="bf16"``: bf16 parameters for compute and all-gather, fp32 gradient
    reduction onto the fp32 shards. ``grad_reduce_dtype="bf16"`` puts bf16 on the wire of both
    gradient reductions (reduce-scatter and the replicas' all-reduce); ``fp8_all_gather``
    all-gathers e4m3 with one scale per 128 elements. ``replicated``: the FSDP mesh has a
    replicate axis (HSDP), whose all-reduce then takes the wire dtype too.
    """
    out: dict[str, Any] = {}
    if config.mixed_precision == "bf16":
        out["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    wire: dict[str, Any] = {}
    if config.grad_reduce_dtype == "bf16":
        wire["shard_reduce_dtype"] = torch.bfloat16
        if replicated:
            wire["replicate_reduce_dtype"] = torch.bfloat16
    if config.fp8_all_gather:
        wire["param_all_gather_dtype"] = FP8_ALL_GATHER_DTYPE
    if wire:
        out["comm_policy"] = LowPrecisionCommPolicy(**wire)
    return out


def is_fp8_linear(module: nn.Module, fqn: str) -> bool:
    """The linears ``fp8`` converts: a block's attention projections and dense feed-forward
    (not the output head, whose logits feed the loss, nor an MoE router)."""
    parts = fqn.split(".")
    return len(parts) >= 2 and parts[-2] in ("attn", "ffn") and "router" not in parts


def convert_blocks_to_float8(model: nn.Module, recipe: str) -> None:
    """Swap the linears :func:`is_fp8_linear` selects for ``hp_kernels.float8.Float8Linear``
    with dynamic ``recipe`` (``"tensorwise"`` or ``"blockwise"``) scaling, in place.

    Called before tensor parallelism: the column- and row-parallel styles then hand each
    ``Float8Linear`` its weight's piece and tell it its split (``set_tensor_parallel``), so its
    scales are the whole tensors' (amaxes reduced over tp) and it quantizes exactly what one
    rank quantizes; the row-parallel forward runs its FP8 product (``linear_with_bias``)."""
    from hp_kernels.float8 import Float8LinearConfig, ScalingGranularity, convert_to_float8

    granularity = {
        "tensorwise": ScalingGranularity.TENSORWISE,
        "blockwise": ScalingGranularity.BLOCKWISE,
    }[recipe]
    for name, block in model.named_children():
        if name != "layers":
            continue
        convert_to_float8(
            block,
            config=Float8LinearConfig(granularity=granularity),
            module_filter_fn=lambda m, fqn: is_fp8_linear(m, fqn),
        )

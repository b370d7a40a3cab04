"""Policies of fully_shard: mixed precision and offload (frozen, documented, FSDP2 names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; the main parameters and gradients stay in their
    own (typically fp32) dtype.

    Attributes:
        param_dtype: dtype of the unsharded parameters used in forward and backward (the
            all-gather runs in it); None keeps the parameters' dtype.
        reduce_dtype: dtype of the gradient reduction (reduce-scatter and all-reduce); None
            uses ``param_dtype`` (or the parameters' dtype).
        output_dtype: dtype the module's floating-point outputs are cast to; None leaves them.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default): sharded parameters and gradients stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in host memory; copy the shard to the device for
    the all-gather and the reduced gradient back.

    Attributes:
        pin_memory: pin the host buffers (needs an accelerator; on a CPU-only machine there is
            nothing to pin and the policy refuses ``True``).
    """

    pin_memory: bool = True

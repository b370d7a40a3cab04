"""How :class:`~hp_kernels.float8.Float8Linear` chooses its scales.

Two scaling types per tensor (input, weight, grad_output):

* ``DYNAMIC``: the scale comes from the tensor's own amax on every call (tensorwise or per
  block). Never saturates; costs one amax reduction per call.
* ``DELAYED``: the scale comes from the maximum of an amax history of the last
  ``amax_history_len`` calls (tensorwise only). Order on every call: (1) scale from
  ``max(history)``; (2) quantize with it, values beyond ``fmt.max * scale`` saturate;
  (3) push this call's amax into the history (newest at index 0, oldest dropped). So call
  ``t`` uses the amaxes of calls ``t - L .. t - 1``. While the history is all zero (the
  first call, or a freshly built module) the tensor's own amax is used instead, so the first
  step neither saturates nor uses an arbitrary scale. Input and weight histories are updated
  in the forward, the grad_output history in the backward. A non-finite amax enters the
  history too, so its NaN scale stays visible for ``L`` calls rather than being hidden.
  Activation-checkpoint recomputation runs the forward twice and so pushes twice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

from hp_kernels.float8.formats import Float8Format
from hp_kernels.float8.quantize import scale_from_amax

__all__ = [
    "Float8LinearConfig",
    "ScalingGranularity",
    "ScalingType",
    "delayed_scale",
    "push_amax",
]


class ScalingType(enum.Enum):
    """Where a tensor's scale comes from (see the module docstring)."""

    DYNAMIC = "dynamic"
    DELAYED = "delayed"


class ScalingGranularity(enum.Enum):
    """One scale per tensor, or one per block.

    Blockwise tiles in :class:`~hp_kernels.float8.Float8Linear` (``y = x @ W.T``, ``b`` the
    block size): input ``(1, b)`` and grad_output ``(1, b)``, both blocked along their last
    dim; weight ``(b, b)``. Short edge tiles are allowed, so no dimension needs to divide
    ``b``.
    """

    TENSORWISE = "tensorwise"
    BLOCKWISE = "blockwise"


@dataclass(frozen=True)
class Float8LinearConfig:
    """Configuration of :class:`~hp_kernels.float8.Float8Linear`.

    Attributes:
        forward_format: format of input and weight (E4M3 by default; the forward needs
            precision more than range).
        grad_format: format of grad_output (E5M2 by default for its range; E4M3 allowed).
        granularity: tensorwise or blockwise scales for all three tensors.
        block_size: block edge ``b`` for blockwise granularity.
        input_scaling, weight_scaling, grad_output_scaling: dynamic or delayed, per tensor.
            Delayed needs tensorwise granularity.
        amax_history_len: length ``L`` of each delayed-scaling amax history.
    """

    forward_format: Float8Format = Float8Format.E4M3
    grad_format: Float8Format = Float8Format.E5M2
    granularity: ScalingGranularity = ScalingGranularity.TENSORWISE
    block_size: int = 128
    input_scaling: ScalingType = ScalingType.DYNAMIC
    weight_scaling: ScalingType = ScalingType.DYNAMIC
    grad_output_scaling: ScalingType = ScalingType.DYNAMIC
    amax_history_len: int = 16

    def __post_init__(self) -> None:
        for name in ("forward_format", "grad_format"):
            if not isinstance(getattr(self, name), Float8Format):
                raise TypeError(f"{name} must be a Float8Format, got {getattr(self, name)!r}")
        if not isinstance(self.granularity, ScalingGranularity):
            raise TypeError(f"granularity must be a ScalingGranularity, got {self.granularity!r}")
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size < 1
        ):
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if (
            isinstance(self.amax_history_len, bool)
            or not isinstance(self.amax_history_len, int)
            or self.amax_history_len < 1
        ):
            raise ValueError(
                f"amax_history_len must be a positive int, got {self.amax_history_len!r}"
            )
        for name in ("input_scaling", "weight_scaling", "grad_output_scaling"):
            kind = getattr(self, name)
            if not isinstance(kind, ScalingType):
                raise TypeError(f"{name} must be a ScalingType, got {kind!r}")
            if kind is ScalingType.DELAYED and self.granularity is ScalingGranularity.BLOCKWISE:
                raise ValueError(
                    f"{name}=DELAYED needs granularity=TENSORWISE: delayed scaling keeps one "
                    "amax history per tensor, not per block; use DYNAMIC with BLOCKWISE"
                )

    @property
    def uses_delayed_scaling(self) -> bool:
        """Whether any of the three tensors keeps an amax history."""
        return ScalingType.DELAYED in (
            self.input_scaling,
            self.weight_scaling,
            self.grad_output_scaling,
        )


def delayed_scale(history: Tensor, amax: Tensor, fmt: Float8Format) -> Tensor:
    """Scale for this call: from ``max(history)``, or from ``amax`` while history is all 0."""
    past = history.max()
    # No host sync: the bootstrap choice is a device-side select. A NaN in the history must
    # win (``NaN > 0`` is False), or the bootstrap would hide it.
    use_past = (past > 0) | torch.isnan(past)
    return scale_from_amax(torch.where(use_past, past, amax.float()), fmt)


@torch.no_grad()
def push_amax(history: Tensor, amax: Tensor) -> None:
    """Insert ``amax`` at index 0 of ``history`` in place, dropping the oldest entry."""
    history.copy_(torch.roll(history, 1))
    history[0] = amax

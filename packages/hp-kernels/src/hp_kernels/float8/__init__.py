"""FP8 quantization, scaled matmul and an FP8 ``Linear`` for training.

Import as ``hp_kernels.float8`` (``hp_kernels`` itself does not import this subpackage).
Depends on torch only.

Scale convention everywhere: the stored scale multiplies, ``x ~= data.float() * scale``
(quantizing divides by it), as CUDA ``torch._scaled_mm`` expects.

* :mod:`~hp_kernels.float8.formats`: :class:`Float8Format` (E4M3 max 448, E5M2 max 57344)
  and the derived round-trip bound: ``|deq(q(x)) - x| <= max(2^-(m+1)|x|, s 2^(e_min-m-1))``
  up to fp32 rounding (e4m3: ``2^-4`` relative, ``2^-10 s`` floor; e5m2: ``2^-3``,
  ``2^-17 s``), see :func:`roundtrip_error_bound`.
* :mod:`~hp_kernels.float8.quantize`: tensorwise, 1-d blockwise and 2-d tile quantization
  (short edge blocks allowed; non-finite input gives NaN scales for its block).
* :mod:`~hp_kernels.float8.scaled_mm`: :func:`scaled_mm` (CUDA ``torch._scaled_mm``, NPU
  ``torch_npu``, fp32 emulation elsewhere) and :func:`matmul_error_bound`.
* :mod:`~hp_kernels.float8.scaling` / :mod:`~hp_kernels.float8.linear`:
  :class:`Float8LinearConfig` (dynamic or delayed scaling, tensorwise or blockwise),
  :class:`Float8Linear` and :func:`convert_to_float8`.
* :mod:`~hp_kernels.float8.tensor_parallel`: :class:`TensorParallelSplit`, the scales of a
  column- or row-parallel Float8Linear's pieces reduced over the group (one rank's values).
"""

from hp_kernels.float8.bounds import matmul_error_bound
from hp_kernels.float8.formats import Float8Format, roundtrip_error_bound
from hp_kernels.float8.linear import Float8Linear, convert_to_float8
from hp_kernels.float8.quantize import (
    dequantize_blockwise,
    dequantize_blockwise_2d,
    dequantize_tensorwise,
    expand_block_scales,
    quantize_blockwise,
    quantize_blockwise_2d,
    quantize_tensorwise,
    scale_from_amax,
)
from hp_kernels.float8.scaled_mm import dequantize_operand, scaled_mm
from hp_kernels.float8.scaling import (
    Float8LinearConfig,
    ScalingGranularity,
    ScalingType,
    delayed_scale,
    push_amax,
)
from hp_kernels.float8.tensor_parallel import TensorParallelSplit

__all__ = [
    "Float8Format",
    "Float8Linear",
    "Float8LinearConfig",
    "ScalingGranularity",
    "ScalingType",
    "TensorParallelSplit",
    "convert_to_float8",
    "delayed_scale",
    "dequantize_blockwise",
    "dequantize_blockwise_2d",
    "dequantize_operand",
    "dequantize_tensorwise",
    "expand_block_scales",
    "matmul_error_bound",
    "push_amax",
    "quantize_blockwise",
    "quantize_blockwise_2d",
    "quantize_tensorwise",
    "roundtrip_error_bound",
    "scale_from_amax",
    "scaled_mm",
]

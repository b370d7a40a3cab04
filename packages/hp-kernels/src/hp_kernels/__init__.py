"""hp-kernels: fused ops with per-backend implementations and pure-PyTorch references.

Ops (each also ``torch.ops.hp_kernels.<name>``, with a fake implementation so it traces):

* :func:`pack` / :func:`unpack`: many tensors to one flat buffer and back, with casts;
* :func:`newton_schulz`: (batched) Newton-Schulz orthogonalization in bf16;
* :func:`all_gather_matmul` / :func:`matmul_reduce_scatter`: TP communication fused with a
  matmul.

Which implementation runs is chosen per call from the input's device
(:mod:`hp_kernels.backends`); :mod:`hp_kernels.reference` holds the references.
"""

from __future__ import annotations

from hp_kernels.backends import FORCE_REFERENCE_ENV, available_backends
from hp_kernels.comm_matmul import all_gather_matmul, matmul_reduce_scatter
from hp_kernels.flat_buffer import offsets_of, pack, unpack
from hp_kernels.newton_schulz import newton_schulz
from hp_kernels.precision import bf16_matmul_is_slow, newton_schulz_dtype

__version__ = "0.1.0"

__all__ = [
    "FORCE_REFERENCE_ENV",
    "__version__",
    "all_gather_matmul",
    "available_backends",
    "bf16_matmul_is_slow",
    "matmul_reduce_scatter",
    "newton_schulz",
    "newton_schulz_dtype",
    "offsets_of",
    "pack",
    "unpack",
]

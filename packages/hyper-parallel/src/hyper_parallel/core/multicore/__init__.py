"""``hyper_parallel.core.multicore``: upstream's multicore MoE-FFN operator (Ascend AIC/AIV
kernels fusing dispatch, expert matmuls, SwiGLU and combine), named but not offered."""

from __future__ import annotations

from hyper_parallel.errors import NotOfferedError, not_offered
from hyper_parallel.migration import not_offered_here

__all__ = ["MegaMoeExperts"]


@not_offered_here(
    "hp_kernels.all_gather_matmul",
    "Ascend-only multicore MoE-FFN overlap; hp_kernels.all_gather_matmul and "
    "hp_kernels.matmul_reduce_scatter overlap TP communication with matmuls",
)
class MegaMoeExperts:
    """Upstream's multicore MoE-FFN experts (Ascend only): not offered; constructing one raises
    :class:`~hyper_parallel.NotOfferedError` naming what exists."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise _refusal()


def _refusal() -> NotOfferedError:
    return not_offered(
        "MegaMoeExperts (upstream's Ascend multicore MoE-FFN overlap operator)",
        "what exists is communication fused with matmuls for tensor parallelism, "
        "hp_kernels.all_gather_matmul and hp_kernels.matmul_reduce_scatter, and MoE layers "
        "with expert parallelism, hp_train.model.moe.MoE with hp_dtensor.parallel.ExpertParallel",
    )

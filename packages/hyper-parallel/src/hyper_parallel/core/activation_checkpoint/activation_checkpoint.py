"""``hyper_parallel.core.activation_checkpoint.activation_checkpoint``: upstream's
``checkpoint_wrapper(module)`` and ``swap_wrapper(module)`` on hp-offload's wrappers (which
wrap ``module`` in place and return it: its type, parameters and state dict are unchanged)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

import hp_offload
from hp_offload import FULL_RECOMPUTE, ActivationPolicy, BudgetPolicy, Swapper
from hyper_parallel.errors import not_offered
from hyper_parallel.migration import adapts

__all__ = ["checkpoint_wrapper", "swap_wrapper"]

_M = TypeVar("_M", bound=nn.Module)


@adapts(
    "hp_offload.checkpoint_wrapper",
    "upstream's torch-style keyword options refused by name; hp-offload's policies accepted",
)
def checkpoint_wrapper(
    module: _M,
    policy: ActivationPolicy | BudgetPolicy = FULL_RECOMPUTE,
    *,
    swapper: Swapper | None = None,
    preserve_rng_state: bool = True,
    **checkpoint_kwargs: object,
) -> _M:
    """Recompute ``module``'s activations in backward instead of keeping them (in place);
    return ``module``. Gradients are bit-equal to the unwrapped module's.

    ``policy`` (hp-offload's ``ActivationPolicy`` / ``BudgetPolicy``) keeps or swaps some op
    outputs instead (``swapper`` then says where); default: recompute everything.

    Raises:
        NotOfferedError: upstream's ``torch.utils.checkpoint`` options (``context_fn``,
            ``use_reentrant``, ...): selective checkpointing is ``policy=``.
    """
    if checkpoint_kwargs:
        raise not_offered(
            f"checkpoint_wrapper(**{sorted(checkpoint_kwargs)})",
            "choose what is kept, swapped or recomputed with policy=hp_offload.ActivationPolicy"
            "(rules={'matmul': 'save', ...}) or hp_offload.BudgetPolicy(bytes)",
        )
    hp_offload.checkpoint_wrapper(
        module, policy, swapper=swapper, preserve_rng_state=preserve_rng_state
    )
    return module


@adapts("hp_offload.swap_wrapper", "upstream's `policy_fn=`/`group_swap=` refused by name")
def swap_wrapper(
    module: _M,
    policy_fn: Callable[..., object] | None = None,
    group_swap: bool = False,
    *,
    swapper: Swapper | None = None,
) -> _M:
    """Move the activations ``module``'s forward saves to host memory, and back for backward
    (in place); return ``module``. Gradients are bit-equal to the unwrapped module's.

    ``swapper`` (hp-offload's ``Swapper``: which tensors by size, the host pool) defaults to a
    new one; share one among layers so the fetch of layer ``i - 1`` overlaps layer ``i``'s
    backward.

    Raises:
        NotOfferedError: ``policy_fn`` or ``group_swap=True`` (upstream options).
    """
    if policy_fn is not None:
        raise not_offered(
            "swap_wrapper(policy_fn=...)",
            "hp_offload.Swapper(min_bytes=...) selects the tensors by size (pass swapper=); "
            "to swap only some ops' outputs use checkpoint_wrapper(module, "
            "hp_offload.ActivationPolicy(rules={'matmul': 'swap'}), swapper=...)",
        )
    if group_swap:
        raise not_offered(
            "swap_wrapper(group_swap=True)",
            "every wrapped call is one swap group already; share one hp_offload.Swapper among "
            "the layers (swapper=) for prefetch one layer ahead",
        )
    hp_offload.swap_wrapper(module, swapper)
    return module

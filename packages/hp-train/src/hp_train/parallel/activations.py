"""What each block keeps for its backward: ``TrainConfig.ac`` (activation checkpointing) and
``TrainConfig.swap`` (activations in host memory), through hp-offload's wrappers.

The wrappers replace a block's ``forward`` in place (its type, parameters and state dict stay
the same) before FSDP shards it: FSDP's hooks run around the wrapped forward, and the
recomputation in backward runs while FSDP holds the block's parameters unsharded for its
backward. Results are bit-equal to the unwrapped model's.
"""

from __future__ import annotations

from torch import nn

from hp_offload import FULL_RECOMPUTE, ActivationPolicy, BudgetPolicy, Swapper, checkpoint_wrapper
from hp_offload import swap_wrapper as _swap_block
from hp_train.config.schema import TrainConfig

__all__ = ["SELECTIVE", "SELECTIVE_SWAP", "SWAP_MIN_BYTES", "apply_activation_policy"]

#: Selective checkpointing: keep the outputs of matmuls and attention (most of the compute),
#: recompute the pointwise and normalization ops between them (most of the bytes).
SELECTIVE = ActivationPolicy(rules={"matmul": "save", "attention": "save"})
#: The same outputs, kept in host memory instead of on the device.
SELECTIVE_SWAP = ActivationPolicy(rules={"matmul": "swap", "attention": "swap"})
#: Activations smaller than this stay on the device when swapping (a copy costs more than it
#: frees; small enough that the test models' activations are swapped).
SWAP_MIN_BYTES = 1024


def apply_activation_policy(blocks: list[nn.Module], config: TrainConfig) -> Swapper | None:
    """Wrap every block as ``config.ac`` and ``config.swap`` say (nothing for ``ac="none"``
    without swap); the one :class:`hp_offload.Swapper` the blocks share, if any (prefetch runs
    one block ahead)."""
    swapper = Swapper(min_bytes=SWAP_MIN_BYTES) if config.swap else None
    budget = config.ac_budget_bytes
    for block in blocks:
        if budget is not None:
            checkpoint_wrapper(block, BudgetPolicy(budget))
        elif config.ac == "full":
            checkpoint_wrapper(block, FULL_RECOMPUTE)
        elif config.ac == "selective":
            policy = SELECTIVE_SWAP if swapper is not None else SELECTIVE
            checkpoint_wrapper(block, policy, swapper=swapper)
        elif swapper is not None:
            _swap_block(block, swapper)
    return swapper

"""``hyper_parallel.core.activation_checkpoint``: activation checkpointing and swapping
(hp-offload's)."""

from hp_offload import ActivationPolicy, BudgetPolicy, Swapper
from hyper_parallel.core.activation_checkpoint.activation_checkpoint import (
    checkpoint_wrapper,
    swap_wrapper,
)

__all__ = ["ActivationPolicy", "BudgetPolicy", "Swapper", "checkpoint_wrapper", "swap_wrapper"]

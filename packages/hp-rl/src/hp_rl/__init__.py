"""hp_rl: training and inference in one framework.

GRPO on hp-train's models and optimizers, with a built-in rollout engine (batched
autoregressive generation with a KV cache and seeded sampling, in a layout of its own) and a
weight sync from the training layout to the rollout layout that hp-layout plans as one
transfer plan per parameter (:func:`hp_layout.plan_transfer`).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

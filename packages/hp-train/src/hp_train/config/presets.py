"""The named models of the package: one table for the trainer (``hp-train --model``) and the
dry run (``hp-dryrun --model``).

Each preset is a :class:`~hp_train.config.schema.ModelConfig` with the batch shape it is usually run
or planned with (the dry run's defaults; the trainer has its own ``--seq-len`` and
``--global-batch``):

* ``tiny``: the default :class:`~hp_train.config.schema.ModelConfig` (what the tests train).
* ``small``: dim 128, 4 blocks, 4 heads, SwiGLU 352 (a CPU run that learns something).
* ``tiny-moe``: ``tiny`` with every second block a mixture of 4 experts (top-2, width 64).
* ``llama_8b``: a Llama-3-8B-like dense model (dim 4096, 32 layers, 32 heads, 8 KV heads,
  SwiGLU 14336, vocabulary 128256): 8,030,261,248 parameters.
* ``moe_505b``: the seed paper's scale, a DeepSeek-V3-like MoE with every block an MoE block:
  dim 7168, 61 layers, 128 heads of 56 with 16 KV heads, 256 routed experts of SwiGLU width
  1472, top-8, one shared expert of the same width, vocabulary 129280:
  **505,256,113,152 parameters** (:data:`MOE_505B_PARAMS`). The expert width 1472 (not
  DeepSeek's 2048, which gives 705B with this model's plain attention) is what brings the
  total to ~505B while keeping 256 experts.

The small presets' batch shape (8 sequences of 32 tokens) is the trainer's default, so the
dry run of a preset predicts what ``hp-train --model NAME`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig

__all__ = ["MODEL_PRESETS", "MOE_505B_PARAMS", "ModelPreset", "model_configs", "model_preset"]


@dataclass(frozen=True)
class ModelPreset:
    """A model with the batch shape it is usually planned with.

    Attributes:
        name: the preset's name.
        model: the model.
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step over all data-parallel ranks.
    """

    name: str
    model: ModelConfig
    seq_len: int
    global_batch: int


MOE_505B_PARAMS = 505_256_113_152
"""Exact parameter count of the ``moe_505b`` preset (checked against the meta model)."""

MODEL_PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset("tiny", ModelConfig(), seq_len=32, global_batch=8),
    "small": ModelPreset(
        "small",
        ModelConfig(dim=128, n_layers=4, n_heads=4, ffn_dim=352, max_seq_len=128),
        seq_len=32,
        global_batch=8,
    ),
    "tiny-moe": ModelPreset(
        "tiny-moe",
        ModelConfig(moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64, every=2)),
        seq_len=32,
        global_batch=8,
    ),
    "llama_8b": ModelPreset(
        "llama_8b",
        ModelConfig(
            vocab_size=128256,
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            ffn_dim=14336,
            max_seq_len=8192,
            rope_theta=500000.0,
        ),
        seq_len=8192,
        global_batch=256,
    ),
    "moe_505b": ModelPreset(
        "moe_505b",
        ModelConfig(
            vocab_size=129280,
            dim=7168,
            n_layers=61,
            n_heads=128,
            n_kv_heads=16,
            ffn_dim=18432,
            max_seq_len=4096,
            moe=MoEConfig(n_experts=256, top_k=8, expert_ffn_dim=1472, every=1, n_shared_experts=1),
        ),
        seq_len=4096,
        global_batch=1536,
    ),
}
"""Every named model, by name."""


def model_configs() -> dict[str, ModelConfig]:
    """``{name: model}`` of :data:`MODEL_PRESETS` (what ``hp-train --model`` chooses from)."""
    return {name: preset.model for name, preset in MODEL_PRESETS.items()}


def model_preset(name: str) -> ModelPreset:
    """The model preset called ``name``.

    Raises:
        ConfigError: no such preset (the message lists the known ones).
    """
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; known presets: {sorted(MODEL_PRESETS)}"
        ) from None

"""The ``config.json`` of a Hugging Face export: the source checkpoint's, as it was written,
where the run started from one; else what hp-train knows of the model and its tokenizer.

From a source (:class:`~hp_train.checkpoint.hf.carry.Carried` with a ``config``), every key
stays as the source wrote it (``max_position_embeddings``, the rotary settings, special token
ids, ``transformers_version``, anything else) except

* the weights' dtype, ``dtype`` (or ``torch_dtype``, whichever the source wrote; ``dtype``
  when it wrote neither): the export's;
* the keys of :data:`SHAPE_KEYS` whose value the trained model no longer has (a resized
  vocabulary): the model's;
* the special token ids, when the run trained with another tokenizer than the source's: the
  run tokenizer's (``pad_token_id``, which it does not name, is dropped).

Without a source, :func:`~hp_train.checkpoint.hf.hf_config.hf_config_dict` (whose
``max_position_embeddings`` is the model's ``max_seq_len``, the longest sequence its rotary
table holds) plus the run tokenizer's special token ids.
"""

from __future__ import annotations

from typing import Any

import torch

from hp_train.checkpoint.hf.carry import Carried
from hp_train.checkpoint.hf.hf_config import hf_config_dict
from hp_train.config.schema import ModelConfig

__all__ = ["DTYPE_KEYS", "SHAPE_KEYS", "SPECIAL_ID_KEYS", "export_config_dict"]

#: Keys of ``config.json`` that size the weights: the trained model's value where it differs.
SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
#: The keys transformers writes the weights' dtype under (5.x, then 4.x).
DTYPE_KEYS = ("dtype", "torch_dtype")
#: Special token ids that name a tokenizer's tokens.
SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_config_dict(
    model_config: ModelConfig, dtype: torch.dtype, carried: Carried | None
) -> dict[str, Any]:
    """The ``config.json`` of the export of a ``model_config`` model stored in ``dtype``, from
    a checkpoint that carried ``carried`` (None: a checkpoint that carried nothing).

    Postcondition: every key of the source's ``config.json`` is kept with its value except
    those the module docstring names; the result describes ``model_config``'s weights (the
    caller checks it with ``read_hf_config``).

    Raises:
        ConfigError: as :func:`~hp_train.checkpoint.hf.hf_config.hf_config_dict`.
    """
    ours = hf_config_dict(model_config, dtype)
    if carried is None:
        return ours
    if carried.config is None:
        return {**ours, **carried.special_token_ids}
    out = dict(carried.config)
    for key in SHAPE_KEYS:
        if key in out and out[key] != ours[key]:
            out[key] = ours[key]
    written = [key for key in DTYPE_KEYS if key in out] or [DTYPE_KEYS[0]]
    for key in written:
        out[key] = ours["dtype"]
    if not carried.tokenizer_from_source:
        for key in SPECIAL_ID_KEYS:
            out.pop(key, None)
        out.update(carried.special_token_ids)
    return out

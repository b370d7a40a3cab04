"""Hugging Face interoperability: Llama, Qwen2 and Qwen3 dense checkpoints in and out.

* :func:`read_hf_config`: a local checkpoint folder's ``config.json`` as a
  :class:`~hp_train.config.schema.ModelConfig`;
* :func:`load_hf_weights`: its safetensors weights into an hp-train model, laid out or not,
  each rank reading only its own pieces;
* :func:`export_hf`: an hp-train checkpoint as a folder ``transformers`` loads.

Nothing here imports ``transformers`` (a test dependency only) or reaches the Hub.
"""

from hp_train.checkpoint.hf.export import EXPORT_DTYPES, export_hf
from hp_train.checkpoint.hf.hf_config import (
    HF_ARCHITECTURES,
    MAX_SEQ_LEN_CAP,
    ROPE_TYPES,
    hf_config_dict,
    local_folder,
    read_hf_config,
)
from hp_train.checkpoint.hf.load import WeightsMismatchError, load_hf_weights
from hp_train.checkpoint.hf.names import expected_tensors, hf_name

__all__ = [
    "EXPORT_DTYPES",
    "HF_ARCHITECTURES",
    "MAX_SEQ_LEN_CAP",
    "ROPE_TYPES",
    "WeightsMismatchError",
    "expected_tensors",
    "export_hf",
    "hf_config_dict",
    "hf_name",
    "load_hf_weights",
    "local_folder",
    "read_hf_config",
]

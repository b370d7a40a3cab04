"""Hugging Face interoperability: Llama, Qwen2 and Qwen3 dense checkpoints and Qwen3-MoE and
Mixtral mixture-of-experts checkpoints, in and out.

* :func:`read_hf_config`: a local checkpoint folder's ``config.json`` as a
  :class:`~hp_train.config.schema.ModelConfig`;
* :func:`load_hf_weights`: its safetensors weights into an hp-train model, laid out or not,
  each rank reading only its own pieces;
* :func:`export_hf`: an hp-train checkpoint as a folder ``transformers`` loads, with the
  source's ``config.json`` fields and tokenizer where the run started from one;
* :func:`read_moe_config`, :func:`moe_family`: the MoE keys of a ``config.json`` and the
  architecture an hp-train MoE model exports as; :func:`tensor_sources`,
  :func:`expert_layout`: where each hp-train tensor lives in the files (whole, one tensor per
  expert, or rows of a fused tensor).

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
from hp_train.checkpoint.hf.moe_config import moe_family, read_moe_config
from hp_train.checkpoint.hf.names import expected_tensors, expert_layout, hf_name, tensor_sources

__all__ = [
    "EXPORT_DTYPES",
    "HF_ARCHITECTURES",
    "MAX_SEQ_LEN_CAP",
    "ROPE_TYPES",
    "WeightsMismatchError",
    "expected_tensors",
    "expert_layout",
    "export_hf",
    "hf_config_dict",
    "hf_name",
    "load_hf_weights",
    "local_folder",
    "moe_family",
    "read_hf_config",
    "read_moe_config",
    "tensor_sources",
]

"""An hp-train checkpoint written back as a Hugging Face folder ``transformers`` loads.

One process, no process group: ``torch.distributed.checkpoint`` reads the whole tensors of
the model (``model.<name>`` in a checkpoint of :func:`hp_train.checkpoint.dcp.save_checkpoint`,
whatever the layout it was saved with), which are renamed (:mod:`hp_train.checkpoint.hf.names`),
cast
and written as ``model.safetensors`` next to the ``config.json`` of
:func:`hp_train.checkpoint.hf.hf_config.hf_config_dict`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from hp_train.checkpoint.hf.hf_config import hf_config_dict
from hp_train.checkpoint.hf.load import check_tensors
from hp_train.checkpoint.hf.names import expected_tensors
from hp_train.checkpoint.hf.safetensors_index import SINGLE_FILE
from hp_train.config.schema import ConfigError, ModelConfig

__all__ = ["EXPORT_DTYPES", "export_hf"]

#: The dtypes a Hugging Face export may store.
EXPORT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_PREFIX = "model."


def _saved_model_tensors(path: Path) -> dict[str, TensorStorageMetadata]:
    if not (path / ".metadata").is_file():
        raise ConfigError(
            f"{path} is not an hp-train checkpoint step folder (it has no .metadata); pass "
            "one such as <out>/checkpoints/step_000100"
        )
    entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {
        key.removeprefix(_PREFIX): meta
        for key, meta in entries.items()
        if key.startswith(_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    model_config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the model of the checkpoint step folder ``checkpoint`` (a ``model_config``
    model) into the new folder ``out`` as ``config.json`` and ``model.safetensors``; return
    ``out``.

    Postcondition: ``transformers.AutoModelForCausalLM.from_pretrained(out)`` is the
    checkpoint's model (``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM``, as
    :func:`hp_train.checkpoint.hf.hf_config.hf_config_dict` chooses), its weights cast to ``dtype``.

    Raises:
        ConfigError: MoE layers or biases no architecture has; ``checkpoint`` is no step
            folder; ``dtype`` is not one of :data:`EXPORT_DTYPES`.
        WeightsMismatchError: the checkpoint's model tensors are not those of
            ``model_config`` (a missing, extra or differently shaped tensor is named).
        FileExistsError: ``out`` exists and is not empty.
    """
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype {dtype} is not one of {[str(d) for d in EXPORT_DTYPES]}")
    config_json = hf_config_dict(model_config, dtype)
    expected = expected_tensors(model_config)
    source = Path(checkpoint)
    saved = _saved_model_tensors(source)
    shapes = dict(expected.values())
    check_tensors(
        {k: tuple(v.size) for k, v in saved.items()},
        {own: (own, shape) for own, shape in shapes.items()},
        f"checkpoint {source}",
    )
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not an empty folder; choose a new one")
    model = {
        own: torch.empty(shape, dtype=saved[own].properties.dtype) for own, shape in shapes.items()
    }
    with warnings.catch_warnings():
        # One process by design: torch's note that it assumes so is no news.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load({"model": model}, storage_reader=FileSystemReader(str(source)), no_dist=True)
    tensors = {hf: model[own].to(dtype).contiguous() for hf, (own, _) in expected.items()}
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / SINGLE_FILE), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return target

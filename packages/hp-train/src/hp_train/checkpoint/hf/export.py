"""An hp-train checkpoint written back as a Hugging Face folder ``transformers`` loads.

One process, no process group: ``torch.distributed.checkpoint`` reads the whole tensors of
the model (``model.<name>`` in a checkpoint of :func:`hp_train.checkpoint.dcp.save_checkpoint`,
whatever the layout it was saved with), which are renamed (:mod:`hp_train.checkpoint.hf.names`),
cast and written as ``model.safetensors`` next to the ``config.json`` of
:func:`hp_train.checkpoint.hf.export_config.export_config_dict` (the source checkpoint's, for a
run started from one), the source's ``generation_config.json`` and the run's tokenizer
(:mod:`hp_train.checkpoint.hf.carry`: what the checkpoint carries).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from hp_train.checkpoint.hf.carry import Carried, read_carried
from hp_train.checkpoint.hf.export_config import export_config_dict
from hp_train.checkpoint.hf.hf_config import read_hf_config
from hp_train.checkpoint.hf.load import check_tensors
from hp_train.checkpoint.hf.names import tensor_sources
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


def _json_text(value: dict[str, Any]) -> str:
    return json.dumps(value, indent=2) + "\n"


def _checked_config(
    model_config: ModelConfig, dtype: torch.dtype, carried: Carried | None, where: Path
) -> dict[str, Any]:
    """The export's ``config.json``, read back as ``read_hf_config`` reads it: it must be
    ``model_config`` (a carried source config that no longer describes the weights is an
    error rather than a folder that loads the weights into another model)."""
    config = export_config_dict(model_config, dtype, carried)
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "config.json").write_text(_json_text(config))
        back = read_hf_config(scratch, max_seq_len=model_config.max_seq_len)
    if back != model_config:
        ours, theirs = model_config.to_dict(), back.to_dict()
        differ = {k: (theirs.get(k), v) for k, v in ours.items() if theirs.get(k) != v}
        raise ConfigError(
            f"the Hugging Face config.json {where} carries (from {carried and carried.source}) "
            f"does not describe the checkpoint's model: (its value, the model's) by field "
            f"{differ}"
        )
    return config


def _write_folder(
    target: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], carried: Carried | None
) -> None:
    target.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(target / SINGLE_FILE), metadata={"format": "pt"})
    (target / "config.json").write_text(_json_text(config))
    if carried is None:
        return
    if carried.generation_config is not None:
        (target / "generation_config.json").write_text(_json_text(carried.generation_config))
    for name, text in carried.tokenizer_files.items():
        (target / name).write_text(text, encoding="utf-8")


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    model_config: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the model of the checkpoint step folder ``checkpoint`` (a ``model_config``
    model) into the new folder ``out`` as ``config.json`` and ``model.safetensors``, with the
    tokenizer files and ``generation_config.json`` the checkpoint carries; return ``out``.

    Postconditions: ``transformers.AutoModelForCausalLM.from_pretrained(out)`` is the
    checkpoint's model (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
    ``Qwen3MoeForCausalLM`` or ``MixtralForCausalLM``, as
    :func:`hp_train.checkpoint.hf.hf_config.hf_config_dict` chooses), its weights cast to
    ``dtype``; its ``config.json`` is :func:`~hp_train.checkpoint.hf.export_config.
    export_config_dict`'s (the source's keys kept); ``AutoTokenizer.from_pretrained(out)`` is
    the run's tokenizer where the checkpoint carries it (:mod:`hp_train.checkpoint.hf.carry`;
    an older checkpoint carries none).

    Raises:
        ConfigError: MoE layers or biases no architecture has; ``checkpoint`` is no step
            folder; ``dtype`` is not one of :data:`EXPORT_DTYPES`; the carried source
            ``config.json`` does not describe ``model_config`` (the fields are named).
        WeightsMismatchError: the checkpoint's model tensors are not those of
            ``model_config`` (a missing, extra or differently shaped tensor is named).
        FileExistsError: ``out`` exists and is not empty.
    """
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f"dtype {dtype} is not one of {[str(d) for d in EXPORT_DTYPES]}")
    source = Path(checkpoint)
    saved = _saved_model_tensors(source)
    carried = read_carried(source)
    config_json = _checked_config(model_config, dtype, carried, source)
    sources = tensor_sources(model_config)
    shapes = {own: s.shape for own, s in sources.items()}
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
    # MoE expert stacks are cut into one tensor per expert, as save_pretrained writes them.
    tensors = {
        hf: piece.to(dtype).contiguous()
        for own, src in sources.items()
        for hf, piece in src.split(model[own]).items()
    }
    _write_folder(target, tensors, config_json, carried)
    return target

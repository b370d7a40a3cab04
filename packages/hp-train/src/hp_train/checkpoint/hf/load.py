"""Hugging Face weights into a (laid out) hp-train model, each rank reading its own pieces.

``model.state_dict()`` of a model laid out by :func:`hp_train.parallel.parallelize.parallelize`
holds
torch DTensors of the global shapes (hp-fsdp's state dict), each with this rank's local piece
and where it sits (``__create_chunk_list__``: offsets and sizes). Each rank reads from the
safetensors files only that box of each tensor its stage holds, then
``model.load_state_dict`` puts the pieces into the sharded parameters. A model on one device
(plain tensors) reads every tensor whole. An MoE block's expert stacks come from one stored
tensor per expert or from fused stacks (:mod:`hp_train.checkpoint.hf.moe_names`): a rank reads
the experts of its box only, and of a fused ``gate_up_proj`` the rows of ``w1`` and of ``w3``
apart, each cut to its box.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_train.checkpoint.hf.hf_config import local_folder
from hp_train.checkpoint.hf.names import expected_tensors, expert_layout, tensor_sources
from hp_train.checkpoint.hf.safetensors_index import SafetensorsCheckpoint
from hp_train.checkpoint.hf.tensor_source import Source
from hp_train.config.schema import ModelConfig

__all__ = ["WeightsMismatchError", "check_tensors", "load_hf_weights"]

# Buffers older checkpoints stored; hp-train recomputes them from the config.
_RECOMPUTED_SUFFIX = "rotary_emb.inv_freq"


class WeightsMismatchError(ValueError):
    """A checkpoint's tensors are not those of the model (the message names the tensor)."""


def check_tensors(
    found: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[str, tuple[int, ...]]],
    where: str,
) -> None:
    """Raise unless ``found`` (name -> shape) has exactly the ``expected`` tensors (name ->
    (model's name, shape)) with their shapes.

    Raises:
        WeightsMismatchError: a tensor missing, one extra, or a shape that differs (the first
            few are named).
    """
    missing = [name for name in expected if name not in found]
    if missing:
        raise WeightsMismatchError(
            f"{where} lacks {len(missing)} tensor(s) the model needs: {missing[:5]}"
        )
    extra = sorted(n for n in found if n not in expected and not n.endswith(_RECOMPUTED_SUFFIX))
    if extra:
        tied = (
            " (the config ties the embeddings: no lm_head.weight)"
            if ("lm_head.weight" in extra)
            else ""
        )
        raise WeightsMismatchError(
            f"{where} has {len(extra)} tensor(s) the model does not: {extra[:5]}{tied}"
        )
    for name, (own, shape) in expected.items():
        if found[name] != shape:
            raise WeightsMismatchError(
                f"tensor {name!r} of {where} has shape {found[name]}; the model's {own!r} "
                f"needs {shape} (does the config match the weights?)"
            )


def _model_config(model: nn.Module) -> ModelConfig:
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(
            "load_hf_weights takes an hp_train.model.llama.Transformer (a module with a "
            f"ModelConfig as .config), got {type(model).__name__}"
        )
    return config


def _read(source: Source, box: list[tuple[int, int]], files: SafetensorsCheckpoint) -> torch.Tensor:
    parts = [files.read(name, part) for name, part in source.reads(box)]
    return torch.stack(parts) if source.kind == "stacked" else parts[0]


def _fill(name: str, value: torch.Tensor, source: Source, files: SafetensorsCheckpoint) -> None:
    """Read this rank's piece of ``value`` (the model's tensor ``name``) from ``source``."""
    if isinstance(value, DTensor):
        local = value.to_local()
        chunks = value.__create_chunk_list__()
        if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
            raise RuntimeError(
                f"{name}: a DTensor whose local tensor {tuple(local.shape)} is not one box of "
                f"the global tensor ({chunks})"
            )
        box = [(o, o + s) for o, s in zip(chunks[0].offsets, chunks[0].sizes, strict=True)]
    else:
        local = value
        want = source.shape
        if tuple(local.shape) != want:
            raise WeightsMismatchError(
                f"{name} is a plain tensor of shape {tuple(local.shape)}, not the global "
                f"{want}: lay the model out with hp_train.parallel.parallelize.parallelize (whose "
                "state dict is global) or not at all"
            )
        box = [(0, s) for s in want]
    if local.is_meta:
        raise ValueError(
            f"{name} is on the meta device: allocate the model (to_empty) before loading"
        )
    if local.numel() == 0:
        return
    with torch.no_grad():
        local.copy_(_read(source, box, files))


def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Load the Hugging Face checkpoint folder ``path`` into ``model`` in place (collective
    over the ranks that hold it, when it is laid out).

    ``model`` is an :class:`~hp_train.model.llama.Transformer` of the config
    ``read_hf_config(path)`` gives: on one device, or laid out by
    :func:`hp_train.parallel.parallelize.parallelize` (TP, EP, then FSDP), possibly a pipeline
    stage holding some of the modules. Postcondition: every tensor
    the model (stage) holds equals the checkpoint's (cast to the model's dtype), and each rank
    has read from the files only the boxes of its own pieces.

    Raises:
        ConfigError: ``path`` is no local folder, or its safetensors files or index are
            missing or inconsistent.
        WeightsMismatchError: the checkpoint lacks a tensor of the whole model, has one more,
            or a shape differs from the config's (the tensor is named).
        TypeError: ``model`` is no hp-train Transformer.
    """
    config = _model_config(model)
    folder = local_folder(path)
    with SafetensorsCheckpoint(folder) as files:
        layout = expert_layout(config, files.shapes)
        # The whole model's tensors, whatever this stage holds: every rank checks the same
        # names and shapes, so all fail together before the collectives below.
        check_tensors(files.shapes, expected_tensors(config, layout), str(folder))
        sources = tensor_sources(config, layout)
        state = model.state_dict()
        for name, value in state.items():
            _fill(name, value, sources[name], files)
    model.load_state_dict(state)

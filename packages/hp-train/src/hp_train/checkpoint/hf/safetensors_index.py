"""The tensors of a Hugging Face safetensors checkpoint folder, read by slices.

A folder holds ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
(``weight_map``: tensor name -> file), as ``transformers``' ``save_pretrained`` writes them.
Opening reads only the files' headers; :meth:`SafetensorsCheckpoint.read` reads one box of
one tensor (safetensors maps the file and copies just the rows and columns asked for).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import safe_open

from hp_train.config.schema import ConfigError

__all__ = ["INDEX_FILE", "SINGLE_FILE", "SafetensorsCheckpoint"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> file name, from the single file's header or the shards' index."""
    if (folder / SINGLE_FILE).is_file():
        return {}
    index = folder / INDEX_FILE
    if not index.is_file():
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(
            p.name for p in folder.glob("*.pt*")
        )
        found = f"; it has {others}, which hp-train does not read (convert to safetensors)"
        raise ConfigError(
            f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{found if others else ''}"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ConfigError(f"{index} has no valid weight_map ({error!r})") from None
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{index}: weight_map must be an object of name -> file")
    return {str(k): str(v) for k, v in weight_map.items()}


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint folder: names, shapes, boxes of values.

    A context manager: the files stay open (mapped) until it exits.

    Attributes:
        folder: the folder.
        shapes: every tensor's shape, by name.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}
        self._file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        weight_map = _weight_map(folder)
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        try:
            for file in files:
                self._open(file, weight_map)
        except BaseException:
            self._stack.close()
            raise
        listed = sorted(set(weight_map) - set(self.shapes))
        if listed:
            raise ConfigError(
                f"{folder / INDEX_FILE} lists tensors its files do not hold: {listed[:5]}"
            )

    def _open(self, file: str, weight_map: dict[str, str]) -> None:
        path = self.folder / file
        if not path.is_file():
            raise ConfigError(f"{self.folder / INDEX_FILE} names {file}, which does not exist")
        handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
        self._handles[file] = handle
        for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
            if weight_map and weight_map.get(name) != file:
                raise ConfigError(
                    f"{path} holds tensor {name!r}, which {INDEX_FILE} places in "
                    f"{weight_map.get(name)!r}: the index and its shards disagree"
                )
            if name in self.shapes:
                raise ConfigError(f"tensor {name!r} is stored twice in {self.folder}")
            self._file_of[name] = file
            self.shapes[name] = tuple(handle.get_slice(name).get_shape())

    def read(self, name: str, box: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Elements ``[start, stop)`` along each dim of tensor ``name``, as stored (its
        dtype, a fresh tensor)."""
        piece = self._handles[self._file_of[name]].get_slice(name)
        if not box:
            return piece[...]  # type: ignore[no-any-return]
        out: torch.Tensor = piece[tuple(slice(a, b) for a, b in box)]
        return out

    def close(self) -> None:
        """Close the files."""
        self._stack.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

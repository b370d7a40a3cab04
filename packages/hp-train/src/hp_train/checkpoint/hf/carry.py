"""What each checkpoint carries for its Hugging Face export: the source checkpoint's
``config.json`` (a run started ``--init-from`` a folder) and the run's tokenizer.

A checkpoint's text files are flat (:func:`hp_train.checkpoint.dcp.save_checkpoint`), so they
are

* :data:`EXPORT_FILE` (``hf_export.json``): ``{"source": folder or null, "config": the source's
  config.json or null, "generation_config": the source's generation_config.json or null,
  "tokenizer": {"name": ..., "from_source": bool, "files": [names]}, "special_token_ids":
  {"eos_token_id": ..., "bos_token_id": ...}}``;
* :data:`TOKENIZER_PREFIX` + name for each file of the tokenizer folder
  (:func:`hp_train.data.tokenizer.hf_folder.tokenizer_files`).

:func:`checkpoint_files` writes them (the trainer passes them to every save);
:func:`read_carried` reads them back for the export.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hp_train.config.schema import ConfigError
from hp_train.data.tokenizer.base import TextTokenizer
from hp_train.data.tokenizer.hf import HFTokenizer
from hp_train.data.tokenizer.hf_folder import special_token_ids, tokenizer_files

__all__ = [
    "EXPORT_FILE",
    "TOKENIZER_PREFIX",
    "Carried",
    "checkpoint_files",
    "read_carried",
    "tokenizer_from_source",
]

#: The checkpoint file that says what the export writes besides the weights.
EXPORT_FILE = "hf_export.json"
#: The prefix of the checkpoint files that hold the run's tokenizer folder.
TOKENIZER_PREFIX = "hf_tokenizer."


@dataclass(frozen=True)
class Carried:
    """What a checkpoint carries for its Hugging Face export.

    Attributes:
        source: the Hugging Face folder the run started from (None: a run of its own).
        config: that folder's ``config.json`` as written (None without a source).
        generation_config: its ``generation_config.json`` where it had one and the run kept
            its tokenizer (else None: the ids in it would name another tokenizer's tokens).
        tokenizer_name: the run's tokenizer, as its log named it.
        tokenizer_from_source: the run's tokenizer is the source folder's.
        tokenizer_files: the run's tokenizer as a Hugging Face folder (name -> text).
        special_token_ids: ``eos_token_id`` (and ``bos_token_id``) of the run's tokenizer.
    """

    source: str | None
    config: dict[str, Any] | None
    generation_config: dict[str, Any] | None
    tokenizer_name: str
    tokenizer_from_source: bool
    tokenizer_files: dict[str, str]
    special_token_ids: dict[str, int]


def tokenizer_from_source(tokenizer: TextTokenizer, source: Path | None) -> bool:
    """Whether ``tokenizer`` was loaded from the folder ``source`` (a run's ``--init-from``)."""
    if source is None or not isinstance(tokenizer, HFTokenizer) or tokenizer.file is None:
        return False
    return tokenizer.file.resolve().parent == Path(source).resolve()


def _json_file(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return loaded


def checkpoint_files(init_from: Path | None, tokenizer: TextTokenizer) -> dict[str, str]:
    """The text files (name -> content) a run started from ``init_from`` (None: from scratch)
    with ``tokenizer`` writes into each checkpoint, for :func:`read_carried`.

    The files are read once per run (per ``tokenizer`` object): every checkpoint of the run
    carries the same ones, even if the source folder changes or goes away meanwhile.

    Postcondition: ``read_carried`` of a checkpoint holding them gives ``init_from``'s
    ``config.json`` (and ``generation_config.json`` when the tokenizer is its own) as they
    were, and ``tokenizer``'s folder files.

    Raises:
        ConfigError: ``init_from`` has no readable ``config.json``; a tokenizer file is not
            UTF-8 text.
    """
    key = (init_from, id(tokenizer))
    if key not in _READ:
        _READ.clear()  # one run at a time: the previous run's files are not needed again
        # The tokenizer is kept with its files, so that its id is not reused meanwhile.
        _READ[key] = (tokenizer, _read_files(init_from, tokenizer))
    return dict(_READ[key][1])


_READ: dict[tuple[Path | None, int], tuple[TextTokenizer, dict[str, str]]] = {}


def _read_files(init_from: Path | None, tokenizer: TextTokenizer) -> dict[str, str]:
    from_source = tokenizer_from_source(tokenizer, init_from)
    config = generation = None
    if init_from is not None:
        config = _json_file(Path(init_from) / "config.json")
        if config is None:
            raise ConfigError(f"{init_from} has no config.json to carry into the checkpoint")
        if from_source:
            generation = _json_file(Path(init_from) / "generation_config.json")
    files = tokenizer_files(tokenizer)
    record = {
        "source": None if init_from is None else str(Path(init_from).resolve()),
        "config": config,
        "generation_config": generation,
        "tokenizer": {"name": tokenizer.name, "from_source": from_source, "files": sorted(files)},
        "special_token_ids": special_token_ids(tokenizer),
    }
    out = {EXPORT_FILE: json.dumps(record, indent=1) + "\n"}
    out.update({TOKENIZER_PREFIX + name: text for name, text in files.items()})
    return out


def read_carried(step: Path) -> Carried | None:
    """What the checkpoint step folder ``step`` carries for the export; None for a checkpoint
    saved without it (before hp-train carried it, or by :func:`save_checkpoint` alone).

    Raises:
        ConfigError: :data:`EXPORT_FILE` is not what :func:`checkpoint_files` writes, or a
            tokenizer file it lists is missing.
    """
    record = _json_file(step / EXPORT_FILE)
    if record is None:
        return None
    where = step / EXPORT_FILE
    try:
        tokenizer = record["tokenizer"]
        names, ids = tokenizer["files"], record["special_token_ids"]
        carried = Carried(
            source=record["source"],
            config=record["config"],
            generation_config=record["generation_config"],
            tokenizer_name=str(tokenizer["name"]),
            tokenizer_from_source=bool(tokenizer["from_source"]),
            tokenizer_files={},
            special_token_ids={str(k): int(v) for k, v in ids.items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ConfigError(f"{where} is not an hp-train export record ({err!r})") from None
    for name in names:
        file = step / (TOKENIZER_PREFIX + name)
        if not file.is_file():
            raise ConfigError(f"{where} lists the tokenizer file {name} but {file} is missing")
        carried.tokenizer_files[name] = file.read_text(encoding="utf-8")
    return carried

"""What a checkpoint records of the run that wrote it, and which of it a resume may change.

Every checkpoint holds ``hp_train_config.json``: the run's resolved configuration as data,
``{"model": ModelConfig.to_dict(), "parallel": ..., "training": ...}`` (the dataclasses of
:mod:`hp_train.config.schema`), beside ``config.toml`` (the command-line options, for people and
``--config``). ``python -m hp_train.checkpoint.export`` reads the model's architecture from it, and
a
resume compares it with its own (:func:`resume_conflicts`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hp_train.config.schema import ModelConfig, ParallelConfig, TrainConfig

__all__ = ["RECORD_FILE", "RESUMABLE_FIELDS", "read_record", "resume_conflicts", "run_record"]

#: The run's configuration in every checkpoint (and the output folder).
RECORD_FILE = "hp_train_config.json"

#: Fields a resumed run may change, as ``table.field``: how long it runs, how often it logs,
#: evaluates and checkpoints, how many non-finite steps it may skip, and the data and
#: tensor-parallel sizes (checkpoints are resharded on load; the pipeline depth is checked by
#: the checkpoint itself, and the batch split follows from the global batch, which must not
#: change). Every other field shapes the model, the data order or the optimizer's trajectory
#: and must equal the checkpoint's.
RESUMABLE_FIELDS: frozenset[str] = frozenset(
    {
        "training.steps",
        "training.checkpoint_every",
        "training.snapshot_every",
        "training.log_every",
        "training.eval_every",
        "training.eval_batches",
        "training.divergence_threshold",
        "training.skip_nonfinite",
        "training.deterministic",
        "training.streaming",
        "parallel.dp_replicate",
        "parallel.dp_shard",
        "parallel.tp",
        # Compared by the checkpoint itself, which names the saved depth (load_checkpoint).
        "parallel.pp",
        "training.microbatches",
    }
)


#: Training fields that may name local files: recorded as absolute paths, so that a resume
#: from another working directory, or with a relative spelling, is the same run.
PATH_FIELDS = ("data", "tokenizer", "eval_data")


def _absolute(value: object) -> object:
    if isinstance(value, str) and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def run_record(
    model: ModelConfig, parallel: ParallelConfig, config: TrainConfig
) -> dict[str, dict[str, Any]]:
    """The record of a run (JSON-serializable); local paths of :data:`PATH_FIELDS` absolute
    (a built-in data name stays as it is)."""
    training = dataclasses.asdict(config)
    for name in PATH_FIELDS:
        training[name] = _absolute(training[name])
    return {
        "model": model.to_dict(),
        "parallel": dataclasses.asdict(parallel),
        "training": training,
    }


def read_record(folder: str | Path) -> dict[str, dict[str, Any]] | None:
    """The record in ``folder`` (a checkpoint), None where it has none (an older checkpoint)."""
    path = Path(folder) / RECORD_FILE
    if not path.is_file():
        return None
    loaded: dict[str, dict[str, Any]] = json.loads(path.read_text())
    return loaded


def _flat(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _field_defaults() -> dict[str, Any]:
    """``table.field`` to the default of every training and parallel field that has one."""
    defaults: dict[str, Any] = {}
    for table, schema in (("training", TrainConfig), ("parallel", ParallelConfig)):
        for field in dataclasses.fields(schema):
            if field.default is not dataclasses.MISSING:
                defaults[f"{table}.{field.name}"] = field.default
    return defaults


def resume_conflicts(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The fields that differ between a checkpoint's record and a resuming run's and that a
    resume cannot change (not in :data:`RESUMABLE_FIELDS`), each as ``"table.field: saved ->
    current"``, sorted; empty when the resume is compatible. A training or parallel field the
    saved record lacks (the checkpoint is older than the field) ran with the field's default:
    no conflict while the resuming run keeps that default."""
    before, now = _flat(saved), _flat(current)
    defaults = _field_defaults()
    conflicts = []
    for key in sorted(set(before) | set(now)):
        if key in RESUMABLE_FIELDS or before.get(key) == now.get(key):
            continue
        if key not in before and key in defaults and now.get(key) == defaults[key]:
            continue
        conflicts.append(f"{key}: {before.get(key)!r} -> {now.get(key)!r}")
    return conflicts

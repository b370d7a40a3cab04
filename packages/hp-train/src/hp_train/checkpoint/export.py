"""``python -m hp_train.checkpoint.export --checkpoint DIR --out HF_DIR``: the command line of
the one exporter, :func:`hp_train.checkpoint.hf.export_hf` (an hp-train checkpoint as a Hugging
Face folder, ``config.json`` + ``model.safetensors`` + the run's tokenizer, that
``transformers`` loads; the ``config.json`` of the source checkpoint, for a run started
``--init-from`` one).

``DIR`` is a checkpoint step folder (``<out>/checkpoints/step_000100``), whose
``hp_train_config.json`` holds the model (``{"model": ModelConfig.to_dict()}``); given the
checkpoints folder itself, its latest complete checkpoint is exported (and named). One
process, no process group; bad input exits with status 2 and says what is wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from hp_train.checkpoint.dcp import latest_checkpoint
from hp_train.checkpoint.hf import EXPORT_DTYPES, WeightsMismatchError, export_hf
from hp_train.checkpoint.hf.carry import read_carried
from hp_train.config.schema import ConfigError, ModelConfig

__all__ = ["CONFIG_NAME", "DTYPES", "carried_lines", "main", "model_config_of", "step_folder"]

#: The file of a checkpoint step folder that holds its run's model configuration.
CONFIG_NAME = "hp_train_config.json"

#: ``--dtype`` choices: the exporter's own dtypes, by name.
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in EXPORT_DTYPES}


def step_folder(path: Path) -> tuple[Path, bool]:
    """The checkpoint step folder ``path`` names: itself, or the latest complete checkpoint
    of the checkpoints folder ``path`` (then the flag is True).

    Raises:
        ConfigError: ``path`` is neither.
    """
    if (path / ".metadata").is_file():
        return path, False
    found = latest_checkpoint(path)
    if found is None:
        raise ConfigError(
            f"{path} is neither a checkpoint step folder (with .metadata) nor a folder of "
            "complete checkpoints (step_NNNNNN/); pass e.g. <out>/checkpoints/step_000100"
        )
    return found[1], True


def model_config_of(step: Path) -> ModelConfig:
    """The model configuration a checkpoint step folder was saved with.

    Raises:
        ConfigError: the folder has no readable :data:`CONFIG_NAME` with a ``"model"`` object,
            or that object is no valid :class:`~hp_train.config.schema.ModelConfig`.
    """
    file = step / CONFIG_NAME
    if not file.is_file():
        raise ConfigError(
            f"{file} not found: the export reads the model's configuration from it (hp-train "
            "writes it into each checkpoint; one saved without it cannot be exported)"
        )
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise ConfigError(f'{file} must be a JSON object with a "model" object')
    return ModelConfig.from_dict(raw["model"])


def carried_lines(step: Path) -> list[str]:
    """What the export of the checkpoint step folder ``step`` writes besides the weights, one
    line each: where ``config.json`` comes from and which tokenizer it holds (or that the
    checkpoint carries none).

    Raises:
        ConfigError: as :func:`hp_train.checkpoint.hf.carry.read_carried`.
    """
    carried = read_carried(step)
    if carried is None:
        return [
            "config.json from the model's configuration alone, and no tokenizer: the "
            "checkpoint carries neither (saved before hp-train wrote them into checkpoints)"
        ]
    origin = " (from --init-from)" if carried.tokenizer_from_source else ""
    if carried.config is None:
        config = "config.json: the model's configuration and its tokenizer's special token ids"
    else:
        config = f"config.json: {carried.source}'s keys, with the export's dtype" + (
            "" if origin else " and the special token ids of the run's tokenizer"
        )
    return [config, f"tokenizer: {carried.tokenizer_name}"]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m hp_train.checkpoint.export",
        description="Write an hp-train checkpoint as a Hugging Face folder (config.json + "
        "model.safetensors) that transformers' from_pretrained loads.",
    )
    ap.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="a checkpoint step folder, or a checkpoints folder (its latest is taken)",
    )
    ap.add_argument("--out", type=Path, required=True, help="the new Hugging Face folder")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="stored dtype")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Run the export; 0 on success, 2 (with a message on stderr) on bad input."""
    args = _parser().parse_args(argv)
    try:
        step, latest = step_folder(args.checkpoint)
        if latest:
            print(f"hp_train.checkpoint.export: taking the latest complete checkpoint {step}")
        out = export_hf(step, args.out, model_config_of(step), dtype=DTYPES[args.dtype])
        lines = carried_lines(step)
    except (ConfigError, WeightsMismatchError, FileExistsError) as error:
        print(f"hp_train.checkpoint.export: error: {error}", file=sys.stderr)
        return 2
    print(f"hp_train.checkpoint.export: wrote {out} from {step}")
    for line in lines:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

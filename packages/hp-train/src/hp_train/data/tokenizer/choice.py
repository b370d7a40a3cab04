"""Which tokenizer a run uses: ``--tokenizer PATH``, ``--tokenizer bytes``, or, for a run
``--init-from`` a Hugging Face folder that holds one, that folder's; bytes otherwise.

The setting (``TrainConfig.tokenizer``) is resolved once, on the command line
(:func:`resolve_tokenizer`), so that the run's record and ``config.toml`` name the tokenizer it
trained with; :func:`run_tokenizer` loads it.
"""

from __future__ import annotations

from pathlib import Path

from hp_train.config.schema import ConfigError
from hp_train.data.tokenizer.base import ByteTokenizer, TextTokenizer
from hp_train.data.tokenizer.hf import load_tokenizer

__all__ = [
    "BYTES",
    "FROM_INIT",
    "check_init_vocabulary",
    "resolve_tokenizer",
    "run_tokenizer",
]

#: The ``--tokenizer`` value that asks for UTF-8 bytes (the default without ``--init-from``).
BYTES = "bytes"
#: What a tokenizer taken from the ``--init-from`` folder says after its folder in its name
#: (and so in the run's log).
FROM_INIT = "(from --init-from)"

# Files of a Hugging Face tokenizer that hp-train cannot read without a tokenizer.json.
_OTHER_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def resolve_tokenizer(tokenizer: str | None, init_from: Path | None) -> str | None:
    """The run's tokenizer setting from ``--tokenizer`` (None: not given) and ``--init-from``:
    the given one (:data:`BYTES` included); else ``init_from`` where it holds a
    ``tokenizer.json``; else None (bytes).

    Raises:
        ConfigError: ``init_from`` holds a tokenizer but no ``tokenizer.json`` (a SentencePiece
            model or a slow tokenizer's vocabulary alone), which hp-train cannot read: the
            run would train on bytes against the model's vocabulary.
    """
    if tokenizer is not None or init_from is None:
        return tokenizer
    folder = Path(init_from)
    if (folder / "tokenizer.json").is_file():
        return str(folder)
    other = [name for name in _OTHER_TOKENIZER_FILES if (folder / name).is_file()]
    if other:
        raise ConfigError(
            f"{folder} holds a tokenizer ({', '.join(other)}) but no tokenizer.json, the one "
            "kind hp-train reads: save it as a fast tokenizer (AutoTokenizer.from_pretrained("
            "DIR).save_pretrained(DIR) writes tokenizer.json) or pass --tokenizer bytes to "
            "train on UTF-8 bytes"
        )
    return None


def run_tokenizer(setting: str | None, init_from: Path | None = None) -> TextTokenizer:
    """The tokenizer of the setting ``setting`` (None or :data:`BYTES`: bytes); one loaded
    from the folder ``init_from`` has :data:`FROM_INIT` after the folder in its name.

    Raises:
        ConfigError: as :func:`~hp_train.data.tokenizer.load_tokenizer`.
    """
    if setting is None or setting == BYTES:
        return ByteTokenizer()
    tokenizer = load_tokenizer(setting)
    given = Path(setting).expanduser().resolve()
    if init_from is not None and given == Path(init_from).expanduser().resolve():
        tokenizer.name = f"{init_from} {FROM_INIT}"
    return tokenizer


def check_init_vocabulary(tokenizer: TextTokenizer, vocab_size: int, init_from: Path) -> None:
    """Raise unless the checkpoint ``init_from``'s embedding (``vocab_size`` rows) has a row
    for every id of ``tokenizer``.

    Raises:
        ConfigError: naming both sizes.
    """
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but the "
            f"--init-from checkpoint {init_from} has vocab_size {vocab_size} (its embedding has "
            f"no row for ids >= {vocab_size}): pass a tokenizer of at most {vocab_size} tokens, "
            f"or --tokenizer {BYTES}"
        )

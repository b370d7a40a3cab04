"""Tokenizers of Hugging Face ``tokenizers``, loaded from a local ``tokenizer.json``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from hp_train.config.schema import ConfigError

__all__ = ["EOS_NAMES", "HFTokenizer", "load_tokenizer"]

#: Special tokens taken as the end of sequence when no configuration names one, the first
#: present in this order.
EOS_NAMES: tuple[str, ...] = (
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "<|eos|>",
    "[EOS]",
)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` as a :class:`~hp_train.data.tokenizer.TextTokenizer`.

    Text is always text: a special token's spelling inside a document is encoded as the
    characters it is made of, so the end of sequence comes only from the packing of
    documents; no special token is added, nothing is truncated or padded.

    Attributes:
        name: where it was loaded from.
        vocab_size: one more than the largest id (added tokens included).
        eos_id: the id of ``eos_token``.
        eos_token: the end-of-sequence token.
        bos_id: the id of the beginning-of-sequence token its configuration names (never
            written into the data; carried into a Hugging Face export's ``config.json``), or
            None where it names none (or one the vocabulary lacks).
        bos_token: that token (None with ``bos_id``).
        file: the ``tokenizer.json`` it was loaded from (None: built in memory).
        folder: the folder it was loaded from, whose other tokenizer files (its
            ``tokenizer_config.json``, ...) belong to it; None when a bare file was given.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token: str,
        name: str,
        *,
        bos_token: str | None = None,
        file: Path | None = None,
        folder: Path | None = None,
    ) -> None:
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ConfigError(
                f"the tokenizer {name} has no token {eos_token!r} to end sequences with; name "
                "one of its tokens as eos_token in tokenizer_config.json"
            )
        tokenizer.no_truncation()
        tokenizer.no_padding()
        tokenizer.encode_special_tokens = True
        self._tokenizer = tokenizer
        self.name = name
        self.eos_token = eos_token
        self.eos_id = eos_id
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        bos_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        self.bos_id: int | None = bos_id
        self.bos_token = None if bos_id is None else bos_token
        self.file = file
        self.folder = folder

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens written out."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos={self.eos_token!r})"


def _configured_token(folder: Path, key: str = "eos_token") -> str | None:
    """The token ``key`` (``eos_token``, ``bos_token``) of ``tokenizer_config.json`` or
    ``special_tokens_map.json``."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not JSON: {err}") from None
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


def _special_eos(tokenizer: Tokenizer) -> str | None:
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    return next((name for name in EOS_NAMES if name in special), None)


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of a ``tokenizer.json`` file, or of a folder holding one (what
    ``save_pretrained`` or :func:`~hp_train.data.tokenizer.train_bpe` writes).

    The end of sequence is the ``eos_token`` of ``tokenizer_config.json`` (or
    ``special_tokens_map.json``) beside it, else the first special token named in
    :data:`EOS_NAMES`; the beginning of sequence (:attr:`HFTokenizer.bos_id`) is its
    ``bos_token``, if any.

    Raises:
        ConfigError: ``path`` is not local (a hub name: nothing is downloaded), holds no
            ``tokenizer.json``, is not one, or names no end-of-sequence token.
    """
    given = Path(path).expanduser()
    if not given.exists():
        raise ConfigError(
            f"tokenizer {str(path)!r} is not a local file or folder; nothing is downloaded here "
            "(no hub access at run time): save it locally (AutoTokenizer.from_pretrained(NAME)"
            ".save_pretrained(DIR) on a machine with access, or python -m hp_train.data.tokenizer "
            "train) and pass DIR"
        )
    file = given / "tokenizer.json" if given.is_dir() else given
    if not file.is_file():
        present = sorted(p.name for p in given.iterdir())[:10]
        raise ConfigError(
            f"the tokenizer folder {str(given)!r} holds no tokenizer.json (it holds {present}); "
            "pass a folder written by save_pretrained of a fast tokenizer or by "
            "python -m hp_train.data.tokenizer train"
        )
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises its own Exception for a bad file
        raise ConfigError(f"{file} is not a tokenizers tokenizer.json: {err}") from None
    eos = _configured_token(file.parent) or _special_eos(tokenizer)
    if eos is None:
        special = sorted(
            t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special
        )
        raise ConfigError(
            f"the tokenizer {file} names no end-of-sequence token: write "
            '{"eos_token": "<token>"} into tokenizer_config.json beside it, naming one of its '
            f"tokens (special tokens present: {special}; recognised names: {list(EOS_NAMES)})"
        )
    return HFTokenizer(
        tokenizer,
        eos,
        str(given),
        bos_token=_configured_token(file.parent, "bos_token"),
        file=file,
        folder=given if given.is_dir() else None,
    )

"""A run's tokenizer as the text files of a folder that ``transformers.AutoTokenizer`` loads.

* :class:`~hp_train.data.tokenizer.HFTokenizer` loaded from a folder: that folder's tokenizer
  files (:data:`TOKENIZER_FILES`), copied as they are, with a ``tokenizer_config.json`` written
  when the folder has none; loaded from a bare ``tokenizer.json``: that file and such a
  configuration;
* :class:`~hp_train.data.tokenizer.ByteTokenizer`: a ``tokenizers`` model whose ids are the
  UTF-8 bytes (:func:`byte_tokenizer_files`).

Only text files travel (a checkpoint carries them as text): a SentencePiece
``tokenizer.model`` is left out, which loses nothing where ``tokenizer.json`` is present
(``AutoTokenizer`` builds the fast tokenizer from it).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models

from hp_train.config.schema import ConfigError
from hp_train.data.tokenizer.base import BYTE_EOS_ID, ByteTokenizer, TextTokenizer
from hp_train.data.tokenizer.hf import HFTokenizer

__all__ = [
    "BYTE_EOS_TOKEN",
    "TOKENIZER_FILES",
    "byte_tokenizer_files",
    "folder_tokenizer_files",
    "special_token_ids",
    "tokenizer_files",
]

#: The text files of a Hugging Face tokenizer folder (as ``save_pretrained`` and
#: :func:`~hp_train.data.tokenizer.train_bpe` write them) that travel with it.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

#: The end-of-sequence token of the byte tokenizer's folder: the NUL character, whose one
#: UTF-8 byte is :data:`~hp_train.data.tokenizer.BYTE_EOS_ID`, so that a NUL in a text
#: encodes to the same id as a special token and as a byte.
BYTE_EOS_TOKEN = "\x00"


def _config_json(eos_token: str, bos_token: str | None = None) -> str:
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "model_max_length": 1 << 30,
        # The ids must decode to the text exactly, as hp-train's own decode does.
        "clean_up_tokenization_spaces": False,
    }
    if bos_token is not None:
        config["bos_token"] = bos_token
    return json.dumps(config, indent=2) + "\n"


def byte_tokenizer_files() -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of :class:`ByteTokenizer` as a
    Hugging Face tokenizer.

    Postcondition: ``AutoTokenizer.from_pretrained`` of a folder holding them (and
    :func:`~hp_train.data.tokenizer.load_tokenizer`) encodes every text to its UTF-8 bytes,
    with or without special tokens added (none are), decodes the bytes back to the text, and
    has end of sequence id :data:`~hp_train.data.tokenizer.BYTE_EOS_ID`, vocabulary 256.
    """
    # Byte fallback: no character but NUL is in the vocabulary, so each is written as the
    # <0xNN> tokens of its UTF-8 bytes, id NN; NUL is a token of its own with the id of its
    # byte, the end of sequence.
    vocab = {f"<0x{byte:02X}>": byte for byte in range(256)}
    del vocab[f"<0x{BYTE_EOS_ID:02X}>"]
    vocab[BYTE_EOS_TOKEN] = BYTE_EOS_ID
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.ByteFallback()
    tokenizer.add_special_tokens([AddedToken(BYTE_EOS_TOKEN, special=True, normalized=False)])
    return {
        "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        "tokenizer_config.json": _config_json(BYTE_EOS_TOKEN),
    }


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"the tokenizer file {path} is not UTF-8 text: {err}") from None


def folder_tokenizer_files(tokenizer: HFTokenizer) -> dict[str, str]:
    """The tokenizer files of the folder ``tokenizer`` was loaded from (name -> text), with a
    ``tokenizer_config.json`` naming its end (and beginning) of sequence where it has none.

    Raises:
        ConfigError: ``tokenizer`` was not loaded from a file, or one of its files is no
            longer UTF-8 text.
    """
    if tokenizer.file is None:
        raise ConfigError(
            f"the tokenizer {tokenizer.name} was not loaded from a tokenizer.json, so it has no "
            "files to write; load it with hp_train.data.tokenizer.load_tokenizer"
        )
    if tokenizer.folder is None:
        files = {"tokenizer.json": _read_text(tokenizer.file)}
    else:
        files = {
            name: _read_text(tokenizer.folder / name)
            for name in TOKENIZER_FILES
            if (tokenizer.folder / name).is_file()
        }
    if "tokenizer_config.json" not in files:
        files["tokenizer_config.json"] = _config_json(tokenizer.eos_token, tokenizer.bos_token)
    return files


def tokenizer_files(tokenizer: TextTokenizer) -> dict[str, str]:
    """The files (name -> text) of a folder ``AutoTokenizer.from_pretrained`` loads as
    ``tokenizer``: :func:`byte_tokenizer_files` or :func:`folder_tokenizer_files`.

    Raises:
        ConfigError: as :func:`folder_tokenizer_files`.
        TypeError: another kind of tokenizer (hp-train makes only these two).
    """
    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer_files()
    if isinstance(tokenizer, HFTokenizer):
        return folder_tokenizer_files(tokenizer)
    raise TypeError(
        f"cannot write {tokenizer!r} as a Hugging Face tokenizer folder: hp-train writes "
        "ByteTokenizer and HFTokenizer"
    )


def special_token_ids(tokenizer: TextTokenizer) -> dict[str, int]:
    """``eos_token_id``, and ``bos_token_id`` where ``tokenizer`` names one, as a Hugging Face
    ``config.json`` holds them."""
    ids = {"eos_token_id": tokenizer.eos_id}
    if isinstance(tokenizer, HFTokenizer) and tokenizer.bos_id is not None:
        ids["bos_token_id"] = tokenizer.bos_id
    return ids

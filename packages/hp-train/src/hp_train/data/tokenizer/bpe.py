"""Training a byte-level BPE tokenizer on local text with Hugging Face ``tokenizers``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hp_train.config.schema import ConfigError

__all__ = ["EOS_TOKEN", "MIN_VOCAB_SIZE", "train_bpe"]

#: The end-of-sequence token of the tokenizers :func:`train_bpe` writes (id 0).
EOS_TOKEN = "<|endoftext|>"
#: The 256 bytes and the end of sequence.
MIN_VOCAB_SIZE = 257


class _Counted:
    def __init__(self, documents: Iterable[str]) -> None:
        self._documents = documents
        self.count = 0

    def __iter__(self) -> Iterator[str]:
        for text in self._documents:
            self.count += 1
            yield text


def train_bpe(documents: Iterable[str], vocab_size: int, out: str | Path) -> Path:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens on ``documents`` and write it to
    the folder ``out``.

    The tokenizer is GPT-2's kind: text split at its pre-tokenizer's word boundaries, every
    byte a base token (any text encodes, and decodes back to itself), then ``vocab_size - 257``
    merges; ``<|endoftext|>`` (:data:`EOS_TOKEN`) is id 0. ``out`` receives ``tokenizer.json``,
    ``tokenizer_config.json`` and ``special_tokens_map.json``: :func:`load_tokenizer` and
    ``transformers``' ``PreTrainedTokenizerFast`` / ``AutoTokenizer.from_pretrained(out)`` load
    it. Training is deterministic: the same documents give the same files.

    Returns:
        ``out``.

    Raises:
        ConfigError: ``vocab_size`` below :data:`MIN_VOCAB_SIZE`; no documents; text with
            too few distinct pairs to merge into ``vocab_size`` tokens.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ConfigError(f"vocab_size must be an integer, got {vocab_size!r}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: its 256 byte tokens "
            f"and the end-of-sequence token need vocab_size >= {MIN_VOCAB_SIZE}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    counted = _Counted(documents)
    tokenizer.train_from_iterator(counted, trainer)
    if counted.count == 0:
        raise ConfigError("no documents to train a tokenizer on")
    got = tokenizer.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ConfigError(
            f"the {counted.count} documents hold pairs for only {got} tokens, fewer than "
            f"vocab_size={vocab_size}: ask for vocab_size <= {got} or train on more text"
        )
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "model_max_length": 1 << 30,
        # Byte-level BPE decodes spaces exactly; a clean-up would change the text.
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN}, indent=2) + "\n"
    )
    return folder

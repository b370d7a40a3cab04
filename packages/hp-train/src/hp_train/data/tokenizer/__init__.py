"""Tokenizers of hp-train: byte-level by default, or Hugging Face ``tokenizers`` loaded from a
local ``tokenizer.json`` (:func:`load_tokenizer`) or trained here (:func:`train_bpe`;
``python -m hp_train.data.tokenizer train --data PATH --vocab-size N --out DIR``).
"""

from hp_train.data.tokenizer.base import BYTE_EOS_ID, ByteTokenizer, TextTokenizer
from hp_train.data.tokenizer.bpe import EOS_TOKEN, MIN_VOCAB_SIZE, train_bpe
from hp_train.data.tokenizer.hf import EOS_NAMES, HFTokenizer, load_tokenizer

__all__ = [
    "BYTE_EOS_ID",
    "EOS_NAMES",
    "EOS_TOKEN",
    "MIN_VOCAB_SIZE",
    "ByteTokenizer",
    "HFTokenizer",
    "TextTokenizer",
    "load_tokenizer",
    "train_bpe",
]

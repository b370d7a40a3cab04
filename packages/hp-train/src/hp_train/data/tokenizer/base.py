"""What hp-train asks of a tokenizer, and the byte-level one it uses when given none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["BYTE_EOS_ID", "ByteTokenizer", "TextTokenizer"]

#: The end-of-sequence id of :class:`ByteTokenizer`: the NUL byte, which text does not hold.
BYTE_EOS_ID = 0


@runtime_checkable
class TextTokenizer(Protocol):
    """Text to token ids and back.

    Attributes:
        name: what the tokenizer is, for logs (a path or ``"bytes"``).
        vocab_size: every id :meth:`encode` returns, and :attr:`eos_id`, is below it.
        eos_id: the id written after every document.
    """

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without any special token added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens written out)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, end of sequence the NUL byte (id 0).

    A NUL inside a document is encoded as itself, which is also the end-of-sequence id: text
    holds none, and the separator of the byte corpus has always been one.
    """

    name = "bytes"
    vocab_size = 256
    eos_id = BYTE_EOS_ID

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of the bytes ``ids``; a sequence that is not UTF-8 (a model's sample cut
        in the middle of a character) decodes to U+FFFD in its place.

        Raises:
            ValueError: an id is not a byte (outside 0..255).
        """
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"byte token ids are 0..255, got {bad[:5]}")
        return bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"

"""Documents to training windows: token rows, the stream of epochs with its cursor, and the
blocks of shuffled windows.

The training stream is epoch 0, then epoch 1, and so on. An epoch is every kept document
(training, not empty) once, each followed by the end-of-sequence id, in this order: the kept
documents in natural order are cut into groups of ``group_size``, and each group's documents
are permuted by (seed, epoch, group). No token is dropped: the end of one epoch runs on into
the next.

Window ``i`` is the stream's tokens ``[i * seq_len, (i + 1) * seq_len + 1)``: neighbouring
windows share one token, so each pair of neighbouring tokens of the stream is the
(input, target) pair of exactly one window. Windows are served in blocks of ``block``: block
``b`` holds windows ``[b * block, (b + 1) * block)`` in the order of a permutation drawn from
(seed, b), so served window ``j`` is the ``j % block``-th of block ``j // block``.

Grouping and blocks bound what is held (one group of documents, two blocks of windows) and
what a resumed run reads again (from the start of one group), whatever the size of the input.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hp_train.config.schema import ConfigError
from hp_train.data import order
from hp_train.data.documents import DocumentReader, Documents
from hp_train.data.tokenizer import ByteTokenizer, TextTokenizer

__all__ = [
    "Cursor",
    "EvalTokens",
    "LazyRows",
    "MemoryRows",
    "TokenReader",
    "TokenRows",
    "TokenStream",
    "WindowBlocks",
    "eval_tokens",
    "token_array",
]


def token_array(tokenizer: TextTokenizer, text: str) -> np.ndarray:
    """``tokenizer.encode(text)`` as an int32 array."""
    if isinstance(tokenizer, ByteTokenizer):
        # The same ids as encode(), without a Python int per byte.
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    return np.asarray(tokenizer.encode(text), dtype=np.int32)


class TokenReader(Protocol):
    """``(row, tokens)`` of a source's documents in order (tokens without end of sequence)."""

    def __next__(self) -> tuple[int, np.ndarray]:
        """The next document's row and int32 tokens; StopIteration after the last."""
        ...

    def marker(self) -> dict[str, Any]:
        """Where the reader stands (JSON): :meth:`TokenRows.open` with it goes on from here."""
        ...


class TokenRows(ABC):
    """Tokenized documents that can be read from any marker."""

    name: str

    @abstractmethod
    def open(self, marker: Mapping[str, Any] | None = None) -> TokenReader:
        """A reader from ``marker`` (None: the first row)."""


class _MemoryReader:
    def __init__(self, rows: MemoryRows, row: int) -> None:
        self._rows = rows
        self._row = row

    def __next__(self) -> tuple[int, np.ndarray]:
        if self._row >= self._rows.count:
            raise StopIteration
        self._row += 1
        return self._row - 1, self._rows.row(self._row - 1)

    def marker(self) -> dict[str, Any]:
        return {"row": self._row}


class MemoryRows(TokenRows):
    """Every document's tokens in one int32 array (inputs not streamed)."""

    def __init__(self, name: str, arrays: Sequence[np.ndarray]) -> None:
        self.name = name
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        self._offsets = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)])
        self._tokens = (
            np.concatenate(arrays).astype(np.int32, copy=False) if arrays else np.zeros(0, np.int32)
        )

    @staticmethod
    def from_documents(documents: Documents, tokenizer: TextTokenizer) -> MemoryRows:
        """Tokenize every document of ``documents`` (read once, from the first row)."""
        reader = documents.open()
        arrays = []
        while True:
            try:
                _, text = next(reader)
            except StopIteration:
                break
            arrays.append(token_array(tokenizer, text))
        return MemoryRows(documents.name, arrays)

    @property
    def count(self) -> int:
        """Rows (documents, empty ones included)."""
        return int(self._offsets.size - 1)

    def row(self, index: int) -> np.ndarray:
        """The tokens of row ``index``."""
        return self._tokens[self._offsets[index] : self._offsets[index + 1]]

    def open(self, marker: Mapping[str, Any] | None = None) -> TokenReader:
        row = 0 if marker is None else marker.get("row")
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row <= self.count:
            raise ConfigError(f"a document position in {self.name} needs a row in 0..{self.count}")
        return _MemoryReader(self, row)

    def totals(self, keep: Callable[[int], bool]) -> tuple[int, int]:
        """``(documents, tokens)`` of the non-empty rows ``keep`` accepts, an end of sequence
        counted after each."""
        documents = tokens = 0
        for index in range(self.count):
            size = int(self._offsets[index + 1] - self._offsets[index])
            if size and keep(index):
                documents += 1
                tokens += size + 1
        return documents, tokens


class _LazyReader:
    def __init__(self, reader: DocumentReader, tokenizer: TextTokenizer) -> None:
        self._reader = reader
        self._tokenizer = tokenizer

    def __next__(self) -> tuple[int, np.ndarray]:
        row, text = next(self._reader)
        return row, token_array(self._tokenizer, text)

    def marker(self) -> dict[str, Any]:
        return self._reader.marker()


class LazyRows(TokenRows):
    """Documents tokenized as they are read (streamed inputs)."""

    def __init__(self, documents: Documents, tokenizer: TextTokenizer) -> None:
        self.name = documents.name
        self._documents = documents
        self._tokenizer = tokenizer

    def open(self, marker: Mapping[str, Any] | None = None) -> TokenReader:
        return _LazyReader(self._documents.open(marker), self._tokenizer)


_CURSOR_FIELDS = ("token", "epoch", "group", "offset")


@dataclass(frozen=True)
class Cursor:
    """A place in the training stream.

    Attributes:
        token: tokens of the stream before it.
        epoch: the epoch it is in.
        group: the document group of that epoch it is in.
        offset: tokens of that group before it (less than the group's length).
        rows: the marker of the group's first row in the token rows.
    """

    token: int
    epoch: int
    group: int
    offset: int
    rows: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """The cursor as JSON-serializable values."""
        return {**{k: getattr(self, k) for k in _CURSOR_FIELDS}, "rows": self.rows}

    @staticmethod
    def from_json(value: object) -> Cursor:
        """The cursor :meth:`to_json` wrote.

        Raises:
            ConfigError: ``value`` is not one.
        """
        if isinstance(value, Mapping):
            rows = value.get("rows")
            numbers = [value.get(k) for k in _CURSOR_FIELDS]
            valid = [n for n in numbers if isinstance(n, int) and not isinstance(n, bool)]
            if isinstance(rows, Mapping) and len(valid) == len(numbers) and min(valid) >= 0:
                token, epoch, group, offset = valid
                return Cursor(token, epoch, group, offset, dict(rows))
        raise ConfigError(f"not a data position (a cursor of {_CURSOR_FIELDS} and rows): {value!r}")


class TokenStream:
    """The training stream read in order (see the module docstring), from its start or from a
    :class:`Cursor`.

    ``check_epoch(documents, tokens)`` is called whenever an epoch was read from its start to
    its end (to stop early on too little data).

    Attributes:
        epoch_tokens: tokens of one epoch, once an epoch was read from its start to its end
            (None before).
        epoch_documents: documents of one epoch, known with ``epoch_tokens``.
        rows_read: rows taken from the token rows so far (what resuming saves).
        start: the cursor of the stream's first token.
    """

    def __init__(
        self,
        rows: TokenRows,
        keep: Callable[[int], bool],
        *,
        seed: int,
        group_size: int,
        eos_id: int,
        check_epoch: Callable[[int, int], None] | None = None,
    ) -> None:
        self._rows = rows
        self._check_epoch = check_epoch
        self._keep = keep
        self._seed = seed
        self._group_size = group_size
        self._eos = np.full(1, eos_id, dtype=np.int32)
        self.epoch_tokens: int | None = None
        self.epoch_documents: int | None = None
        self.rows_read = 0
        self._reader = rows.open()
        self._epoch = self._group = self._token = self._offset = 0
        self._whole_epoch = True
        self._epoch_count = self._epoch_documents = 0
        self._buffer = np.zeros(0, np.int32)
        self._group_marker: dict[str, Any] = {}
        self._load_group()
        self.start = self.cursor()

    def _read_group(self) -> list[np.ndarray]:
        documents: list[np.ndarray] = []
        while len(documents) < self._group_size:
            try:
                row, tokens = next(self._reader)
            except StopIteration:
                break
            self.rows_read += 1
            if tokens.size and self._keep(row):
                documents.append(tokens)
        return documents

    def _set_group(self, documents: list[np.ndarray], marker: dict[str, Any]) -> None:
        shuffle = order.permutation(
            len(documents), self._seed, order.DOCUMENTS, self._epoch, self._group
        )
        pieces = []
        for i in shuffle:
            pieces += [documents[i], self._eos]
        self._buffer = np.concatenate(pieces)
        self._offset = 0
        self._group_marker = marker
        self._epoch_count += self._buffer.size
        self._epoch_documents += len(documents)

    def _load_group(self) -> None:
        while True:
            marker = self._reader.marker()
            documents = self._read_group()
            if documents:
                self._set_group(documents, marker)
                return
            self._end_epoch()

    def _end_epoch(self) -> None:
        if self._whole_epoch:
            if self._epoch_count == 0:
                raise ConfigError(
                    f"no training documents in {self._rows.name}: its {self.rows_read} rows "
                    "are all empty or held out"
                )
            self.epoch_tokens = self._epoch_count
            self.epoch_documents = self._epoch_documents
            if self._check_epoch is not None:
                self._check_epoch(self._epoch_documents, self._epoch_count)
        self._epoch += 1
        self._group = 0
        self._whole_epoch = True
        self._epoch_count = self._epoch_documents = 0
        self._reader = self._rows.open()

    def _ensure(self) -> None:
        if self._offset == self._buffer.size:
            self._group += 1
            self._load_group()

    def cursor(self) -> Cursor:
        """Where the next token is."""
        self._ensure()
        return Cursor(self._token, self._epoch, self._group, self._offset, self._group_marker)

    def seek(self, cursor: Cursor) -> None:
        """Stand at ``cursor`` (reading its group again from the group's first row).

        Raises:
            ConfigError: ``cursor`` is not a place in this stream.
        """
        if cursor == self.cursor():
            return
        self._epoch, self._group = cursor.epoch, cursor.group
        self._whole_epoch = False
        self._epoch_count = self._epoch_documents = 0
        self._reader = self._rows.open(cursor.rows)
        documents = self._read_group()
        if not documents:
            raise ConfigError(f"the data position {cursor} is past the end of {self._rows.name}")
        self._set_group(documents, dict(cursor.rows))
        if cursor.offset >= self._buffer.size:
            raise ConfigError(
                f"the data position {cursor} is not in {self._rows.name}: its group has "
                f"{self._buffer.size} tokens"
            )
        self._offset = cursor.offset
        self._token = cursor.token

    def read(self, n: int) -> np.ndarray:
        """The next ``n`` tokens (int32)."""
        out = np.empty(n, dtype=np.int32)
        filled = 0
        while filled < n:
            self._ensure()
            take = min(n - filled, self._buffer.size - self._offset)
            out[filled : filled + take] = self._buffer[self._offset : self._offset + take]
            self._offset += take
            filled += take
        self._token += n
        return out

    def skip(self, n: int) -> None:
        """Pass over the next ``n`` tokens."""
        left = n
        while left:
            self._ensure()
            take = min(left, self._buffer.size - self._offset)
            self._offset += take
            left -= take
        self._token += n

    def peek(self) -> int:
        """The next token, not consumed."""
        self._ensure()
        return int(self._buffer[self._offset])


class WindowBlocks:
    """The served windows of a :class:`TokenStream` (see the module docstring), any of them on
    demand: the last two blocks are kept, the cursors of every block start met are noted, and a
    block further away is reached from the nearest noted cursor before it."""

    def __init__(self, stream: TokenStream, *, seq_len: int, block: int, seed: int) -> None:
        self._stream = stream
        self._seq_len = seq_len
        self._block = block
        self._seed = seed
        self._cursors: dict[int, Cursor] = {0: stream.start}
        self._at: int | None = 0  # the block whose start the stream stands at
        self._cache: dict[int, np.ndarray] = {}

    def served(self, start: int, count: int) -> np.ndarray:
        """Served windows ``[start, start + count)``, ``[count, seq_len + 1]`` int32."""
        parts = []
        j, end = start, start + count
        while j < end:
            b = j // self._block
            lo = j - b * self._block
            hi = min(self._block, lo + end - j)
            parts.append(self._windows(b)[lo:hi])
            j += hi - lo
        return np.concatenate(parts)

    def cursor(self, block: int) -> Cursor:
        """The cursor of block ``block``'s first token."""
        if block not in self._cursors:
            self._reach(block)
        return self._cursors[block]

    def restore(self, block: int, cursor: Cursor) -> None:
        """Note that block ``block`` starts at ``cursor`` (a saved position)."""
        self._cursors[block] = cursor
        self._cache.clear()
        self._at = None

    def _reach(self, block: int) -> None:
        """Move the stream to the start of ``block``."""
        # Every block start the stream has stood at is noted, so walking on from where it
        # stands is never longer than from the nearest noted cursor.
        known = max(b for b in self._cursors if b <= block)
        if self._at != known:
            self._stream.seek(self._cursors[known])
            self._at = known
        while self._at < block:
            self._stream.skip(self._block * self._seq_len)
            self._at += 1
            self._cursors[self._at] = self._stream.cursor()

    def _windows(self, block: int) -> np.ndarray:
        cached = self._cache.get(block)
        if cached is not None:
            return cached
        self._reach(block)
        span = self._block * self._seq_len
        tokens = np.empty(span + 1, dtype=np.int32)
        tokens[:span] = self._stream.read(span)
        self._cursors[block + 1] = self._stream.cursor()
        tokens[span] = self._stream.peek()
        self._at = block + 1
        windows = np.lib.stride_tricks.sliding_window_view(tokens, self._seq_len + 1)
        served = windows[:: self._seq_len][
            order.permutation(self._block, self._seed, order.WINDOWS, block)
        ]
        if len(self._cache) >= 2:
            del self._cache[min(self._cache)]
        self._cache[block] = served
        return served


@dataclass(frozen=True)
class EvalTokens:
    """The start of a held-out stream.

    Attributes:
        windows: ``[n, seq_len + 1]`` int32, consecutive windows sharing one token.
        documents: documents read.
        tokens: tokens read (an end of sequence after each document).
        complete: whether every held-out document was read.
    """

    windows: np.ndarray
    documents: int
    tokens: int
    complete: bool


def eval_tokens(
    rows: TokenRows, keep: Callable[[int], bool], *, eos_id: int, seq_len: int, windows: int
) -> EvalTokens:
    """The first ``windows`` windows (fewer if the data ends) of the documents ``keep`` accepts,
    in natural order, each followed by ``eos_id``; read no further than they need."""
    need = windows * seq_len + 1
    reader = rows.open()
    pieces: list[np.ndarray] = []
    eos = np.full(1, eos_id, dtype=np.int32)
    documents = tokens = 0
    complete = False
    while tokens < need:
        try:
            row, doc = next(reader)
        except StopIteration:
            complete = True
            break
        if doc.size and keep(row):
            pieces += [doc, eos]
            documents += 1
            tokens += doc.size + 1
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    n = min(windows, max(stream.size - 1, 0) // seq_len)
    view = np.zeros((0, seq_len + 1), np.int32)
    if n:
        cut = stream[: n * seq_len + 1]
        view = np.lib.stride_tricks.sliding_window_view(cut, seq_len + 1)[::seq_len]
    return EvalTokens(np.ascontiguousarray(view), documents, tokens, complete)

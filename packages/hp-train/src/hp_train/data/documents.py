"""Where documents come from: hp-train's built-in sources and local files read through Hugging
Face ``datasets``, all offline.

A source's documents have a natural order and are numbered by *row* from 0 in it; every row
counts (empty ones too), so a row's number is the same whether its files are streamed or
loaded, and the held-out split (:func:`hp_train.data.order.is_held_out`) is a function of it.

Local inputs (``--data PATH``):

* a text file (``.txt``, ``.md``): each block between blank lines is a document (``datasets``'
  text loader with ``sample_by="paragraph"``: the file split at ``"\\n\\n"``, empty blocks
  dropped, line breaks inside a block kept);
* a folder of ``.txt``/``.md`` files: each file is a document;
* JSON Lines or JSON (``.jsonl``, ``.json``) and Parquet (``.parquet``): each row's text field
  (``text_field``) is a document;
* a folder of JSON Lines/JSON or of Parquet files: their rows, file after file.

Folders are searched recursively, their files taken in sorted order of their relative paths;
names starting with ``.`` (hidden files and folders) are not searched, and files of 0 bytes,
which hold no document, are passed over. A folder holds one kind of file.

Built-in sources: ``"pydoc"`` (the documentation topics CPython ships in
``pydoc_data.topics``, one topic a document, sorted by name), ``"corpus"`` (each ``.py``/``.md``
file of the installed hp-* packages a document, headed by its path) and ``"synthetic"`` (token
runs, :func:`synthetic_runs`; no text).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from hp_train.config.schema import ConfigError
from hp_train.data import order

__all__ = [
    "BUILTIN_SOURCES",
    "CORPUS_PACKAGES",
    "STREAMING_THRESHOLD_BYTES",
    "DocumentReader",
    "Documents",
    "LocalFiles",
    "TextDocuments",
    "not_found_message",
    "open_documents",
    "resolve_local",
    "synthetic_runs",
    "training_texts",
]

#: The sources that are not paths (a local folder with one of these names: pass ``./NAME``).
BUILTIN_SOURCES: tuple[str, ...] = ("corpus", "pydoc", "synthetic")
#: Packages whose files make up the ``"corpus"`` source (those installed are used).
CORPUS_PACKAGES: tuple[str, ...] = ("hp_layout", "hp_dtensor", "hp_fsdp", "hp_muon", "hp_train")
#: Local inputs larger than this are streamed when ``streaming`` is left to the size.
STREAMING_THRESHOLD_BYTES = 256 << 20

Kind = Literal["text", "json", "parquet"]
_SUFFIXES: dict[str, Kind] = {
    ".txt": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}


def not_found_message(what: str, value: str, *, builtins: bool = True) -> str:
    """Why ``value`` (given as ``what``) is no data: not local, and nothing is downloaded."""
    kinds = f"neither a built-in source {list(BUILTIN_SOURCES)} nor" if builtins else "not"
    return (
        f"{what} {value!r} is {kinds} a local file or folder; nothing is downloaded "
        "here (no hub access at run time): save the dataset to local files (e.g. "
        "datasets.load_dataset(NAME, split='train').to_parquet('data.parquet') on a machine "
        "with access) and pass that path"
    )


@dataclass(frozen=True)
class LocalFiles:
    """The files of a local input, in their natural order.

    Attributes:
        path: the file or folder given.
        files: the files read, sorted by their path relative to ``path``.
        kind: ``"text"``, ``"json"`` or ``"parquet"``.
    """

    path: Path
    files: tuple[Path, ...]
    kind: Kind

    @property
    def total_bytes(self) -> int:
        """The size of all files."""
        return sum(f.stat().st_size for f in self.files)

    def relative_names(self) -> list[str]:
        """The files' paths relative to :attr:`path` (their names for a single file)."""
        if self.path.is_file():
            return [self.path.name]
        return [f.relative_to(self.path).as_posix() for f in self.files]

    def content_key(self) -> str:
        """A digest of the files' relative names and sizes: the same for a copy elsewhere."""
        digest = hashlib.sha256()
        for name, f in zip(self.relative_names(), self.files, strict=True):
            digest.update(f"{name}\0{f.stat().st_size}\n".encode())
        return digest.hexdigest()[:16]

    def builder(self) -> tuple[str, dict[str, Any]]:
        """The ``datasets`` packaged loader and its options for these files."""
        if self.kind == "text":
            # A folder's files are documents; a single file's blank-line blocks are.
            return "text", {"sample_by": "document" if self.path.is_dir() else "paragraph"}
        return self.kind, {}


def resolve_local(source: str) -> LocalFiles:
    """The files of the local input ``source`` (a file or a folder).

    Raises:
        ConfigError: ``source`` does not exist (a hub name: nothing is downloaded), has a
            suffix not read here, is a folder without such files or with several kinds.
    """
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(not_found_message("data", source))
    supported = ", ".join(_SUFFIXES)
    if path.is_file():
        kind = _SUFFIXES.get(path.suffix.lower())
        if kind is None:
            raise ConfigError(
                f"data file {str(path)!r} has suffix {path.suffix!r}; the files read are "
                f"{supported} (text, JSON Lines/JSON, Parquet)"
            )
        if path.stat().st_size == 0:
            raise ConfigError(f"data file {str(path)!r} is empty (0 bytes): no documents")
        return LocalFiles(path, (path,), kind)
    found: dict[Kind, list[Path]] = {}
    others = 0
    empty = 0
    for f in sorted(path.rglob("*"), key=lambda p: p.relative_to(path).as_posix()):
        relative = f.relative_to(path)
        if any(part.startswith(".") for part in relative.parts) or not f.is_file():
            continue
        file_kind = _SUFFIXES.get(f.suffix.lower())
        if file_kind is None:
            others += 1
        elif f.stat().st_size == 0:
            empty += 1
        else:
            found.setdefault(file_kind, []).append(f)
    if not found:
        raise ConfigError(
            f"data folder {str(path)!r} holds no non-empty {supported} file ({others} other "
            f"files, {empty} empty ones): no documents"
        )
    if len(found) > 1:
        counts = ", ".join(f"{len(v)} {k}" for k, v in sorted(found.items()))
        raise ConfigError(
            f"data folder {str(path)!r} mixes kinds of files ({counts}); a folder holds one "
            "kind (text .txt/.md, JSON Lines/JSON .jsonl/.json, or Parquet .parquet): pass "
            "a folder of one kind"
        )
    ((kind, files),) = found.items()
    return LocalFiles(path, tuple(files), kind)


class DocumentReader(Protocol):
    """``(row, text)`` of a source's documents in order, from where it was opened."""

    def __next__(self) -> tuple[int, str]:
        """The next document and its row; StopIteration after the last."""
        ...

    def marker(self) -> dict[str, Any]:
        """Where this reader stands: :meth:`Documents.open` with it continues with the next
        row (JSON-serializable)."""
        ...


class Documents(ABC):
    """A source of text documents.

    Attributes:
        name: the source, for logs and messages (a built-in name or the path).
        streaming: whether documents are read lazily from files (bounded memory) rather
            than held in memory.
    """

    name: str
    streaming: bool

    @abstractmethod
    def open(self, marker: Mapping[str, Any] | None = None) -> DocumentReader:
        """A reader from ``marker`` (one of a reader's :meth:`DocumentReader.marker`; or one
        with only ``"row"``), or from the first row."""

    @abstractmethod
    def content_key(self) -> str:
        """A digest of what the documents are (equal for equal inputs)."""

    @abstractmethod
    def summary(self) -> str:
        """What the source is, in a few words."""


class _ListReader:
    def __init__(self, texts: Sequence[str], row: int) -> None:
        self._texts = texts
        self._row = row

    def __iter__(self) -> _ListReader:
        return self

    def __next__(self) -> tuple[int, str]:
        if self._row >= len(self._texts):
            raise StopIteration
        self._row += 1
        return self._row - 1, self._texts[self._row - 1]

    def marker(self) -> dict[str, Any]:
        return {"row": self._row}


class TextDocuments(Documents):
    """Documents held in memory (a built-in source, or local files loaded whole)."""

    def __init__(self, name: str, texts: Sequence[str], summary: str, key: str | None = None):
        self.name = name
        self.streaming = False
        self.texts = list(texts)
        self._summary = summary
        self._key = key

    def open(self, marker: Mapping[str, Any] | None = None) -> DocumentReader:
        return _ListReader(self.texts, _marker_row(marker))

    def content_key(self) -> str:
        if self._key is None:
            digest = hashlib.sha256()
            for text in self.texts:
                digest.update(hashlib.sha256(text.encode()).digest())
            self._key = digest.hexdigest()[:16]
        return self._key

    def summary(self) -> str:
        return self._summary


def _marker_row(marker: Mapping[str, Any] | None) -> int:
    if marker is None:
        return 0
    row = marker.get("row")
    if isinstance(row, bool) or not isinstance(row, int) or row < 0:
        raise ConfigError(f"a document position needs a row >= 0, got {dict(marker)!r}")
    return row


def _text(value: object, row: int, field: str, source: str) -> str:
    if isinstance(value, str):
        return value
    what = "null" if value is None else f"a {type(value).__name__}"
    raise ConfigError(
        f"row {row} of {source} has {what} in its text field {field!r}, not a string; "
        "remove the row or pass --text-field naming a string field"
    )


def _missing_field(field: str, present: Sequence[str], source: str) -> ConfigError:
    return ConfigError(
        f"{source} has no field {field!r} in its rows; fields present: {sorted(present)}; "
        "pass --text-field with the one that holds the text"
    )


@contextlib.contextmanager
def _offline_datasets() -> Iterator[Any]:
    """``datasets`` (imported here: it is slow to import) kept off the network and quiet.

    ``load_dataset`` of local files still sends a download-count request to the hub (with a
    3 s timeout, on every call) unless offline; and its progress bars would be drawn by every
    rank. Both settings are restored afterwards.
    """
    import datasets  # type: ignore[import-untyped,unused-ignore]

    config = datasets.config
    saved = (config.HF_HUB_OFFLINE, config.HF_UPDATE_DOWNLOAD_COUNTS)
    was_disabled = datasets.utils.are_progress_bars_disabled()
    config.HF_HUB_OFFLINE, config.HF_UPDATE_DOWNLOAD_COUNTS = True, False
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        config.HF_HUB_OFFLINE, config.HF_UPDATE_DOWNLOAD_COUNTS = saved
        if not was_disabled:
            datasets.enable_progress_bars()


#: What each kind of file must hold, for the message when one does not.
_EXPECTED = {
    "text": "UTF-8 text",
    "json": "JSON Lines (one JSON object per line) or a JSON array of objects",
    "parquet": "a Parquet table",
}


def _unreadable_errors() -> tuple[type[BaseException], ...]:
    """What ``datasets`` and ``pyarrow`` raise for a file that is not what its suffix says."""
    import datasets  # type: ignore[import-untyped,unused-ignore]
    import pyarrow  # type: ignore[import-untyped,unused-ignore]

    return (datasets.exceptions.DatasetGenerationError, pyarrow.ArrowException, UnicodeError)


@contextlib.contextmanager
def _readable(files: LocalFiles) -> Iterator[None]:
    """Turn a file ``datasets`` cannot read as its kind into a :class:`ConfigError` naming the
    input, what the reader found (the innermost cause) and what the kind must hold."""
    try:
        yield
    except _unreadable_errors() as exc:
        cause: BaseException = exc
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
        raise ConfigError(
            f"--data {files.path}: cannot read it as {files.kind} files "
            f"({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}); "
            f"each file must hold {_EXPECTED[files.kind]}"
        ) from exc


def _files_args(files: LocalFiles) -> tuple[str, dict[str, Any]]:
    builder, options = files.builder()
    return builder, {"data_files": [str(f) for f in files.files], "split": "train", **options}


class _StreamReader:
    def __init__(self, owner: StreamedFiles, marker: Mapping[str, Any] | None) -> None:
        self._owner = owner
        self._dataset = owner.iterable()
        self._row = _marker_row(marker)
        state = None if marker is None else marker.get("datasets")
        if state is not None:
            # datasets resumes inside the file it stood in, without reading those before it.
            self._dataset.load_state_dict(state)
        self._iterator = iter(self._dataset)
        if state is None:
            # A position without datasets' record (one saved from loaded files): read up to it.
            for passed in range(self._row):
                if next(self._iterator, None) is None:
                    raise ConfigError(
                        f"the document position row {self._row} is past the end of "
                        f"{owner.name} ({passed} rows)"
                    )

    def __iter__(self) -> _StreamReader:
        return self

    def __next__(self) -> tuple[int, str]:
        with _readable(self._owner.files):
            example = next(self._iterator)
        field = self._owner.field
        if field not in example:
            raise _missing_field(field, list(example), self._owner.name)
        text = _text(example[field], self._row, field, self._owner.name)
        self._row += 1
        return self._row - 1, text

    def marker(self) -> dict[str, Any]:
        return {"row": self._row, "datasets": self._dataset.state_dict()}


class StreamedFiles(Documents):
    """Local files read lazily through ``datasets``' streaming mode (an ``IterableDataset``):
    memory bounded by what ``datasets`` buffers, whatever the size of the input."""

    def __init__(self, files: LocalFiles, field: str) -> None:
        self.name = str(files.path)
        self.streaming = True
        self.files = files
        self.field = field

    def iterable(self) -> Any:
        """A fresh ``datasets.IterableDataset`` over the files."""
        builder, args = _files_args(self.files)
        with _offline_datasets() as datasets, _readable(self.files):
            return datasets.load_dataset(builder, streaming=True, **args)

    def open(self, marker: Mapping[str, Any] | None = None) -> DocumentReader:
        return _StreamReader(self, marker)

    def content_key(self) -> str:
        return self.files.content_key()

    def summary(self) -> str:
        return _files_summary(self.files, "streamed")


def _files_summary(files: LocalFiles, how: str) -> str:
    n = len(files.files)
    return f"{n} {files.kind} file{'s' if n != 1 else ''}, {files.total_bytes / 1e6:.1f} MB, {how}"


def _load_files(files: LocalFiles, field: str) -> TextDocuments:
    """Every document of ``files`` in memory, through ``datasets``' loader (its Arrow cache in
    a temporary folder, removed once the texts are read)."""
    builder, args = _files_args(files)
    with (
        tempfile.TemporaryDirectory(prefix="hp_train_data_") as cache,
        _offline_datasets() as datasets,
        _readable(files),
    ):
        table = datasets.load_dataset(builder, cache_dir=cache, keep_in_memory=True, **args)
        if field not in table.column_names:
            raise _missing_field(field, table.column_names, str(files.path))
        values = list(table[field])
    texts = [_text(v, row, field, str(files.path)) for row, v in enumerate(values)]
    return TextDocuments(
        str(files.path), texts, _files_summary(files, "loaded"), key=files.content_key()
    )


def _check_field(documents: StreamedFiles) -> None:
    """Fail now, not steps later, when the text field is missing."""
    columns = documents.iterable().column_names
    if columns is not None and documents.field not in columns:
        raise _missing_field(documents.field, columns, documents.name)
    reader = documents.open()
    with contextlib.suppress(StopIteration):
        next(reader)


def pydoc_documents() -> TextDocuments:
    """The documentation topics of this Python (``pydoc_data.topics.topics``), sorted by name.

    Raises:
        ConfigError: this Python's distribution left ``pydoc_data`` out.
    """
    try:
        from pydoc_data.topics import topics  # type: ignore[import-untyped,unused-ignore]
    except ImportError as err:
        raise ConfigError(
            "the built-in source 'pydoc' needs the documentation topics CPython ships in "
            f"pydoc_data.topics, which this Python ({err}) does not have (some distributions "
            "strip them); pass a local text file or folder as the data instead"
        ) from None
    names = sorted(topics)
    texts = [str(topics[n]) for n in names]
    size = sum(len(t) for t in texts)
    return TextDocuments("pydoc", texts, f"{len(texts)} topics of pydoc_data, {size / 1e3:.0f} kB")


def corpus_documents(packages: Sequence[str] = CORPUS_PACKAGES) -> TextDocuments:
    """Each ``.py``/``.md`` file of the installed ``packages``, headed by its path, sorted by
    path.

    Raises:
        ConfigError: none of ``packages`` is installed with source files.
    """
    texts: list[str] = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            base = Path(root)
            files = sorted(p for p in base.rglob("*") if p.suffix in (".py", ".md"))
            texts += [
                f"# {name}/{f.relative_to(base)}\n" + f.read_text(encoding="utf-8") for f in files
            ]
    if not texts:
        raise ConfigError(
            f"no corpus: none of {list(packages)} is installed with source files; use "
            "another data source"
        )
    size = sum(len(t) for t in texts)
    return TextDocuments(
        "corpus", texts, f"{len(texts)} files of the hp-* packages, {size / 1e3:.0f} kB"
    )


def synthetic_runs(vocab_size: int, seed: int, tokens: int = 1 << 16) -> list[np.ndarray]:
    """The ``"synthetic"`` source's documents: runs of 16 to 63 tokens, each an arithmetic
    progression modulo ``vocab_size`` with its own start and stride (1 to 7), learnable from
    context; ``tokens`` tokens in all (the last run cut to fit)."""
    runs: list[np.ndarray] = []
    total = 0
    while total < tokens:
        h = order.mix64(seed, order.SYNTHETIC, len(runs))
        start = h % vocab_size
        stride = 1 + (h >> 32) % 7
        n = min(16 + (h >> 40) % 48, tokens - total)
        runs.append(((start + stride * np.arange(n, dtype=np.int64)) % vocab_size).astype(np.int32))
        total += n
    return runs


def open_documents(
    source: str, text_field: str = "text", streaming: bool | None = None
) -> Documents:
    """The text documents of ``source``: ``"pydoc"``, ``"corpus"`` or a local path.

    ``streaming`` None streams local inputs larger than :data:`STREAMING_THRESHOLD_BYTES`.

    Raises:
        ConfigError: ``"synthetic"`` (token ids, no text); a built-in source with
            ``streaming=True`` or a ``text_field`` other than ``"text"``; a bad local input
            (:func:`resolve_local`); text files with a ``text_field`` other than ``"text"``;
            JSON/Parquet rows without ``text_field``.
    """
    if source == "synthetic":
        raise ConfigError("the 'synthetic' source is token ids, not text documents")
    if source in BUILTIN_SOURCES:
        if streaming:
            raise ConfigError(
                f"streaming reads local files; the built-in source {source!r} is in memory: "
                "leave streaming unset"
            )
        if text_field != "text":
            raise ConfigError(
                f"text_field={text_field!r} selects a field of JSON Lines/Parquet rows; the "
                f"built-in source {source!r} has none: leave it 'text'"
            )
        return pydoc_documents() if source == "pydoc" else corpus_documents()
    files = resolve_local(source)
    if files.kind == "text" and text_field != "text":
        raise ConfigError(
            f"text_field={text_field!r} selects a field of JSON Lines/Parquet rows; "
            f"{source!r} is text files: leave it 'text'"
        )
    field = text_field if files.kind != "text" else "text"
    if streaming is None:
        streaming = files.total_bytes > STREAMING_THRESHOLD_BYTES
    if not streaming:
        return _load_files(files, field)
    documents = StreamedFiles(files, field)
    _check_field(documents)
    return documents


def training_texts(
    source: str, *, text_field: str = "text", eval_fraction: float = 0.0, seed: int = 0
) -> Iterator[str]:
    """The non-empty documents of ``source`` that a run with ``seed`` and ``eval_fraction``
    trains on (never a held-out one), in natural order; local files are streamed.

    Raises:
        ConfigError: as :func:`open_documents`.
    """
    documents = open_documents(source, text_field, streaming=source not in BUILTIN_SOURCES)
    return _kept_texts(documents.open(), seed, eval_fraction)


def _kept_texts(reader: DocumentReader, seed: int, eval_fraction: float) -> Iterator[str]:
    while True:
        try:
            row, text = next(reader)
        except StopIteration:
            return
        if text and not order.is_held_out(row, seed, eval_fraction):
            yield text

"""Training data: documents from a built-in source or local files, tokenized, packed into
windows of ``seq_len + 1`` tokens and served as batches that are a pure function of
``(seed, step)``.

:func:`build_data` turns a :class:`DataSpec` and a tokenizer into a :class:`TrainData`: every
rank builds the same one, draws the same global batch of each step and keeps its data-parallel
slice, so the data order does not depend on the world size; :meth:`TrainData.state_dict` is
the loader's position for a checkpoint, and a run resumed from it sees exactly the batches an
uninterrupted one would. Where documents come from is :mod:`hp_train.data.documents`; how they are
ordered and packed, :mod:`hp_train.data.packing` and :mod:`hp_train.data.order`.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hp_train.config.schema import ConfigError
from hp_train.data import documents as docs
from hp_train.data.order import is_held_out
from hp_train.data.packing import (
    Cursor,
    EvalTokens,
    LazyRows,
    MemoryRows,
    TokenRows,
    TokenStream,
    WindowBlocks,
    eval_tokens,
)
from hp_train.data.spec import DataSpec
from hp_train.data.tokenizer import TextTokenizer

__all__ = [
    "CORPUS_PACKAGES",
    "STATE_FORMAT",
    "Batch",
    "DataSpec",
    "TrainData",
    "build_data",
    "is_held_out",
    "training_texts",
]

#: Packages whose text makes up the corpus (those installed are used).
CORPUS_PACKAGES: tuple[str, ...] = docs.CORPUS_PACKAGES
#: The version of :meth:`TrainData.state_dict`'s layout.
STATE_FORMAT = 1


@dataclass(frozen=True)
class Batch:
    """Inputs and next-token targets, ``[batch, seq]`` int64 each."""

    inputs: torch.Tensor
    targets: torch.Tensor


# A text every tokenizer encodes: its ids identify the tokenizer in a saved data position.
_PROBE = (
    "The quick brown fox jumps over the lazy dog. 0123456789 naïve café Ωμέγα 日本語 🎉\n"
    "\tdef f(x):\n        return {'a': x ** 2}  # <|endoftext|> </s>"
)
# Fingerprint entries that name things for messages; a copy of the data elsewhere may resume.
_INFORMATIONAL = ("source", "tokenizer_name")


def _tokenizer_key(tokenizer: TextTokenizer) -> str:
    ids = ",".join(str(i) for i in tokenizer.encode(_PROBE))
    text = f"{tokenizer.vocab_size}|{tokenizer.eos_id}|{ids}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class _Rows:
    """A source's token rows and what describes them."""

    rows: TokenRows
    name: str
    summary: str
    key: str


def _source_rows(source: str, spec: DataSpec, tokenizer: TextTokenizer, seed: int) -> _Rows:
    if source == "synthetic":
        if spec.streaming:
            raise ConfigError(
                "streaming reads local files; the built-in source 'synthetic' is in memory: "
                "leave streaming unset"
            )
        if spec.text_field != "text":
            raise ConfigError(
                f"text_field={spec.text_field!r} selects a field of JSON Lines/Parquet rows; "
                "the built-in source 'synthetic' has none: leave it 'text'"
            )
        runs = docs.synthetic_runs(tokenizer.vocab_size, seed)
        summary = f"{len(runs)} runs of arithmetic progressions, {sum(r.size for r in runs)} tokens"
        key = f"synthetic-{tokenizer.vocab_size}"
        return _Rows(MemoryRows("synthetic", runs), "synthetic", summary, key)
    documents = docs.open_documents(source, spec.text_field, spec.streaming)
    rows: TokenRows = (
        LazyRows(documents, tokenizer)
        if documents.streaming
        else MemoryRows.from_documents(documents, tokenizer)
    )
    return _Rows(rows, documents.name, documents.summary(), documents.content_key())


def _check_batch(step: int, global_batch: int, dp_rank: int, dp_size: int) -> int:
    for name, value in (("step", step), ("global_batch", global_batch), ("dp_size", dp_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name != "step"):
            raise ConfigError(f"{name} must be an integer >= {int(name != 'step')}, got {value!r}")
    if global_batch % dp_size:
        raise ConfigError(
            f"global_batch={global_batch} must be divisible by the data-parallel size "
            f"{dp_size}: each rank takes an equal slice"
        )
    if not 0 <= dp_rank < dp_size:
        raise ConfigError(f"dp_rank={dp_rank} is not a rank of data-parallel size {dp_size}")
    return global_batch // dp_size


def _to_batch(windows: np.ndarray) -> Batch:
    tokens = torch.from_numpy(windows.astype(np.int64))
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


class TrainData:
    """The batches of a run: training windows in a seeded order, and a held-out split.

    Built by :func:`build_data`. Training windows are cut from the stream of epochs of the
    training documents (:mod:`hp_train.data.packing`: documents each followed by the tokenizer's
    end of sequence, shuffled within groups of ``spec.shuffle_documents`` per epoch; windows
    of ``seq_len + 1`` tokens, neighbours sharing one token, shuffled within blocks of
    ``spec.shuffle_windows``). Step ``s`` of global batch ``B`` is served windows
    ``[s * B, (s + 1) * B)``.

    Attributes:
        spec: the data.
        tokenizer: the tokenizer of the documents.
        seq_len: tokens per sequence.
        seed: the seed of the held-out split and of the shuffles.
    """

    def __init__(
        self,
        spec: DataSpec,
        tokenizer: TextTokenizer,
        *,
        seq_len: int,
        seed: int,
        train: _Rows,
        keep: Callable[[int], bool],
        validation: _Rows | None,
        keep_eval: Callable[[int], bool],
    ) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self._train = train
        self._validation = validation
        self._keep_eval = keep_eval
        self._need = 0  # tokens the batch being served needs in one epoch
        self._stream = TokenStream(
            train.rows, keep, seed=seed, group_size=spec.shuffle_documents,
            eos_id=tokenizer.eos_id, check_epoch=self._check_epoch,
        )  # fmt: skip
        self._blocks = WindowBlocks(
            self._stream, seq_len=seq_len, block=spec.shuffle_windows, seed=seed
        )
        self._totals = train.rows.totals(keep) if isinstance(train.rows, MemoryRows) else None
        self._eval_cache: dict[tuple[int, int], EvalTokens] = {}
        self._next_step = 0
        self._global_batch: int | None = None
        self._fingerprint: dict[str, Any] = {
            "source": train.name,
            "content": train.key,
            "text_field": spec.text_field,
            "eval_fraction": spec.eval_fraction,
            "eval_data": None if validation is None or spec.eval_data is None else validation.key,
            "seed": seed,
            "seq_len": seq_len,
            "shuffle_documents": spec.shuffle_documents,
            "shuffle_windows": spec.shuffle_windows,
            "tokenizer": _tokenizer_key(tokenizer),
            "tokenizer_name": tokenizer.name,
        }

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary: every id in a batch is below it."""
        return self.tokenizer.vocab_size

    @property
    def has_eval(self) -> bool:
        """Whether there is a held-out split (:meth:`eval_batches`)."""
        return self._validation is not None

    @property
    def documents_read(self) -> int:
        """Documents the training stream has taken from its source so far (a resumed one
        reads from the start of one document group, not from the start of the data)."""
        return self._stream.rows_read

    def _check_epoch(self, documents: int, tokens: int) -> None:
        """Refuse an epoch shorter than one batch (rather than repeat it within the batch)."""
        if tokens < self._need:
            global_batch = (self._need - 1) // self.seq_len
            raise ConfigError(
                f"the training data {self._train.name} has {documents} documents, {tokens} "
                f"tokens (an end of sequence after each document); one batch of global_batch="
                f"{global_batch} x seq_len={self.seq_len} needs {self._need}: use more data "
                "or a smaller batch"
            )

    def batch(self, step: int, global_batch: int, dp_rank: int, dp_size: int) -> Batch:
        """This data-parallel rank's slice of step ``step``'s global batch.

        Postconditions: ``inputs`` and ``targets`` are ``[global_batch // dp_size, seq_len]``
        int64, ``targets`` the next tokens of ``inputs``; the slices of ranks ``0..dp_size-1``
        concatenated are the global batch; the result depends only on (data, tokenizer,
        ``seq_len``, seed, ``step``, ``global_batch``), whatever was asked before (in order is
        cheap: a block of windows is read once).

        Raises:
            ConfigError: ``global_batch`` not divisible by ``dp_size``, a rank out of range,
                or less training data than one batch.
        """
        local = _check_batch(step, global_batch, dp_rank, dp_size)
        self._need = global_batch * self.seq_len + 1
        if self._totals is not None:
            self._check_epoch(*self._totals)
        elif self._stream.epoch_tokens is not None and self._stream.epoch_documents is not None:
            self._check_epoch(self._stream.epoch_documents, self._stream.epoch_tokens)
        windows = self._blocks.served(step * global_batch + dp_rank * local, local)
        self._next_step = step + 1
        self._global_batch = global_batch
        return _to_batch(windows)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last :meth:`batch` (JSON-serializable; equal on every rank
        that asked for the same steps, as ranks of a training loop do).

        Postcondition: :meth:`load_state_dict` of it into a :class:`TrainData` of the same
        data, tokenizer, ``seq_len`` and seed continues where this one stands, reading the
        input again only from the start of the current document group.
        """
        gb = self._global_batch
        block = self._next_step * gb // self.spec.shuffle_windows if gb else 0
        return {
            "format": STATE_FORMAT,
            "data": dict(self._fingerprint),
            "next_step": self._next_step,
            "global_batch": gb,
            "block": block,
            "cursor": copy.deepcopy(self._blocks.cursor(block).to_json()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict` of a run of the same data).

        Raises:
            ConfigError: ``state`` was saved for other data, tokenizer, ``seq_len``, seed or
                shuffles (each difference named), or is not a data state.
        """
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise ConfigError(f"not a data position of format {STATE_FORMAT}: {str(state)[:200]}")
        saved = state.get("data")
        if not isinstance(saved, Mapping):
            raise ConfigError("the data position has no description of its data ('data')")
        differences = [
            f"{key}: saved {saved.get(key)!r}, this run {value!r}"
            for key, value in self._fingerprint.items()
            if key not in _INFORMATIONAL and saved.get(key) != value
        ]
        if differences:
            raise ConfigError(
                f"the data position was saved for other data than {self._train.name} with "
                f"{self.tokenizer.name} ({'; '.join(differences)}; saved for "
                f"{saved.get('source')!r} with {saved.get('tokenizer_name')!r}): resume with "
                "the same data, tokenizer, seq_len and seed, or start a new run"
            )
        step, gb, block = state.get("next_step"), state.get("global_batch"), state.get("block")
        expected = None
        if isinstance(step, int) and step >= 0 and (gb is None or (isinstance(gb, int) and gb > 0)):
            expected = step * gb // self.spec.shuffle_windows if gb else 0
        if expected is None or block != expected:
            raise ConfigError(
                f"the data position's step {step!r}, global batch {gb!r} and block {block!r} "
                "do not agree"
            )
        assert isinstance(step, int)
        self._blocks.restore(expected, Cursor.from_json(state.get("cursor")))
        self._next_step = step
        self._global_batch = gb

    def _eval(self, global_batch: int, max_batches: int) -> EvalTokens:
        key = (global_batch, max_batches)
        if key not in self._eval_cache:
            assert self._validation is not None
            self._eval_cache[key] = eval_tokens(
                self._validation.rows, self._keep_eval, eos_id=self.tokenizer.eos_id,
                seq_len=self.seq_len, windows=global_batch * max_batches,
            )  # fmt: skip
        return self._eval_cache[key]

    def eval_batches(
        self, global_batch: int, dp_rank: int, dp_size: int, max_batches: int
    ) -> list[Batch]:
        """This rank's slices of the held-out split's first ``max_batches`` global batches
        (fewer when the split is shorter; windows that fill no whole batch left out).

        Postconditions: the same batches at every call; held-out documents in natural order,
        each followed by the end of sequence, cut into consecutive windows (neighbours sharing
        one token), never shuffled and never in a training batch.

        Raises:
            ConfigError: no held-out split, or one shorter than one batch (with its counts).
        """
        local = _check_batch(0, global_batch, dp_rank, dp_size)
        if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
            raise ConfigError(f"max_batches must be a positive integer, got {max_batches!r}")
        if self._validation is None:
            raise ConfigError(
                "no held-out split to validate on: set eval_fraction > 0 or eval_data"
            )
        held = self._eval(global_batch, max_batches)
        count = held.windows.shape[0] // global_batch
        if count == 0:
            at_least = "" if held.complete else "at least "
            raise ConfigError(
                f"the held-out split of {self._validation.name} has {at_least}{held.documents} "
                f"documents, {held.tokens} tokens; one batch of global_batch={global_batch} x "
                f"seq_len={self.seq_len} needs {global_batch * self.seq_len + 1} tokens: raise "
                "eval_fraction, pass a larger eval_data, or a smaller batch"
            )
        out = []
        for b in range(count):
            start = b * global_batch + dp_rank * local
            out.append(_to_batch(held.windows[start : start + local]))
        return out

    def describe(self) -> str:
        """One line for logs: source, documents, tokens, held-out share, tokenizer."""
        t = self.tokenizer
        tokenizer = f"tokenizer {t.name} (vocab {t.vocab_size}, eos id {t.eos_id})"
        if self._totals is not None:
            train_docs, train_tokens = self._totals
            contents = f"{train_docs} training documents, {train_tokens:,} tokens"
        else:
            contents = "documents and tokens counted as they are read"
        if self.spec.eval_fraction > 0:
            held = f"held out: each document with probability {self.spec.eval_fraction:g}"
            if isinstance(self._train.rows, MemoryRows):
                held_docs, held_tokens = self._train.rows.totals(self._keep_eval)
                total = held_docs + (self._totals[0] if self._totals else 0)
                held = (
                    f"held out {held_docs} of {total} documents ({held_docs / max(total, 1):.1%}"
                    f", asked {self.spec.eval_fraction:.1%}), {held_tokens:,} tokens"
                )
        elif self._validation is not None:
            held = f"validation on {self._validation.name} ({self._validation.summary})"
        else:
            held = "no held-out split"
        return (
            f"data {self._train.name} ({self._train.summary}): {contents}; {held}; "
            f"{tokenizer}; seq_len {self.seq_len}, seed {self.seed}"
        )


def build_data(spec: DataSpec, tokenizer: TextTokenizer, *, seq_len: int, seed: int) -> TrainData:
    """The :class:`TrainData` of ``spec`` tokenized by ``tokenizer``, in windows of ``seq_len``
    (+ 1) tokens, its held-out split and order drawn from ``seed``.

    Inputs not streamed are read and tokenized here, whole; streamed ones as batches need them.

    Raises:
        ConfigError: a bad ``seq_len``; data that cannot be read (:func:`open_documents`); no
            training document (all empty or held out).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"seq_len must be a positive integer, got {seq_len!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    train = _source_rows(spec.source, spec, tokenizer, seed)
    fraction = spec.eval_fraction

    def keep(row: int) -> bool:
        return not is_held_out(row, seed, fraction)

    def held_out(row: int) -> bool:
        return is_held_out(row, seed, fraction)

    def every(row: int) -> bool:
        return True

    validation: _Rows | None = None
    keep_eval = held_out
    if spec.eval_data is not None:
        validation = _source_rows(spec.eval_data, spec, tokenizer, seed)
        keep_eval = every
    elif fraction > 0:
        validation = train
    return TrainData(
        spec, tokenizer, seq_len=seq_len, seed=seed, train=train,
        keep=keep if fraction > 0 else every, validation=validation, keep_eval=keep_eval,
    )  # fmt: skip


def training_texts(spec: DataSpec, seed: int) -> Iterator[str]:
    """The texts a run of ``spec`` with ``seed`` trains on (no held-out document), in natural
    order, local files streamed: what a tokenizer for the run is trained on.

    Raises:
        ConfigError: the ``"synthetic"`` source (token ids, no text), or data that cannot be
            read.
    """
    return docs.training_texts(
        spec.source, text_field=spec.text_field, eval_fraction=spec.eval_fraction, seed=seed
    )

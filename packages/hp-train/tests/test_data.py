"""hp-train's data pipeline on real text: local files through ``datasets`` (loaded and
streamed), packing with end-of-sequence separators, the seeded order, data-parallel slices,
exact resumption from ``state_dict``, and the held-out split.

Most tests use documents made of one letter each (document ``i`` is a run of letter ``i``) and
the byte tokenizer, so every token of a batch names the document it came from and the end of
sequence (byte 0) is never a letter.
"""

from __future__ import annotations

import json
import string
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa  # type: ignore[import-untyped,unused-ignore]
import pyarrow.parquet as pq  # type: ignore[import-untyped,unused-ignore]
import pytest
import torch

from hp_train.config.schema import ConfigError
from hp_train.data.documents import open_documents
from hp_train.data.loader import Batch, DataSpec, TrainData, build_data, is_held_out, training_texts
from hp_train.data.tokenizer import ByteTokenizer

BYTES = ByteTokenizer()
EOS = BYTES.eos_id
LETTERS = string.ascii_letters  # 52 documents at most


def _letter_docs(n: int) -> list[str]:
    """Document ``i``: letter ``i`` repeated ``3 + (7 * i) % 11`` times."""
    return [LETTERS[i] * (3 + (7 * i) % 11) for i in range(n)]


def _write_jsonl(path: Path, texts: Sequence[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "n": i}) + "\n" for i, t in enumerate(texts)))
    return path


def _write_parquet(path: Path, texts: Sequence[str | None]) -> Path:
    pq.write_table(pa.table({"text": list(texts), "n": list(range(len(texts)))}), path)
    return path


def _folder(tmp: Path, kind: str, texts: Sequence[str], files: int = 3) -> Path:
    """``texts`` spread over ``files`` files of ``kind`` in a folder (one nested)."""
    root = tmp / f"{kind}_data"
    (root / "sub").mkdir(parents=True)
    chunks = [list(texts[i::files]) for i in range(files)]
    ordered = []
    for i, chunk in enumerate(chunks):
        # Sorted by relative path: a_0, a_1, ..., sub/z_last.
        name = f"a_{i}" if i < files - 1 else "sub/z_last"
        if kind == "jsonl":
            _write_jsonl(root / f"{name}.jsonl", chunk)
        else:
            _write_parquet(root / f"{name}.parquet", chunk)
        ordered += chunk
    assert sorted(ordered) == sorted(texts)
    return root


def _ordered_folder_texts(texts: Sequence[str], files: int = 3) -> list[str]:
    return [t for i in range(files) for t in texts[i::files]]


def _spec(source: Path | str, **kw: Any) -> DataSpec:
    return DataSpec(str(source), **kw)


def _tokens(batch: Batch) -> set[int]:
    return set(torch.cat([batch.inputs, batch.targets], dim=1).unique().tolist())


# Every test runs as on a machine without network (conftest.py's offline fixture).
pytestmark = pytest.mark.usefixtures("offline")


# --- formats ---------------------------------------------------------------------------------


def test_each_format_yields_its_documents(tmp_path: Path) -> None:
    """Text file (blank-line blocks), text folder (a file each), JSON Lines, JSON array,
    Parquet, folders of JSON Lines and Parquet (files in sorted order, hidden and empty
    files passed over): the same documents and rows loaded and streamed."""
    texts = [f"document {i}: {'word ' * i}end" for i in range(7)]
    paragraphs = tmp_path / "notes.txt"
    paragraphs.write_text("first block\nits second line\n\nsecond\n\n\n\nthird\n")
    text_dir = tmp_path / "pages"
    (text_dir / "b").mkdir(parents=True)
    (text_dir / "a.md").write_text("# page a\n\nbody of a\n")
    (text_dir / "b" / "c.txt").write_text("page c")
    (text_dir / "b" / "empty.txt").write_text("")
    (text_dir / ".hidden.txt").write_text("never read")
    (text_dir / "notes.csv").write_text("not,read\n")
    json_array = tmp_path / "array.json"
    json_array.write_text(json.dumps([{"body": t} for t in texts]))
    jsonl_dir = _folder(tmp_path, "jsonl", texts)
    (jsonl_dir / ".cache").mkdir()
    (jsonl_dir / ".cache" / "x.jsonl").write_text('{"text": "hidden"}\n')
    cases: list[tuple[Path, str, list[str]]] = [
        (paragraphs, "text", ["first block\nits second line", "second", "third\n"]),
        (text_dir, "text", ["# page a\n\nbody of a\n", "page c"]),
        (_write_jsonl(tmp_path / "rows.jsonl", texts), "text", texts),
        (json_array, "body", texts),
        (_write_parquet(tmp_path / "rows.parquet", texts), "text", texts),
        (jsonl_dir, "text", _ordered_folder_texts(texts)),
        (_folder(tmp_path, "parquet", texts), "text", _ordered_folder_texts(texts)),
    ]
    for path, field, expected in cases:
        for streaming in (False, True):
            documents = open_documents(str(path), field, streaming)
            reader = documents.open()
            got = []
            while True:
                try:
                    got.append(next(reader))
                except StopIteration:
                    break
            assert got == list(enumerate(expected)), (path, streaming)
        assert list(training_texts(_spec(path, text_field=field), seed=0)) == expected


# --- packing and order -----------------------------------------------------------------------


def _stitch(windows: Sequence[torch.Tensor]) -> list[int]:
    """The stream that consecutive windows (sharing one token) were cut from."""
    out = windows[0].tolist()
    for w in windows[1:]:
        assert w[0].item() == out[-1], "neighbouring windows share one token"
        out += w[1:].tolist()
    return out


def _windows(data: TrainData, steps: int, global_batch: int) -> list[torch.Tensor]:
    """The served windows of steps ``0..steps-1``, in order (seq_len + 1 tokens each)."""
    out = []
    for step in range(steps):
        b = data.batch(step, global_batch, 0, 1)
        assert torch.equal(b.targets[:, :-1], b.inputs[:, 1:]), "targets are inputs shifted"
        out += list(torch.cat([b.inputs, b.targets[:, -1:]], dim=1))
    return out


def test_packing_puts_eos_after_each_document_and_keeps_every_token(tmp_path: Path) -> None:
    """Unshuffled (groups and blocks of one), the windows stitched back are the documents in
    natural order, each followed by the end of sequence, epoch after epoch with nothing
    dropped at an epoch's end."""
    texts = _letter_docs(9)
    source = _write_jsonl(tmp_path / "d.jsonl", texts)
    data = build_data(
        _spec(source, shuffle_documents=1, shuffle_windows=1), BYTES, seq_len=8, seed=0
    )
    epoch = [t for text in texts for t in [*text.encode(), EOS]]
    steps = 3 * len(epoch) // 16 + 2  # three epochs and a bit, 2 windows of 8 a step
    stream = _stitch(_windows(data, steps, 2))
    assert len(stream) == steps * 16 + 1
    assert stream == (epoch * 4)[: len(stream)]


def _epochs(stream: list[int], documents: int) -> list[list[bytes]]:
    """The stream split at each end of sequence, ``documents`` documents an epoch."""
    parts = bytes(stream).split(bytes([EOS]))[:-1]
    whole = len(parts) // documents
    return [parts[e * documents : (e + 1) * documents] for e in range(whole)]


def test_documents_are_shuffled_within_groups_each_epoch_anew(tmp_path: Path) -> None:
    """Every epoch holds each training document once, permuted only within its group of
    ``shuffle_documents`` (natural order between groups), each epoch in its own order."""
    texts = _letter_docs(12)
    source = _write_jsonl(tmp_path / "d.jsonl", texts)
    spec = _spec(source, shuffle_documents=4, shuffle_windows=1)
    data = build_data(spec, BYTES, seq_len=8, seed=5)
    per_epoch = sum(len(t) + 1 for t in texts)
    epochs = _epochs(_stitch(_windows(data, 3 * per_epoch // 16 + 1, 2)), len(texts))
    assert len(epochs) == 3
    groups = [sorted(t.encode() for t in texts[g : g + 4]) for g in range(0, 12, 4)]
    for documents in epochs:
        assert [sorted(documents[g : g + 4]) for g in range(0, 12, 4)] == groups
    assert len({tuple(e) for e in epochs}) == 3, "each epoch has its own order"
    assert epochs[0] != [t.encode() for t in texts], "the order is shuffled"


def test_windows_are_shuffled_within_blocks(tmp_path: Path) -> None:
    """Blocks of ``shuffle_windows`` hold the same windows as the unshuffled stream, in
    another order."""
    source = _write_jsonl(tmp_path / "d.jsonl", _letter_docs(20))
    plain = _windows(
        build_data(_spec(source, shuffle_documents=4, shuffle_windows=1), BYTES, seq_len=6,
                   seed=1),
        12, 4,
    )  # fmt: skip
    shuffled = _windows(
        build_data(_spec(source, shuffle_documents=4, shuffle_windows=8), BYTES, seq_len=6,
                   seed=1),
        12, 4,
    )  # fmt: skip
    moved = 0
    for start in range(0, 48, 8):
        a = [tuple(w.tolist()) for w in plain[start : start + 8]]
        b = [tuple(w.tolist()) for w in shuffled[start : start + 8]]
        assert sorted(a) == sorted(b)
        moved += a != b
    assert moved == 6, "every block is permuted"


def test_dp_slices_concatenate_to_the_global_batch(tmp_path: Path) -> None:
    """For data-parallel sizes 1, 2 and 4 the ranks' slices, in rank order, are the global
    batch; two objects built alike (two ranks) give equal batches and equal states."""
    source = _write_jsonl(tmp_path / "d.jsonl", _letter_docs(30))
    spec = _spec(source, eval_fraction=0.2, shuffle_documents=5, shuffle_windows=6)
    data = build_data(spec, BYTES, seq_len=8, seed=3)
    other = build_data(spec, BYTES, seq_len=8, seed=3)
    for step in (0, 1, 5, 2):
        whole = data.batch(step, 8, 0, 1)
        assert whole.inputs.shape == whole.targets.shape == (8, 8)
        assert whole.inputs.dtype == torch.int64
        for dp in (1, 2, 4):
            slices = [other.batch(step, 8, r, dp) for r in range(dp)]
            assert all(s.inputs.shape == (8 // dp, 8) for s in slices)
            assert torch.equal(torch.cat([s.inputs for s in slices]), whole.inputs)
            assert torch.equal(torch.cat([s.targets for s in slices]), whole.targets)
    assert data.state_dict() == other.state_dict()
    with pytest.raises(ConfigError, match="global_batch=8 must be divisible by the data-par"):
        data.batch(0, 8, 0, 3)


# --- resumption and random access -------------------------------------------------------------


def _resume_source(tmp_path: Path, kind: str) -> tuple[Path, str]:
    texts = [f"{i}:" + LETTERS[i % 52] * (2 + (5 * i) % 13) for i in range(60)]
    if kind == "parquet":
        return _folder(tmp_path, "parquet", texts), "text"
    if kind == "text":
        path = tmp_path / "blocks.txt"
        path.write_text("\n\n".join(texts))
        return path, "text"
    return _folder(tmp_path, "jsonl", texts), "text"


STEPS, GB = 16, 2


@pytest.mark.parametrize("streaming", [False, True], ids=["loaded", "streamed"])
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "text"])
def test_restored_state_gives_the_uninterrupted_batches(
    tmp_path: Path, kind: str, streaming: bool
) -> None:
    """Batches of steps k..N from a fresh object restored from the state saved after step
    k - 1 (JSON round trip) equal the uninterrupted run's, for k at a run's start, inside a
    block and at block starts, over file boundaries and document groups; the restored object
    reads the input again only from its document group, not from the start."""
    source, field = _resume_source(tmp_path, kind)
    spec = _spec(
        source, text_field=field, eval_fraction=0.25, streaming=streaming,
        shuffle_documents=3, shuffle_windows=4,
    )  # fmt: skip
    reference = build_data(spec, BYTES, seq_len=8, seed=7)
    batches, states = [], []
    for step in range(STEPS):
        states.append(json.loads(json.dumps(reference.state_dict())))
        batches.append(reference.batch(step, GB, 0, 1))
    want = reference.state_dict()
    last = reference.batch(STEPS, GB, 0, 1)
    for k in (0, 1, 5, 10, 15):
        resumed = build_data(spec, BYTES, seq_len=8, seed=7)
        resumed.load_state_dict(states[k])
        scratch = build_data(spec, BYTES, seq_len=8, seed=7)
        scratch.batch(k, GB, 0, 1)
        for step in range(k, STEPS):
            got = resumed.batch(step, GB, 0, 1)
            assert torch.equal(got.inputs, batches[step].inputs), (k, step)
            assert torch.equal(got.targets, batches[step].targets), (k, step)
            if step == k and k >= 10:
                # Steps 10.. are 7 blocks of 32 tokens in, past several groups of 3.
                assert resumed.documents_read < scratch.documents_read, (k, step)
        # The same position (datasets' own resume record may differ in what it prefetched) ...
        final = resumed.state_dict()
        assert final["cursor"]["token"] == want["cursor"]["token"]
        assert {k: v for k, v in final.items() if k != "cursor"} == {
            k: v for k, v in want.items() if k != "cursor"
        }
        # ... from which a second resumption goes on alike.
        again = build_data(spec, BYTES, seq_len=8, seed=7)
        again.load_state_dict(json.loads(json.dumps(final)))
        assert torch.equal(again.batch(STEPS, GB, 0, 1).inputs, last.inputs)


@pytest.mark.parametrize("streaming", [False, True], ids=["loaded", "streamed"])
def test_out_of_order_access_equals_in_order(tmp_path: Path, streaming: bool) -> None:
    source, _ = _resume_source(tmp_path, "jsonl")
    spec = _spec(source, eval_fraction=0.1, streaming=streaming, shuffle_documents=4,
                 shuffle_windows=3)  # fmt: skip
    in_order = build_data(spec, BYTES, seq_len=5, seed=2)
    reference = [in_order.batch(s, 4, 0, 1).inputs for s in range(14)]
    jumping = build_data(spec, BYTES, seq_len=5, seed=2)
    for step in (9, 2, 13, 0, 9, 5, 12, 1):
        assert torch.equal(jumping.batch(step, 4, 0, 1).inputs, reference[step]), step


def test_streamed_equals_loaded(tmp_path: Path) -> None:
    """Forcing streaming on and off gives the same batches, held-out batches and states."""
    source, _ = _resume_source(tmp_path, "parquet")
    built = [
        build_data(_spec(source, eval_fraction=0.3, streaming=s, shuffle_documents=5,
                         shuffle_windows=7), BYTES, seq_len=6, seed=4)
        for s in (False, True)
    ]  # fmt: skip
    for step in range(20):
        a, b = (d.batch(step, 4, 0, 1) for d in built)
        assert torch.equal(a.inputs, b.inputs)
        assert torch.equal(a.targets, b.targets)
    ea, eb = (d.eval_batches(2, 0, 1, 50) for d in built)
    assert len(ea) == len(eb) > 1
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(ea, eb, strict=True))
    sa, sb = (d.state_dict() for d in built)
    assert sa["cursor"]["token"] == sb["cursor"]["token"]
    assert sa["data"] == sb["data"]
    # A loaded run resumes a streamed run's state (and back): the position is the same.
    built[0].load_state_dict(sb)
    built[1].load_state_dict(sa)
    a, b = (d.batch(20, 4, 0, 1) for d in built)
    assert torch.equal(a.inputs, b.inputs)


def test_state_from_other_data_is_refused(tmp_path: Path) -> None:
    source = _write_jsonl(tmp_path / "d.jsonl", _letter_docs(20))
    data = build_data(_spec(source), BYTES, seq_len=8, seed=0)
    data.batch(0, 2, 0, 1)
    state = data.state_dict()
    with pytest.raises(ConfigError, match=r"seq_len: saved 8, this run 16"):
        build_data(_spec(source), BYTES, seq_len=16, seed=0).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"seed: saved 0, this run 1"):
        build_data(_spec(source), BYTES, seq_len=8, seed=1).load_state_dict(state)
    other = _write_jsonl(tmp_path / "e.jsonl", _letter_docs(21))
    with pytest.raises(ConfigError, match=r"content: saved"):
        build_data(_spec(other), BYTES, seq_len=8, seed=0).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"not a data position"):
        data.load_state_dict({"step": 3})


# --- held-out split --------------------------------------------------------------------------


def _letters(batches: Sequence[Batch]) -> set[str]:
    seen = set().union(*(_tokens(b) for b in batches)) - {EOS}
    return {chr(t) for t in seen}


@pytest.mark.parametrize("streaming", [False, True], ids=["loaded", "streamed"])
def test_held_out_documents_never_reach_training(tmp_path: Path, streaming: bool) -> None:
    """Over three epochs the training batches hold every training document's letter and no
    held-out one; the held-out batches hold only held-out letters, all of them, the same at
    every call."""
    texts = _letter_docs(40)
    seed, fraction = 11, 0.25
    held = {LETTERS[i] for i in range(40) if is_held_out(i, seed, fraction)}
    assert 4 <= len(held) <= 16
    source = _write_jsonl(tmp_path / "d.jsonl", texts)
    spec = _spec(source, eval_fraction=fraction, streaming=streaming, shuffle_documents=6,
                 shuffle_windows=5)  # fmt: skip
    data = build_data(spec, BYTES, seq_len=8, seed=seed)
    epoch = sum(len(t) + 1 for i, t in enumerate(texts) if LETTERS[i] not in held)
    training = [data.batch(s, 4, 0, 1) for s in range(3 * epoch // 32)]
    assert _letters(training) == set(LETTERS[:40]) - held
    evaluation = data.eval_batches(2, 0, 1, 1000)
    assert _letters(evaluation) == held
    again = data.eval_batches(2, 0, 1, 1000)
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(evaluation, again, strict=True))
    halves = [data.eval_batches(2, r, 2, 1000) for r in range(2)]
    for whole, a, b in zip(evaluation, *halves, strict=True):
        assert torch.equal(torch.cat([a.inputs, b.inputs]), whole.inputs)
    assert len(data.eval_batches(2, 0, 1, 3)) == 3
    # The held-out stream in natural order, each document followed by the end of sequence.
    stream = _stitch([w for b in evaluation for w in torch.cat([b.inputs, b.targets[:, -1:]], 1)])
    expected = [t for i, x in enumerate(texts) if LETTERS[i] in held for t in [*x.encode(), EOS]]
    assert stream == expected[: len(stream)]
    assert len(expected) - len(stream) < 2 * 8, "only windows that fill no batch are left"


def test_eval_data_is_a_separate_split(tmp_path: Path) -> None:
    texts = _letter_docs(30)
    train = _write_jsonl(tmp_path / "train.jsonl", texts[:20])
    valid = _write_parquet(tmp_path / "valid.parquet", texts[20:])
    data = build_data(_spec(train, eval_data=str(valid)), BYTES, seq_len=4, seed=0)
    assert _letters([data.batch(s, 4, 0, 1) for s in range(20)]) == set(LETTERS[:20])
    assert _letters(data.eval_batches(2, 0, 1, 100)) == set(LETTERS[20:30])
    assert "valid.parquet" in data.describe()


def test_describe_names_source_counts_share_and_tokenizer() -> None:
    data = build_data(DataSpec("pydoc", eval_fraction=0.1), BYTES, seq_len=64, seed=0)
    held = sum(is_held_out(i, 0, 0.1) for i in range(79))
    line = data.describe()
    assert line.startswith("data pydoc (79 topics of pydoc_data")
    assert f"{79 - held} training documents" in line
    assert f"held out {held} of 79 documents" in line
    assert "tokenizer bytes (vocab 256, eos id 0)" in line
    assert "\n" not in line


def test_streaming_left_to_the_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``streaming=None`` loads an input up to the threshold and streams a larger one."""
    source = _write_jsonl(tmp_path / "d.jsonl", _letter_docs(10))
    assert "1 json file, 0.0 MB, loaded" in _build(source).describe()
    monkeypatch.setattr(
        "hp_train.data.documents.STREAMING_THRESHOLD_BYTES", source.stat().st_size - 1
    )
    line = _build(source).describe()
    assert "1 json file, 0.0 MB, streamed): documents and tokens counted as they are read" in line


def test_builtin_sources_are_train_data() -> None:
    """The corpus (a file a document) and synthetic runs serve byte-sized tokens."""
    corpus = build_data(DataSpec("corpus"), BYTES, seq_len=16, seed=0)
    b = corpus.batch(0, 4, 0, 1)
    assert b.inputs.shape == (4, 16)
    assert int(b.inputs.max()) < 256
    assert "files of the hp-* packages" in corpus.describe()
    synthetic = build_data(DataSpec("synthetic", eval_fraction=0.1), BYTES, seq_len=16, seed=0)
    s = synthetic.batch(3, 4, 0, 1)
    assert torch.equal(s.targets[:, :-1], s.inputs[:, 1:])
    assert int(s.inputs.max()) < 256
    assert len(synthetic.eval_batches(4, 0, 1, 2)) == 2


# --- bad inputs ------------------------------------------------------------------------------


def test_bad_specs_are_named(tmp_path: Path) -> None:
    hub = r"'roneneldan/TinyStories' is neither a built-in .* nor a local file or folder; nothing"
    with pytest.raises(ConfigError, match=hub + r" is downloaded"):
        DataSpec("roneneldan/TinyStories")
    with pytest.raises(ConfigError, match=r"eval_data 'wikitext' is not a local file"):
        DataSpec("pydoc", eval_data="wikitext")
    with pytest.raises(ConfigError, match=r"eval_fraction is the share .* got 1.0"):
        DataSpec("pydoc", eval_fraction=1.0)
    with pytest.raises(ConfigError, match=r"eval_fraction=0.1 .* eval_data=.*choose one"):
        DataSpec("pydoc", eval_fraction=0.1, eval_data=str(tmp_path))
    with pytest.raises(ConfigError, match=r"shuffle_windows must be a positive integer"):
        DataSpec("pydoc", shuffle_windows=0)


def _build(source: Path | str, **kw: Any) -> TrainData:
    return build_data(_spec(source, **kw), BYTES, seq_len=8, seed=0)


def test_bad_inputs_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"'.*empty' holds no non-empty .*1 other files"):
        _build(empty)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write_jsonl(mixed / "a.jsonl", ["x"])
    _write_parquet(mixed / "b.parquet", ["y"])
    (mixed / "c.txt").write_text("z")
    with pytest.raises(ConfigError, match=r"mixed' mixes kinds of files \(1 json, 1 parquet, "
                                          r"1 text\)"):  # fmt: skip
        _build(mixed)
    csv = tmp_path / "rows.csv"
    csv.write_text("text\nx\n")
    with pytest.raises(ConfigError, match=r"suffix '.csv'"):
        _build(csv)
    rows = _write_jsonl(tmp_path / "body.jsonl", ["some text"], field="body")
    for streaming in (False, True):
        with pytest.raises(
            ConfigError, match=r"no field 'text' .* fields present: \['body', 'n'\]"
        ):
            _build(rows, streaming=streaming)
    txt = tmp_path / "t.txt"
    txt.write_text("text")
    with pytest.raises(ConfigError, match=r"text_field='body' .* text files"):
        _build(txt, text_field="body")
    nulls = _write_parquet(tmp_path / "nulls.parquet", ["a", None])
    with pytest.raises(ConfigError, match=r"row 1 of .*nulls.parquet has null in its text field"):
        _build(nulls)
    with pytest.raises(ConfigError, match=r"streaming reads local files; the built-in source"):
        _build("pydoc", streaming=True)
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)
    with pytest.raises(ConfigError, match=r"'pydoc' needs the documentation topics .*pydoc_data"):
        _build("pydoc")


def test_too_little_data_is_named_with_counts(tmp_path: Path) -> None:
    small = _write_jsonl(tmp_path / "small.jsonl", ["abc", "", "de"])
    data = _build(small)
    with pytest.raises(ConfigError, match=r"has 2 documents, 7 tokens .* global_batch=4 x "
                                          r"seq_len=8 needs 33"):  # fmt: skip
        data.batch(0, 4, 0, 1)
    streamed = _build(small, streaming=True)
    with pytest.raises(ConfigError, match=r"has 2 documents, 7 tokens .* needs 33"):
        streamed.batch(0, 4, 0, 1)
    blank = _write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(ConfigError, match=r"no training documents in .*blank.jsonl: its 2 rows"):
        _build(blank)
    with pytest.raises(ConfigError, match=r"no held-out split to validate on"):
        data.eval_batches(1, 0, 1, 1)
    few = _write_jsonl(tmp_path / "few.jsonl", _letter_docs(40))
    held = sum(is_held_out(i, 0, 0.05) for i in range(40))
    with pytest.raises(ConfigError, match=rf"held-out split of .*few.jsonl has {held} documents"):
        _build(few, eval_fraction=0.05).eval_batches(64, 0, 1, 1)


def test_held_out_rows_follow_the_seed() -> None:
    """The split is a fixed function of (row, seed, fraction): about the asked share, other
    rows for another seed, none for fraction 0."""
    rows = range(20000)
    share = np.mean([is_held_out(r, 3, 0.1) for r in rows])
    assert abs(share - 0.1) < 0.01  # binomial sd 0.0021
    assert [r for r in rows if is_held_out(r, 3, 0.1)] != [
        r for r in rows if is_held_out(r, 4, 0.1)
    ]
    assert not any(is_held_out(r, 3, 0.0) for r in rows)

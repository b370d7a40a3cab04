"""hp-train's tokenizers: the byte tokenizer, a byte-level BPE trained on the documentation
topics every CPython ships (pydoc_data), loaded back by hp-train and by transformers, and the
``python -m hp_train.data.tokenizer train`` command line (trained on the training split only)."""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics  # type: ignore[import-untyped,unused-ignore]

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hp_train.config.schema import ConfigError
from hp_train.data.loader import is_held_out
from hp_train.data.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    HFTokenizer,
    TextTokenizer,
    load_tokenizer,
    train_bpe,
)
from hp_train.data.tokenizer.cli import main

PYDOC = [str(topics[name]) for name in sorted(topics)]
SAMPLES = [
    "naïve café, Ωμέγα, 日本語 and 🎉 emoji\r\n\ttabs  and   spaces \x00 nul",
    f"a literal {EOS_TOKEN} inside a document is text",
    "",
]


# Every test runs as on a machine without network (conftest.py's offline fixture).
pytestmark = pytest.mark.usefixtures("offline")


@pytest.fixture(scope="module")
def pydoc_bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe(PYDOC, 512, tmp_path_factory.mktemp("bpe") / "tok")


def test_byte_tokenizer() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, TextTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.name) == (256, 0, "bytes")
    for text in SAMPLES:
        assert tok.encode(text) == list(text.encode("utf-8"))
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # a character cut short
    with pytest.raises(ValueError, match=r"byte token ids are 0..255, got \[256\]"):
        tok.decode([65, 256])


def test_bpe_trained_on_pydoc_round_trips_and_loads_in_transformers(pydoc_bpe: Path) -> None:
    """The asked vocabulary exactly, end of sequence id 0, every topic and odd text decoded
    back to itself, a special token's spelling encoded as text; transformers' fast tokenizer
    loads the folder and gives the same ids; training again writes the same file."""
    assert sorted(p.name for p in pydoc_bpe.iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    tok = load_tokenizer(pydoc_bpe)
    assert isinstance(tok, TextTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.eos_token) == (512, 0, EOS_TOKEN)
    total_bytes = total_ids = 0
    for text in PYDOC + SAMPLES:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.eos_id not in ids
        assert all(0 <= i < 512 for i in ids)
        total_bytes += len(text.encode())
        total_ids += len(ids)
    assert total_ids < 0.5 * total_bytes, "merges compress the text it was trained on"
    same_file = load_tokenizer(pydoc_bpe / "tokenizer.json")
    assert same_file.encode(PYDOC[5]) == tok.encode(PYDOC[5])

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    for loaded in (
        PreTrainedTokenizerFast.from_pretrained(str(pydoc_bpe)),
        AutoTokenizer.from_pretrained(str(pydoc_bpe)),
    ):
        assert loaded.eos_token == EOS_TOKEN
        assert loaded.eos_token_id == 0
        assert len(loaded) == 512
        for text in PYDOC[:10]:
            assert loaded.encode(text, add_special_tokens=False) == tok.encode(text)
            assert loaded.decode(tok.encode(text)) == text
    again = train_bpe(PYDOC, 512, pydoc_bpe.parent / "again")
    assert (again / "tokenizer.json").read_bytes() == (pydoc_bpe / "tokenizer.json").read_bytes()


def test_load_finds_the_end_of_sequence(tmp_path: Path) -> None:
    """From tokenizer_config.json (a string or an AddedToken dict), else from a special token
    of a known name; none: an error naming what to write."""
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.add_tokens(list(string.ascii_lowercase))
    raw.add_special_tokens(["<s>", "</s>", "<pad>"])
    plain = tmp_path / "plain"
    plain.mkdir()
    raw.save(str(plain / "tokenizer.json"))
    found = load_tokenizer(plain)
    assert isinstance(found, HFTokenizer)
    assert found.eos_token == "</s>"
    assert found.eos_id == raw.token_to_id("</s>")
    assert found.vocab_size == 29
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert load_tokenizer(plain).eos_id == raw.token_to_id("<pad>")
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ConfigError, match=r"has no token '<nope>' to end sequences with"):
        load_tokenizer(plain)
    bare = Tokenizer(models.BPE())
    bare.add_special_tokens(["<unk>"])
    lone = tmp_path / "lone.json"
    bare.save(str(lone))
    with pytest.raises(ConfigError, match=r"names no end-of-sequence token: write .*eos_token.*"
                                          r"special tokens present: \['<unk>'\]"):  # fmt: skip
        load_tokenizer(lone)


def test_bad_tokenizer_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer 'gpt2' is not a local file or folder; "
                                          r"nothing is downloaded"):  # fmt: skip
        load_tokenizer("gpt2")
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"holds no tokenizer.json \(it holds \['vocab.json'\]"):
        load_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match=r"vocab.json is not a tokenizers tokenizer.json"):
        load_tokenizer(tmp_path / "vocab.json")
    with pytest.raises(ConfigError, match=r"vocab_size=256 is too small .* >= 257"):
        train_bpe(PYDOC, 256, tmp_path / "small")
    with pytest.raises(ConfigError, match=r"hold pairs for only \d+ tokens, fewer than "
                                          r"vocab_size=5000"):  # fmt: skip
        train_bpe(["a short text", "and another"], 5000, tmp_path / "big")
    with pytest.raises(ConfigError, match=r"no documents to train a tokenizer on"):
        train_bpe([], 300, tmp_path / "none")


SEED, FRACTION = 1, 0.3
HELD_OUT_WORD = "nopqrs"  # letters no training document has


def _split_source(tmp_path: Path) -> tuple[Path, list[int]]:
    """30 rows: held-out ones repeat a word of the letters n..s; training ones use a..m."""
    rows = []
    held = [i for i in range(30) if is_held_out(i, SEED, FRACTION)]
    for i in range(30):
        if i in held:
            text = f"{HELD_OUT_WORD} " * 300
        else:
            words = ["".join("abcdefghijklm"[(i * 7 + k * j) % 13] for j in range(5))
                     for k in range(40)]  # fmt: skip
            text = " ".join(words * 3)
        rows.append(json.dumps({"body": text}))
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path, held


def test_cli_trains_on_the_training_split_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``train`` with the run's eval fraction and seed: a tokenizer of the asked size whose
    merges never join letters that only held-out documents have (they are frequent enough to
    be the first merges, were those documents seen)."""
    source, held = _split_source(tmp_path)
    assert 4 <= len(held) <= 15
    out = tmp_path / "tok"
    argv = ["train", "--data", str(source), "--text-field", "body", "--vocab-size", "300",
            "--out", str(out), "--eval-fraction", str(FRACTION), "--seed", str(SEED)]  # fmt: skip
    assert main(argv) == 0
    assert f"wrote {out}: byte-level BPE, vocab 300" in capsys.readouterr().out
    tok = load_tokenizer(out)
    assert tok.vocab_size == 300
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab()
    merged = [t for t in vocab if len(t) > 1 and t != EOS_TOKEN]
    assert merged, "merges were learned"
    assert not [t for t in merged if set(t) & set(HELD_OUT_WORD)]


BAD_INPUTS = {
    "hub-name": (
        ["--data", "roneneldan/TinyStories", "--vocab-size", "300"],
        "nothing is downloaded",
    ),
    "small-vocab": (["--data", "pydoc", "--vocab-size", "100"], "vocab_size=100 is too small"),
    "missing-field": (
        ["--data", "{rows}", "--vocab-size", "300"],
        "no field 'text' in its rows; fields present: ['body']",
    ),
    "no-text": (["--data", "synthetic", "--vocab-size", "300"], "'synthetic' source is token ids"),
    "fraction": (["--data", "pydoc", "--vocab-size", "300", "--eval-fraction", "1.5"], "got 1.5"),
}


@pytest.mark.parametrize(("args", "message"), BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_cli_bad_input_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "text"}\n')
    argv = ["train", *(a.replace("{rows}", str(rows)) for a in args), "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m hp_train.data.tokenizer train: error: ")
    assert message in err


def test_module_entry_point(tmp_path: Path) -> None:
    """``python -m hp_train.data.tokenizer train`` in a subprocess, end to end, and its exit 2."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    command = [sys.executable, "-m", "hp_train.data.tokenizer", "train", "--data", "pydoc"]
    done = subprocess.run(
        [*command, "--vocab-size", "300", "--out", str(tmp_path / "t")],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert load_tokenizer(tmp_path / "t").vocab_size == 300
    bad = subprocess.run(
        [*command, "--vocab-size", "3", "--out", str(tmp_path / "u")],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "vocab_size=3 is too small" in bad.stderr
    assert not (tmp_path / "u").exists()

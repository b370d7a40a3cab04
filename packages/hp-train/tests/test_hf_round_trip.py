"""Hugging Face round trips that keep everything: ``--init-from`` a folder holding a tiny random
Qwen3 model and a small BPE tokenizer (trained here with ``tokenizers``, saved through
transformers' ``PreTrainedTokenizerFast.save_pretrained``), two steps at world 2 (TP 2)
through the command line, then ``python -m hp_train.checkpoint.export``:

* the run trains with the folder's tokenizer and its log says so; ``--tokenizer bytes`` keeps
  bytes; a tokenizer larger than the checkpoint's vocabulary is an error naming both sizes;
* the exported ``config.json`` is the source's, key for key; only ``dtype`` follows the
  export's dtype (the one key the architecture lets change in a fine-tune: the weights'
  shapes, rotary settings, positions and special tokens are the source's);
  ``generation_config.json`` is the source's;
* ``AutoTokenizer.from_pretrained(export)`` encodes as the source tokenizer does;
* ``AutoModelForCausalLM.from_pretrained(export)`` gives the held-out loss hp-train reported
  (test_init_from_cli.py's tolerance);
* a run without ``--init-from`` (bytes) exports a tokenizer AutoTokenizer loads, that encodes
  text to its UTF-8 bytes, and its ``eos_token_id``; ``max_position_embeddings`` is the model's
  ``max_seq_len``, not the training sequence length.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hp_testing import run_on_ranks
from hp_train.checkpoint.export import main as export_main
from hp_train.checkpoint.hf.carry import Carried, checkpoint_files
from hp_train.checkpoint.hf.export_config import export_config_dict
from hp_train.config.cli import MODEL_PRESETS, parse
from hp_train.config.schema import ConfigError, ModelConfig
from hp_train.data.loader import DataSpec, build_data
from hp_train.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from hp_train.data.tokenizer.hf_folder import special_token_ids, tokenizer_files
from hp_train.runtime import init_runtime
from hp_train.trainer import run_tokenizer, train

SEQ, BATCH, STEPS = 16, 4, 2
# test_init_from_cli.py's bound: fp32 sums in another order under TP.
LOSS_TOLERANCE = 5e-6
# The source's vocabulary is larger than its tokenizer's, as in real checkpoints.
VOCAB, TOKENIZER_VOCAB, MAX_POSITIONS = 320, 300, 256
ARGS = [
    "--tp", "2", "--optimizer", "adamw", "--steps", str(STEPS), "--checkpoint-every",
    str(STEPS), "--data", "pydoc", "--eval-fraction", "0.1", "--eval-every", str(STEPS),
    "--eval-batches", "2", "--seq-len", str(SEQ), "--global-batch", str(BATCH), "--quiet",
]  # fmt: skip
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # naïve café 日本語 🎉",
    "  spaces,\ttabs and a literal </s> in text\r\n",
]
# Keys of config.json an export may change for a fine-tune: the weights' dtype alone.
CHANGED_BY_EXPORT = {"dtype"}


def _bpe(vocab: int) -> Any:
    """A byte-level BPE with ``<s>`` (0) and ``</s>`` (1), as a transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([t * 20 for t in TEXTS] + ["hello world " * 50], trainer)
    assert tok.get_vocab_size() == vocab
    wrapped: Any = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    return wrapped


def _source(folder: Path, tokenizer_vocab: int = TOKENIZER_VOCAB) -> Path:
    """A tiny random Qwen3 (explicit head_dim, q/k norms) with its tokenizer beside it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        bos_token_id=0,
        eos_token_id=1,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    _bpe(tokenizer_vocab).save_pretrained(folder)
    return folder


def _run(argv: list[str]) -> dict[str, Any]:
    runtime = init_runtime("cpu", threads=1)
    model, parallel, config, options, _ = parse(argv, dist.get_world_size())
    summary = train(model, parallel, config, options, runtime)
    return {"eval": summary.eval_losses, "tokenizer": config.tokenizer}


def _json(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def _hf_loss(folder: Path, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(inputs).logits
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.fixture(scope="module")
def init_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The world-2 run ``--init-from`` the source, exported in float32 and bfloat16."""
    root = tmp_path_factory.mktemp("round_trip")
    source = _source(root / "qwen3")
    out = root / "run"
    result = run_on_ranks(2, _run, [*ARGS, "--init-from", str(source), "--out", str(out)])[0]
    exports = {}
    for dtype in ("float32", "bfloat16"):
        exports[dtype] = root / f"export_{dtype}"
        argv = ["--checkpoint", str(out / "checkpoints"), "--out", str(exports[dtype])]
        assert export_main([*argv, "--dtype", dtype]) == 0
    return {"source": source, "out": out, "result": result, "exports": exports, "root": root}


@pytest.mark.multiprocess
def test_init_from_trains_with_the_folders_tokenizer_and_says_so(init_run: dict[str, Any]) -> None:
    source, out = init_run["source"], init_run["out"]
    assert init_run["result"]["tokenizer"] == str(source)
    log = (out / "logs" / "rank_0.log").read_text()
    assert f"tokenizer {source} (from --init-from) (vocab {TOKENIZER_VOCAB}, eos id 1)" in log


@pytest.mark.multiprocess
def test_export_keeps_the_source_config_and_generation_config(init_run: dict[str, Any]) -> None:
    source, exports = init_run["source"], init_run["exports"]
    want = _json(source / "config.json")
    assert want["max_position_embeddings"] == MAX_POSITIONS  # what main rewrote to SEQ
    assert (want["bos_token_id"], want["eos_token_id"]) == (0, 1)
    assert _json(exports["float32"] / "config.json") == want  # fp32 in, fp32 out
    got = _json(exports["bfloat16"] / "config.json")
    assert {k for k in want.keys() | got.keys() if want.get(k) != got.get(k)} == CHANGED_BY_EXPORT
    assert got["dtype"] == "bfloat16"
    for folder in exports.values():
        assert _json(folder / "generation_config.json") == _json(source / "generation_config.json")


@pytest.mark.multiprocess
def test_exported_tokenizer_encodes_as_the_source(init_run: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(init_run["source"])
    got = AutoTokenizer.from_pretrained(init_run["exports"]["float32"])
    for text in TEXTS:
        assert got.encode(text) == want.encode(text)
        assert got(text, add_special_tokens=False)["input_ids"] == want.encode(
            text, add_special_tokens=False
        )
    assert (got.bos_token_id, got.eos_token_id) == (0, 1)


@pytest.mark.multiprocess
def test_exported_model_gives_the_loss_hp_train_reported(init_run: dict[str, Any]) -> None:
    data = build_data(
        DataSpec(source="pydoc", eval_fraction=0.1),
        load_tokenizer(init_run["source"]),
        seq_len=SEQ,
        seed=0,
    )
    held_out = data.eval_batches(BATCH, 0, 1, 2)
    exported = init_run["exports"]["float32"]
    want = sum(_hf_loss(exported, b.inputs, b.targets) for b in held_out) / len(held_out)
    assert abs(init_run["result"]["eval"][STEPS - 1] - want) <= LOSS_TOLERANCE
    # Trained: not the source's weights.
    source_loss = _hf_loss(init_run["source"], held_out[0].inputs, held_out[0].targets)
    assert abs(source_loss - want) > 1e-3


@pytest.mark.multiprocess
def test_export_refuses_a_carried_config_that_does_not_fit(
    init_run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    steps = sorted((init_run["out"] / "checkpoints").glob("step_*"))
    step = init_run["root"] / "edited_step"
    shutil.copytree(steps[-1], step)
    record = _json(step / "hf_export.json")
    # Not a key of the weights' shapes (those follow the model): one the model must match.
    record["config"]["rms_norm_eps"] = 1e-3
    (step / "hf_export.json").write_text(json.dumps(record))
    assert export_main(["--checkpoint", str(step), "--out", str(step.parent / "bad")]) == 2
    err = capsys.readouterr().err
    assert "does not describe the checkpoint's model" in err
    assert "'norm_eps': (0.001, 1e-06)" in err
    assert not (step.parent / "bad").exists()


@pytest.mark.multiprocess
def test_run_without_init_from_exports_its_byte_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out, exported = tmp_path / "run", tmp_path / "export"
    run_on_ranks(2, _run, [*ARGS, "--out", str(out)])
    assert export_main(["--checkpoint", str(out / "checkpoints"), "--out", str(exported)]) == 0
    config = _json(exported / "config.json")
    assert config["max_position_embeddings"] == MODEL_PRESETS["tiny"].max_seq_len != SEQ
    assert config["eos_token_id"] == 0
    assert "bos_token_id" not in config
    tok = AutoTokenizer.from_pretrained(exported)
    for text in [*TEXTS, "nul \x00 inside", ""]:
        assert tok.encode(text) == list(text.encode("utf-8"))
        assert tok.decode(list(text.encode("utf-8"))) == text
    assert tok.eos_token_id == 0


def test_bpe_folder_and_bare_file_write_folders_autotokenizer_loads(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    trained = train_bpe([t * 10 for t in TEXTS], 280, tmp_path / "bpe")
    bare = tmp_path / "bare" / "tokenizer.json"
    bare.parent.mkdir()
    shutil.copy(trained / "tokenizer.json", bare)
    want = AutoTokenizer.from_pretrained(trained)
    for given in (trained, bare):
        folder = tmp_path / f"written_{given.name}"
        folder.mkdir()
        for name, text in tokenizer_files(load_tokenizer(given)).items():
            (folder / name).write_text(text, encoding="utf-8")
        got = AutoTokenizer.from_pretrained(folder)
        assert [got.encode(t) for t in TEXTS] == [want.encode(t) for t in TEXTS]
        assert got.eos_token == "<|endoftext|>"
        assert got.eos_token_id == 0


def test_special_token_ids_are_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    _bpe(TOKENIZER_VOCAB).save_pretrained(folder)
    want = AutoTokenizer.from_pretrained(folder)
    assert special_token_ids(load_tokenizer(folder)) == {
        "bos_token_id": want.bos_token_id,
        "eos_token_id": want.eos_token_id,
    }
    assert special_token_ids(ByteTokenizer()) == {"eos_token_id": 0}


def test_tokenizer_choice_for_init_from(tmp_path: Path) -> None:
    source = _source(tmp_path / "qwen3")
    _, _, config, _, _ = parse(["--init-from", str(source)], 1)
    assert config.tokenizer == str(source)
    tokenizer = run_tokenizer(config, source)
    assert tokenizer.name == f"{source} (from --init-from)"
    assert tokenizer.vocab_size == TOKENIZER_VOCAB
    _, _, config, _, _ = parse(["--init-from", str(source), "--tokenizer", "bytes"], 1)
    assert isinstance(run_tokenizer(config, source), ByteTokenizer)
    # Without --init-from, "bytes" is the default's tokenizer and vocabulary.
    model, _, config, _, _ = parse(["--tokenizer", "bytes"], 1)
    assert isinstance(run_tokenizer(config), ByteTokenizer)
    assert model.vocab_size == MODEL_PRESETS["tiny"].vocab_size


def test_init_from_tokenizer_errors(tmp_path: Path) -> None:
    big = _source(tmp_path / "big", tokenizer_vocab=VOCAB + 40)
    with pytest.raises(ConfigError, match=rf"has {VOCAB + 40} tokens .* vocab_size {VOCAB}"):
        parse(["--init-from", str(big)], 1)
    # A tokenizer hp-train cannot read is not silently replaced by bytes.
    slow = tmp_path / "slow"
    slow.mkdir()
    shutil.copy(big / "config.json", slow / "config.json")
    (slow / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    with pytest.raises(ConfigError, match=r"tokenizer\.model\) but no tokenizer\.json"):
        parse(["--init-from", str(slow)], 1)
    # A folder with no tokenizer at all trains on bytes, as before.
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(big / "config.json", bare / "config.json")
    _, _, config, _, _ = parse(["--init-from", str(bare)], 1)
    assert config.tokenizer is None


def _carried(config: dict[str, Any] | None, *, from_source: bool) -> Carried:
    return Carried(
        source="/src" if config is not None else None,
        config=config,
        generation_config=None,
        tokenizer_name="tok",
        tokenizer_from_source=from_source,
        tokenizer_files={},
        special_token_ids={"eos_token_id": 7},
    )


def test_export_config_takes_only_what_the_model_changed() -> None:
    source = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "custom_key": [1, 2],
    }
    # The model's vocabulary was resized to 320; it trained on sequences of 16.
    model = ModelConfig(
        vocab_size=320, dim=32, ffn_dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=16
    )
    got = export_config_dict(model, torch.bfloat16, _carried(source, from_source=True))
    assert got == {**source, "vocab_size": 320, "torch_dtype": "bfloat16"}
    # Another tokenizer than the source's: its ids; the source's pad id named its token.
    got = export_config_dict(model, torch.float32, _carried(source, from_source=False))
    want = {k: v for k, v in source.items() if k not in ("bos_token_id", "pad_token_id")}
    assert got == {**want, "vocab_size": 320, "eos_token_id": 7}


def test_checkpoints_of_a_run_carry_the_files_read_at_its_first_save(tmp_path: Path) -> None:
    source = _source(tmp_path / "qwen3")
    tokenizer = load_tokenizer(source)
    first = checkpoint_files(source, tokenizer)
    (source / "config.json").write_text(json.dumps({"edited": True}))
    assert checkpoint_files(source, tokenizer) == first
    record = json.loads(checkpoint_files(source, load_tokenizer(source))["hf_export.json"])
    assert record["config"] == {"edited": True}  # another run reads the folder anew

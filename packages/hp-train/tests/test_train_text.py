"""The main job on real text, as ``python -m hp_train`` parses it: a byte-level BPE trained on
CPython's documentation topics, a tiny model trained 200 steps with its held-out loss falling;
a run on a user's JSON Lines file resumed from a checkpoint equal to the uninterrupted run
(weights, losses and the data loader's position); the resolved configuration written beside
the metrics and into every checkpoint; a resume with a configuration it cannot continue refused
by name."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_testing import run_on_ranks
from hp_train.config.cli import parse
from hp_train.config.schema import ConfigError
from hp_train.config.toml_file import CONFIG_FILE
from hp_train.data.documents import pydoc_documents
from hp_train.data.loader import DataSpec, training_texts
from hp_train.data.tokenizer import train_bpe
from hp_train.observe.metrics import read_metrics
from hp_train.observe.run_record import RECORD_FILE
from hp_train.runtime import init_runtime
from hp_train.trainer import DATA_STATE_FILE, train

TINY = ["--model", "tiny", "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--ffn-dim", "128"]
# Held-out loss of the tiny model on pydoc (a tenth of the topics held out) with a 512-token
# BPE, AdamW, seq 64, global batch 8, world 2: measured 5.28 after 25 steps and 3.75 after 200
# (ln 512 = 6.24 is the uniform guess); the bounds leave room for another CPU's rounding, not
# for a model that stopped learning.
EVAL_BOUND_AFTER_200 = 4.0
EVAL_DROP_AT_LEAST = 1.2


def _run(argv: list[str]) -> dict[str, Any]:
    runtime = init_runtime("cpu", threads=1)
    model, parallel, config, options, _ = parse(argv, dist.get_world_size())
    try:
        summary = train(model, parallel, config, options, runtime)
    except ConfigError as exc:
        return {"error": str(exc)}
    return {"losses": summary.losses, "eval": summary.eval_losses}


@pytest.fixture(scope="module")
def pydoc_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bpe")
    texts = training_texts(DataSpec(source="pydoc", eval_fraction=0.1), seed=0)
    return train_bpe(texts, 512, out)


@pytest.mark.multiprocess
def test_held_out_loss_falls_on_shipped_text_with_a_trained_bpe(
    pydoc_tokenizer: Path, tmp_path: Path
) -> None:
    argv = [
        *TINY, "--data", "pydoc", "--tokenizer", str(pydoc_tokenizer), "--steps", "200",
        "--seq-len", "64", "--global-batch", "8", "--optimizer", "adamw", "--warmup-steps",
        "10", "--eval-fraction", "0.1", "--eval-every", "25", "--eval-batches", "4", "--quiet",
        "--out", str(tmp_path),
    ]  # fmt: skip
    result = run_on_ranks(2, _run, argv, timeout=300)[0]
    evals = result["eval"]
    assert sorted(evals) == [24, 49, 74, 99, 124, 149, 174, 199]
    first, last = evals[24], evals[199]
    assert last < EVAL_BOUND_AFTER_200, evals
    assert first - last > EVAL_DROP_AT_LEAST, evals
    records = {int(str(r["step"])): r for r in read_metrics(tmp_path / "metrics.jsonl")}
    assert records[200]["eval_loss"] == last  # metrics.jsonl counts steps from 1
    assert records[200]["eval_perplexity"] == pytest.approx(2.718281828459045**last)


def _jsonl(folder: Path) -> Path:
    """A user's JSON Lines file: pydoc's topics as records with a "body" field."""
    path = folder / "docs.jsonl"
    lines = [json.dumps({"id": i, "body": text}) for i, text in enumerate(pydoc_documents().texts)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _resume_argv(data: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    return [
        *TINY, "--data", str(data), "--text-field", "body", "--tokenizer", str(tokenizer),
        "--steps", "8", "--checkpoint-every", "4", "--seq-len", "32", "--global-batch", "4",
        "--deterministic", "--quiet", "--out", str(out), *extra,
    ]  # fmt: skip


@pytest.mark.multiprocess
def test_resumed_run_on_user_data_equals_the_uninterrupted_one(
    pydoc_tokenizer: Path, tmp_path: Path
) -> None:
    data = _jsonl(tmp_path)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    uninterrupted = run_on_ranks(2, _run, _resume_argv(data, pydoc_tokenizer, whole))[0]
    # The interrupted run: the same command stopped after its step-4 checkpoint (its later
    # checkpoint and metrics removed), then resumed.
    run_on_ranks(2, _run, _resume_argv(data, pydoc_tokenizer, cut))
    shutil.rmtree(cut / "checkpoints" / "step_000008")
    kept = [r for r in read_metrics(cut / "metrics.jsonl") if int(str(r["step"])) < 4]
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    resumed = run_on_ranks(2, _run, _resume_argv(data, pydoc_tokenizer, cut, "--resume"))[0]
    assert sorted(resumed["losses"]) == [4, 5, 6, 7]
    for step in range(4, 8):
        assert resumed["losses"][step] == uninterrupted["losses"][step], step
    for name in ("step_000004", "step_000008"):
        a = json.loads((whole / "checkpoints" / name / DATA_STATE_FILE).read_text())
        b = json.loads((cut / "checkpoints" / name / DATA_STATE_FILE).read_text())
        assert a == b, name
    first = json.loads((whole / "checkpoints" / "step_000004" / DATA_STATE_FILE).read_text())
    last = json.loads((whole / "checkpoints" / "step_000008" / DATA_STATE_FILE).read_text())
    assert first != last, "the data position must advance between checkpoints"
    final_whole = torch.load(_model_file(whole), weights_only=True)
    final_cut = torch.load(_model_file(cut), weights_only=True)
    assert final_whole.keys() == final_cut.keys()
    for key in final_whole:
        assert torch.equal(final_whole[key], final_cut[key]), key


def _model_file(out: Path) -> Path:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = out / "final.pt"
    dcp_to_torch_save(str(out / "checkpoints" / "step_000008"), str(target))
    state = torch.load(target, weights_only=True)
    torch.save(dict(state["model"]), target)
    return target


@pytest.mark.multiprocess
def test_configuration_is_written_and_an_incompatible_resume_is_refused(
    pydoc_tokenizer: Path, tmp_path: Path
) -> None:
    data = _jsonl(tmp_path)
    out = tmp_path / "run"
    run_on_ranks(2, _run, _resume_argv(data, pydoc_tokenizer, out, "--tp", "2"))
    written = tomllib.loads((out / CONFIG_FILE).read_text())
    assert written["data"]["data"] == str(data)
    assert written["parallel"]["tp"] == 2
    assert written["training"]["steps"] == 8
    checkpoint = out / "checkpoints" / "step_000008"
    assert tomllib.loads((checkpoint / CONFIG_FILE).read_text()) == written
    record = json.loads((checkpoint / RECORD_FILE).read_text())
    assert record["model"]["dim"] == 64
    assert record["training"]["text_field"] == "body"
    # The written file repeats the run: parsed again, it gives the same configuration.
    again = parse(["--config", str(out / CONFIG_FILE)], 2)
    assert again[:3] == parse(_resume_argv(data, pydoc_tokenizer, out, "--tp", "2"), 2)[:3]
    # Longer and on another layout: a compatible resume.
    longer = _resume_argv(data, pydoc_tokenizer, out, "--resume", "--steps", "10")
    assert sorted(run_on_ranks(2, _run, longer)[0]["losses"]) == [8, 9]
    # Another learning rate and sequence length: refused, naming both.
    other = _resume_argv(data, pydoc_tokenizer, out, "--resume", "--lr", "0.01", "--steps", "12")
    other[other.index("--seq-len") + 1] = "16"
    error = run_on_ranks(2, _run, other)[0]["error"]
    assert "training.lr: 0.003 -> 0.01" in error
    assert "training.seq_len: 32 -> 16" in error
    assert "step_000010" in error  # the resumed run to 10 checkpointed its last step

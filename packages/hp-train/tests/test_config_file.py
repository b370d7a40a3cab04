"""``--config run.toml``: every option has a key, flags override the file, bad files are named;
the resolved options written by a run read back to the same run; the record a checkpoint
keeps names what a resume cannot change."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from hp_train.config.cli import _TABLES, _parser, parse, parse_args, resolved_options
from hp_train.config.schema import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from hp_train.config.toml_file import dump_toml, option_tables
from hp_train.observe.profiling import step_list_option
from hp_train.observe.run_record import resume_conflicts, run_record


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def _sample(action: argparse.Action) -> object:
    """A value for ``action`` other than its default (so the test sees the file win)."""
    if isinstance(action, argparse._StoreTrueAction):
        return True
    if action.choices is not None:
        others = [c for c in action.choices if c != action.default]
        return others[0]
    if action.type is int:
        return 3
    if action.type is float:
        return 0.25
    if action.type is step_list_option:
        return "2-3"
    return "some/path"


def test_every_option_has_a_key_in_its_table(tmp_path: Path) -> None:
    parser = _parser()
    tables = option_tables(parser, _TABLES)
    keys = {key for t in tables for key in t.actions}
    options = {a.dest for a in parser._actions} - {"help", "config"}
    assert keys == options, "an option of the command line has no configuration key"
    body: dict[str, dict[str, object]] = {}
    for table in tables:
        body[table.name] = {k: _sample(a) for k, a in table.actions.items()}
    args = parse_args(["--config", str(_write(tmp_path, dump_toml(body)))])
    for table in tables:
        for key, value in body[table.name].items():
            got = getattr(args, key)
            assert (str(got) if isinstance(got, Path) else got) == value, key


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_peak_tflops_must_be_a_finite_positive_number(value: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"--peak-tflops must be a number .* got {value}"):
        parse(["--peak-tflops", value], world_size=1)
    path = _write(tmp_path, f"[run]\npeak_tflops = {value}\n")
    with pytest.raises(ConfigError, match="--peak-tflops must be"):
        parse(["--config", str(path)], world_size=1)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[training]\nsteps = 7\nlr = 0.5\n[parallel]\ntp = 2\n")
    args = parse_args(["--config", str(path), "--steps", "9"])
    assert (args.steps, args.lr, args.tp) == (9, 0.5, 2)
    _, parallel, config, _, _ = parse(["--config", str(path)], world_size=4)
    assert (config.steps, config.lr, parallel.tp, parallel.dp_shard) == (7, 0.5, 2, 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[training]\nstep = 3\n", "unknown key 'step' in [training]; did you mean 'steps'"),
        ("[model]\nsteps = 3\n", "'steps' belongs in [training], not [model]"),
        ("steps = 3\n", "'steps' is outside any table (put it in [training])"),
        ("[train]\nsteps = 3\n", "unknown table [train]"),
        ("[training]\nsteps = 'many'\n", "[training] steps must be an integer, got 'many'"),
        ("[training]\noptimizer = 'sgd'\n", "[training] optimizer must be one of"),
        ("[run]\nquiet = 1\n", "[run] quiet must be true or false"),
        ("[training\n", "is not valid TOML"),
    ],
)
def test_bad_files_are_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        parse_args(["--config", str(_write(tmp_path, text))])
    assert message in str(info.value)


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(["--config", str(tmp_path / "absent.toml")])


def test_resolved_options_read_back_to_the_same_run(tmp_path: Path) -> None:
    argv = ["--tp", "2", "--steps", "11", "--data", "pydoc", "--eval-every", "5"]
    argv += ["--eval-fraction", "0.1"]
    args = parse_args(argv)
    written = dump_toml(resolved_options(args))
    assert tomllib.loads(written) == resolved_options(args)
    again = parse_args(["--config", str(_write(tmp_path, written))])
    assert resolved_options(again) == resolved_options(args)
    assert parse(argv, 4)[:3] == parse(["--config", str(tmp_path / "run.toml")], 4)[:3]


def test_resume_conflicts_name_the_fields() -> None:
    model, parallel = ModelConfig(), ParallelConfig(1, 2, 2)
    saved = run_record(model, parallel, TrainConfig(steps=10, lr=1e-3))
    # A longer run on another layout continues the same run.
    longer = run_record(model, ParallelConfig(1, 4, 1), TrainConfig(steps=50, lr=1e-3))
    assert resume_conflicts(saved, longer) == []
    other = run_record(ModelConfig(dim=128), parallel, TrainConfig(steps=10, lr=2e-3, data="pydoc"))
    assert resume_conflicts(saved, other) == [
        "model.dim: 64 -> 128",
        "training.data: 'corpus' -> 'pydoc'",
        "training.lr: 0.001 -> 0.002",
    ]


def test_a_field_newer_than_the_checkpoint_is_its_default() -> None:
    """A checkpoint written before ``dropout`` existed ran without dropout: resuming it without
    dropout continues the run, with dropout is another run."""
    model, parallel = ModelConfig(), ParallelConfig()
    saved = run_record(model, parallel, TrainConfig())
    del saved["training"]["dropout"]
    assert resume_conflicts(saved, run_record(model, parallel, TrainConfig())) == []
    with_dropout = run_record(model, parallel, TrainConfig(dropout=0.1))
    assert resume_conflicts(saved, with_dropout) == ["training.dropout: None -> 0.1"]


def test_a_path_spelled_another_way_is_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tok").mkdir()
    monkeypatch.chdir(tmp_path)
    model, parallel = ModelConfig(), ParallelConfig()
    relative = run_record(model, parallel, TrainConfig(tokenizer="tok", data="pydoc"))
    absolute = run_record(model, parallel, TrainConfig(tokenizer=str(tmp_path / "tok")))
    assert relative["training"]["tokenizer"] == str((tmp_path / "tok").resolve())
    assert relative["training"]["data"] == "pydoc"
    assert resume_conflicts(relative, absolute) == ["training.data: 'pydoc' -> 'corpus'"]

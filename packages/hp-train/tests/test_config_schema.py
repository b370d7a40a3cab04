"""One schema for hp-train's options: every field of the config dataclasses is a flag of
``hp-train`` (with the field's default and type) and a key of its ``--config`` file, and sets
that field; a field added to a dataclass appears in both with no other edit; the dry run takes
the same model, parallel and step options; unknown and mistyped options keep their errors.

The fields are walked here with :func:`dataclasses.fields` and their declared
:class:`~hp_train.config.options.Option`, not through the generator's own list, and the
expected values are the dataclasses' defaults and the values the test sets."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args, get_type_hints

import pytest

from hp_train.config import cli
from hp_train.config.cli import _parser, parse, parse_args, resolved_options
from hp_train.config.options import OPTION_KEY, Option, config_kwargs, field_options, option
from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.dryrun import cli as dryrun_cli

CONFIGS = (ModelConfig, MoEConfig, ParallelConfig, TrainConfig)
#: Fields that hold another config dataclass: set through that class's own fields.
NESTED = {(ModelConfig, "moe"), (ModelConfig, "rope_scaling")}
#: The trainer's step options the dry run has always taken (besides model and parallel ones).
DRYRUN_TRAIN_FLAGS = (
    "--global-batch", "--seq-len", "--microbatches", "--pp-schedule", "--ac", "--swap",
    "--offload", "--optimizer", "--mixed-precision", "--precision", "--grad-reduce-dtype",
    "--fp8", "--fp8-all-gather",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Declared:
    """A field as the schema declares it."""

    owner: type[Any]
    field: dataclasses.Field[Any]
    kind: type[Any]
    option: Option

    @property
    def flag(self) -> str:
        return "--" + (self.option.flag or self.field.name).replace("_", "-")

    @property
    def key(self) -> str:
        return (self.option.flag or self.field.name).replace("-", "_")

    @property
    def id(self) -> str:
        return f"{self.owner.__name__}.{self.field.name}"


def _declared() -> list[Declared]:
    found = []
    for cls in CONFIGS:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if (cls, f.name) in NESTED:
                continue
            assert OPTION_KEY in f.metadata, f"{cls.__name__}.{f.name} declares no option"
            kinds = [k for k in get_args(hints[f.name]) or (hints[f.name],) if k is not type(None)]
            found.append(Declared(cls, f, kinds[0], f.metadata[OPTION_KEY]))
    return found


DECLARED = _declared()


def _word(d: Declared, value: object) -> str:
    assert d.option.words is not None
    return next(word for word, v in d.option.words if v == value)


def _cli_default(d: Declared) -> object:
    if d.option.unset is not None:
        return None
    return _word(d, d.field.default) if d.option.words else d.field.default


def _sample(d: Declared) -> object:
    """A valid value of the field other than its default (as the command line spells it)."""
    default: Any = d.field.default
    valid = {"n_kv_heads": 2, "ac": "full"}
    if d.field.name in valid:
        return valid[d.field.name]
    choices = d.option.choices or tuple(w for w, _ in d.option.words or ())
    if choices:
        return next(c for c in choices if c != _cli_default(d))
    if d.kind is bool:
        return True
    if d.kind is int:
        return 2 * default if default else 2
    if d.kind is float:
        return 2 * default if default else 0.5
    return "some/path"


def _expected(d: Declared, sample: object) -> object:
    return dict(d.option.words)[str(sample)] if d.option.words else sample


def _extra(d: Declared) -> list[str]:
    """Other flags the sample needs to make a valid configuration."""
    if d.owner is MoEConfig and d.field.name != "n_experts":
        return ["--experts", "4"]
    if d.field.name == "eval_every":
        return ["--eval-fraction", "0.1"]
    if d.field.name == "pp_virtual_stages":
        return ["--pp-schedule", "interleaved"]  # the schedule that takes a count
    return []


def _field_of(configs: tuple[Any, ...], d: Declared) -> object:
    model, parallel, train = configs
    target = {ModelConfig: model, MoEConfig: model.moe, ParallelConfig: parallel}
    return getattr(target.get(d.owner, train), d.field.name)


@pytest.fixture
def fake_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--tokenizer`` loads the file to size the vocabulary; a stand-in of 300 tokens."""
    from hp_train.data.tokenizer import choice

    monkeypatch.setattr(choice, "load_tokenizer", lambda path: SimpleNamespace(vocab_size=300))


def test_the_schema_declares_every_field() -> None:
    # At least the options the command line had before the schema existed.
    assert len(DECLARED) >= 52
    assert len({d.key for d in DECLARED}) == len(DECLARED), "two fields share an option"


@pytest.mark.parametrize("d", DECLARED, ids=lambda d: d.id)
def test_every_field_is_a_flag_with_its_default_and_type(d: Declared) -> None:
    parser = _parser()
    action = parser._option_string_actions.get(d.flag)
    assert action is not None, f"{d.id} has no flag {d.flag}"
    assert action.dest == d.key
    assert action.default == _cli_default(d)
    if d.kind is bool and not d.option.words:
        assert action.nargs == 0
        assert action.const is True
    else:
        assert action.type is (d.kind if d.kind in (int, float) else None)
        words = tuple(w for w, _ in d.option.words or ())
        assert tuple(action.choices or ()) == (d.option.choices or words)
    assert d.option.help in (action.help or "")


@pytest.mark.parametrize("d", DECLARED, ids=lambda d: d.id)
def test_every_field_is_set_by_its_flag_and_its_file_key(
    d: Declared, tmp_path: Path, fake_tokenizer: None
) -> None:
    sample = _sample(d)
    flag = [d.flag] if sample is True else [d.flag, str(sample)]
    by_flag = parse([*flag, *_extra(d)], 2)[:3]
    assert _field_of(by_flag, d) == _expected(d, sample)
    file = tmp_path / "run.toml"
    file.write_text(f"[{d.option.table}]\n{d.key} = {json.dumps(sample)}\n")
    by_file = parse(["--config", str(file), *_extra(d)], 2)[:3]
    assert by_file == by_flag
    # The written configuration holds it in the same table and reads back to the same run.
    assert resolved_options(parse_args(["--config", str(file)]))[d.option.table][d.key] == sample


def test_no_option_gives_the_dataclass_defaults() -> None:
    assert parse([], 1)[:3] == (ModelConfig(), ParallelConfig(), TrainConfig())


@dataclasses.dataclass(frozen=True)
class Knobs:
    """A config dataclass added after the fact."""

    knob: int = option(3, "a knob", table="training")
    mode: str = option("a", "a mode", table="run", choices=("a", "b"))
    rate: float = option(0.5, "a rate", table="data", flag="knob-rate")
    loud: bool = option(False, "loudly", table="model")


def test_an_added_field_is_a_flag_and_a_file_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cli, "_CONFIGS", (*cli._CONFIGS, Knobs))
    assert parse_args([]).knob == 3
    assert (parse_args([]).mode, parse_args([]).knob_rate, parse_args([]).loud) == ("a", 0.5, False)
    help_text = _parser().format_help()
    assert all(f in help_text for f in ("--knob ", "--mode {a,b}", "--knob-rate", "--loud"))
    file = tmp_path / "run.toml"
    file.write_text(
        '[training]\nknob = 5\n[run]\nmode = "b"\n[data]\nknob_rate = 0.25\n[model]\nloud = true\n'
    )
    args = parse_args(["--config", str(file), "--knob", "7"])
    knobs = Knobs(**config_kwargs(field_options(Knobs), args, Knobs))
    assert knobs == Knobs(knob=7, mode="b", rate=0.25, loud=True)
    tables = resolved_options(args)
    assert (tables["training"]["knob"], tables["run"]["mode"], tables["data"]["knob_rate"]) == (
        7,
        "b",
        0.25,
    )
    for text, message in [
        ("[training]\nknob = 'x'\n", "[training] knob must be an integer, got 'x'"),
        ("[training]\nknobb = 1\n", "unknown key 'knobb' in [training]; did you mean 'knob'"),
        ("[run]\nmode = 'c'\n", "[run] mode must be one of ['a', 'b'], got 'c'"),
        ("[training]\nknob_rate = 1.0\n", "'knob_rate' belongs in [data], not [training]"),
    ]:
        file.write_text(text)
        with pytest.raises(ConfigError) as info:
            parse_args(["--config", str(file)])
        assert message in str(info.value)


def test_a_field_the_generator_cannot_take_is_named() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bare:
        plain: int = 3

    with pytest.raises(TypeError, match=r"Bare\.plain has no option declaration"):
        field_options(Bare)

    @dataclasses.dataclass(frozen=True)
    class Twice:
        top_k: int = option(2, "clashes with MoEConfig.top_k", table="model")

    with pytest.raises(TypeError, match=r"MoEConfig\.top_k and Twice\.top_k both are --top-k"):
        field_options(MoEConfig, Twice)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stepz", "3"], "unrecognized arguments: --stepz"),
        (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
        (["--min-lr-ratio", "low"], "argument --min-lr-ratio: invalid float value: 'low'"),
        (["--offload", "disk"], "argument --offload: invalid choice: 'disk'"),
        (["--streaming", "yes"], "argument --streaming: invalid choice: 'yes'"),
    ],
)
def test_unknown_and_mistyped_flags_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[training]\nmin_lr = 0.1\n", "unknown key 'min_lr' in [training]; did you mean"),
        ("[training]\nmin_lr_ratio = 'x'\n", "[training] min_lr_ratio must be a number, got 'x'"),
        ("[model]\nqkv_bias = 1\n", "[model] qkv_bias must be true or false, got 1"),
        ("[model]\nshared_experts = 1.5\n", "[model] shared_experts must be an integer"),
        ("[data]\nstreaming = true\n", "[data] streaming must be a string, got True"),
        ("[parallel]\ncp_variant = 'tree'\n", "[parallel] cp_variant must be one of"),
    ],
)
def test_unknown_and_mistyped_file_keys_are_named(tmp_path: Path, text: str, message: str) -> None:
    file = tmp_path / "run.toml"
    file.write_text(text)
    with pytest.raises(ConfigError) as info:
        parse_args(["--config", str(file)])
    assert message in str(info.value)


def test_the_dry_run_takes_the_same_options() -> None:
    parser = dryrun_cli.build_parser()
    flags = set(parser._option_string_actions)
    shared = {d.flag for d in DECLARED if d.owner is not TrainConfig}
    assert shared <= flags
    assert set(DRYRUN_TRAIN_FLAGS) <= flags
    # Its own defaults: model options from the preset, bf16 and one microbatch.
    args = parser.parse_args([])
    assert all(getattr(args, d.key) is None for d in DECLARED if d.owner is ModelConfig)
    assert (args.mixed_precision, args.microbatches, args.global_batch) == ("bf16", 1, None)
    assert parser.parse_args(["--precision", "fp32"]).mixed_precision == "fp32"
    for argv in (["--tp", "x"], ["--norm-eps", "small"], ["--cp-variant", "tree"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    # Every model option given changes the preset's model, the others are the preset's.
    argv = ["--model", "tiny-moe", "--norm-eps", "1e-6", "--qk-norm", "--shared-experts", "1"]
    name, model, _, _ = dryrun_cli._model(parser.parse_args(argv))
    tiny_moe = ModelConfig(moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64, every=2))
    want = dataclasses.replace(
        tiny_moe, norm_eps=1e-6, qk_norm=True, moe=MoEConfig(n_shared_experts=1)
    )
    assert (name, model) == ("tiny-moe (modified)", want)


def test_help_lists_every_option() -> None:
    for module, flags in [
        ("hp_train", [d.flag for d in DECLARED]),
        ("hp_train.dryrun", [d.flag for d in DECLARED if d.owner is not TrainConfig]),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", module, "--help"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        missing = [f for f in flags if f"{f} " not in out and f"{f}\n" not in out]
        assert not missing, f"python -m {module} --help lacks {missing}"

"""Run configuration files: ``--config run.toml`` in, the resolved configuration out.

Every command-line option of ``python -m hp_train`` has a key in one table of the file, named
as the option without its dashes and with underscores (``--global-batch`` is
``global_batch``), in the table of the option's group. The tables and keys are read off the
parser's groups, which :mod:`hp_train.config.options` generates from the config dataclasses'
fields (each field declares its table), so a field's key needs no entry here::

    [model]
    model = "small"
    [parallel]
    tp = 2
    [training]
    steps = 100
    [data]
    data = "pydoc"
    [run]
    out = "runs/pydoc"

The file gives defaults; flags on the command line override it. A key in no table, in the
wrong table, of the wrong type or outside an option's choices is a :class:`ConfigError`
naming the key and what would be right.

Every run writes its resolved options (the file, overridden by the flags, every option filled
in) as ``config.toml`` into the output folder and into every checkpoint, in the same tables:
the file can be passed back with ``--config`` to repeat the run.
"""

from __future__ import annotations

import argparse
import difflib
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hp_train.config.schema import ConfigError

__all__ = [
    "CONFIG_FILE",
    "OptionTable",
    "dump_toml",
    "option_tables",
    "read_config_file",
    "resolved_tables",
]

#: The resolved options of a run, in its output folder and in each checkpoint.
CONFIG_FILE = "config.toml"

#: Options that never go into a written configuration (they say what to do, not what the
#: run is).
_NOT_WRITTEN = frozenset({"config", "print_plan", "resume", "resume_from", "resume_if_present"})


@dataclass(frozen=True)
class OptionTable:
    """One table of the file: an argparse group's options.

    Attributes:
        name: the table's name (``model``, ``parallel``, ...).
        actions: the group's options by key (their ``dest``).
    """

    name: str
    actions: Mapping[str, argparse.Action]


def option_tables(parser: argparse.ArgumentParser, names: Mapping[str, str]) -> list[OptionTable]:
    """The file's tables: for each argparse group titled as a key of ``names``, the table
    ``names[title]`` with the group's options (``--help`` and ``--config`` excluded)."""
    tables = []
    for group in parser._action_groups:
        if group.title is None or group.title not in names:
            continue
        actions = {a.dest: a for a in group._group_actions if a.dest not in ("help", "config")}
        tables.append(OptionTable(names[group.title], actions))
    return tables


def _where(tables: list[OptionTable]) -> dict[str, str]:
    return {key: t.name for t in tables for key in t.actions}


def _typed(key: str, action: argparse.Action, value: object) -> object:
    """``value`` of the file checked against ``action`` (type, choices), converted as the
    command line would."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    converter = action.type
    if converter is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
    elif converter is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        value = float(value)
    elif not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {value!r}")
    elif callable(converter):
        value = converter(value)
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{key} must be one of {sorted(action.choices)}, got {value!r}")
    return value


def read_config_file(path: str | Path, tables: list[OptionTable]) -> dict[str, object]:
    """The options a configuration file sets, by key (their argparse ``dest``), converted
    and checked as the command line would check them.

    Raises:
        ConfigError: the file is missing or not TOML; a table or key is unknown, misplaced,
            mistyped or outside its choices (the message names it and the right place).
    """
    file = Path(path)
    try:
        data = tomllib.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {file}: no such file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {file} is not valid TOML: {exc}") from None
    by_name = {t.name: t for t in tables}
    where = _where(tables)
    values: dict[str, object] = {}
    for table_name, body in data.items():
        if not isinstance(body, dict):
            hint = f" (put it in [{where[table_name]}])" if table_name in where else ""
            raise ConfigError(
                f"--config {file}: {table_name!r} is outside any table{hint}; the tables are "
                f"{sorted(by_name)}"
            )
        table = by_name.get(table_name)
        if table is None:
            raise ConfigError(
                f"--config {file}: unknown table [{table_name}]; the tables are {sorted(by_name)}"
            )
        for key, value in body.items():
            action = table.actions.get(key)
            if action is None:
                if key in where:
                    raise ConfigError(
                        f"--config {file}: {key!r} belongs in [{where[key]}], not [{table_name}]"
                    )
                close = difflib.get_close_matches(key, list(where), n=1)
                hint = f"; did you mean {close[0]!r} in [{where[close[0]]}]?" if close else ""
                raise ConfigError(f"--config {file}: unknown key {key!r} in [{table_name}]{hint}")
            values[key] = _typed(f"[{table_name}] {key}", action, value)
    return values


def resolved_tables(
    args: argparse.Namespace, tables: list[OptionTable]
) -> dict[str, dict[str, object]]:
    """Every option's value in ``args`` by table (options that are unset, ``None``, are
    left out: TOML has no null; options that say what to do rather than what the run is,
    such as ``resume``, are left out too)."""
    out: dict[str, dict[str, object]] = {}
    for table in tables:
        body: dict[str, object] = {}
        for key in table.actions:
            value = getattr(args, key)
            if value is None or key in _NOT_WRITTEN:
                continue
            body[key] = str(value) if isinstance(value, Path) else value
        out[table.name] = body
    return out


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as a TOML value")


def dump_toml(tables: Mapping[str, Mapping[str, object]]) -> str:
    """TOML text of tables of scalars (what :func:`resolved_tables` gives); ``tomllib``
    reads it back to the same tables."""
    parts = []
    for name, body in tables.items():
        lines = [f"[{name}]"] + [f"{key} = {_toml_value(v)}" for key, v in body.items()]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"

"""Every option of hp-train, declared once: on the config dataclass field it sets.

A field declared with :func:`option` (instead of a bare default) carries what the command line
and the TOML file need: its help text, its TOML table, its flag where that is not the field's
name with dashes, its choices, the words the command line spells its values with (``--streaming
auto|on|off`` for ``None|True|False``), and what the value is when the option is not given
(``unset``: the command line's default is then ``None`` and the caller fills the field, e.g.
from a model preset). Its type is the field's annotation: ``bool``, ``int``, ``float`` or
``str``, each optionally ``| None``.

:func:`field_options` reads those declarations into :class:`CliOption` s, :func:`add_options`
puts them on argparse groups, one per TOML table (the TOML loader reads its tables and keys off
those groups: :mod:`hp_train.config.toml_file`), and :func:`config_kwargs` turns the parsed
values back into a dataclass's keyword arguments. A field added with :func:`option` is thereby a
flag of ``hp-train`` and a key of its ``--config`` file (and a flag of ``hp-dryrun`` where the
dry run takes that class's options) without another edit.

:class:`JobArgumentParser` is the parser both command lines use: ``--help`` shows each option's
default (:class:`DefaultsHelpFormatter`), and under torchrun, where every rank parses the same
command line, a usage error is printed once for the job (by rank 0), not once per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import UnionType
from typing import (
    TYPE_CHECKING,
    Any,
    NoReturn,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

__all__ = [
    "OPTION_KEY",
    "TABLE_TITLES",
    "CliOption",
    "DefaultsHelpFormatter",
    "JobArgumentParser",
    "Option",
    "add_options",
    "config_kwargs",
    "field_options",
    "option",
]

#: The key of a field's ``metadata`` that holds its :class:`Option`.
OPTION_KEY = "hp_train.option"

#: The TOML tables in file order, each with the title of its group in ``--help``.
TABLE_TITLES: dict[str, str] = {
    "model": "model",
    "parallel": "parallelism (dp_replicate x dp_shard x cp x tp x pp = world size)",
    "training": "training",
    "data": "data",
    "run": "run",
}

_T = TypeVar("_T")
_KINDS = (bool, int, float, str)


@dataclass(frozen=True)
class Option:
    """How a config field is set from outside (a field's ``metadata[OPTION_KEY]``).

    Attributes:
        help: the ``--help`` text.
        table: the TOML table the key goes in (a key of :data:`TABLE_TITLES`).
        flag: the long flag without its dashes when it is not the field's name
            (``"experts"`` for ``MoEConfig.n_experts``); the TOML key is the flag with
            underscores.
        choices: the values the option takes (None: any of its type).
        unset: what the field is when the option is not given; the command line's default is
            then ``None`` and the caller fills the field (None: the field's default).
        words: ``(word, value)`` pairs: the command line's words for the field's values (the
            option's choices are the words; its default the word of the field's default).
    """

    help: str
    table: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    unset: str | None = None
    words: tuple[tuple[str, object], ...] | None = None

    def __post_init__(self) -> None:
        if self.table not in TABLE_TITLES:
            raise ValueError(
                f"option table {self.table!r} is not one of the file's tables {list(TABLE_TITLES)}"
            )


def option(
    default: _T,
    help: str,
    *,
    table: str,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    unset: str | None = None,
    words: tuple[tuple[str, object], ...] | None = None,
) -> _T:
    """A dataclass field with ``default`` that is an option of the command line and the TOML
    file (the arguments are :class:`Option`'s)."""
    declared = Option(help, table, flag, choices, unset, words)
    return dataclasses.field(default=default, metadata={OPTION_KEY: declared})


@dataclass(frozen=True)
class CliOption:
    """One option as the command line and the TOML file see it.

    Attributes:
        owner: the dataclass whose field it sets.
        field: that field's name.
        dest: the parsed value's name, which is also the TOML key.
        kind: ``bool``, ``int``, ``float`` or ``str``.
        default: the command line's default (None where the field is ``unset``).
        help: the help text (without the ``unset`` note).
        table: the TOML table.
        choices: the values it takes, or None.
        unset: what the field is when the option is not given, or None.
        words: the command line's words for the field's values, or None.
        aliases: other flags for it (a command line's older spellings).
    """

    owner: type[Any]
    field: str
    dest: str
    kind: type[Any]
    default: object
    help: str
    table: str
    choices: tuple[str, ...] | None = None
    unset: str | None = None
    words: tuple[tuple[str, object], ...] | None = None
    aliases: tuple[str, ...] = ()

    @property
    def flag(self) -> str:
        """The long flag (``--global-batch``)."""
        return "--" + self.dest.replace("_", "-")

    def field_value(self, given: Any) -> Any:
        """The field's value for the parsed value ``given`` (its word's value, if it has
        words)."""
        return given if self.words is None else dict(self.words)[given]


def field_options(*classes: type[Any]) -> tuple[CliOption, ...]:
    """The options the fields of ``classes`` declare, in field order (fields holding another
    config dataclass are skipped: that class has its own options).

    Raises:
        TypeError: a field without an :func:`option` declaration, of a type an option cannot
            have, or two options with one flag (the message names the fields).
    """
    found = [opt for cls in classes for opt in _class_options(cls)]
    seen: dict[str, CliOption] = {}
    for opt in found:
        other = seen.setdefault(opt.dest, opt)
        if other is not opt:
            raise TypeError(
                f"{other.owner.__name__}.{other.field} and {opt.owner.__name__}.{opt.field} "
                f"both are {opt.flag}; give one of them another flag= in option(...)"
            )
    return tuple(found)


def _class_options(cls: type[Any]) -> list[CliOption]:
    hints = get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        members = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
        kinds = [m for m in members if m is not type(None)]
        declared = f.metadata.get(OPTION_KEY)
        if declared is None:
            if len(kinds) == 1 and dataclasses.is_dataclass(kinds[0]):
                continue
            raise TypeError(
                f"{cls.__name__}.{f.name} has no option declaration; declare it as "
                f"`{f.name}: ... = option(default, help, table=...)` "
                "(hp_train.config.options.option)"
            )
        if len(kinds) != 1 or kinds[0] not in _KINDS:
            raise TypeError(
                f"{cls.__name__}.{f.name}: an option is bool, int, float or str (optionally "
                f"| None), not {hint}"
            )
        found.append(_cli_option(cls, f, kinds[0], declared))
    return found


def _cli_option(
    cls: type[Any], f: dataclasses.Field[Any], kind: type[Any], declared: Option
) -> CliOption:
    where = f"{cls.__name__}.{f.name}"
    default: object = f.default
    if declared.words is not None:
        spelled = [word for word, value in declared.words if value == f.default]
        if not spelled:
            raise TypeError(f"{where}: no word of {declared.words} has the default {f.default!r}")
        default = spelled[0]
    elif kind is bool and f.default is True and declared.unset is None:
        raise TypeError(f"{where}: a flag cannot turn off a bool that defaults to true")
    if declared.unset is not None:
        default = None
    dest = (declared.flag or f.name).replace("-", "_")
    return CliOption(
        cls, f.name, dest, kind, default, declared.help, declared.table, declared.choices,
        declared.unset, declared.words,
    )  # fmt: skip


def add_options(
    groups: Mapping[str, argparse._ActionsContainer], options: Iterable[CliOption]
) -> None:
    """Add each option to the group (or parser) of its table in ``groups``."""
    for opt in options:
        text = opt.help if opt.unset is None else f"{opt.help} (default: {opt.unset})"
        kwargs: dict[str, Any] = {"dest": opt.dest, "default": opt.default}
        kwargs["help"] = text.replace("%", "%%")
        if opt.kind is bool and opt.words is None:
            kwargs["action"] = "store_true"
        else:
            if opt.kind in (int, float):
                kwargs["type"] = opt.kind
            words = None if opt.words is None else tuple(word for word, _ in opt.words)
            kwargs["choices"] = opt.choices or words
        try:
            group = groups[opt.table]
        except KeyError:
            raise ValueError(f"{opt.flag}: no group for its table [{opt.table}]") from None
        group.add_argument(opt.flag, *opt.aliases, **kwargs)


def config_kwargs(
    options: Iterable[CliOption], args: argparse.Namespace, owner: type[Any]
) -> dict[str, Any]:
    """The fields of ``owner`` that ``args`` gives (options whose value is None, not given
    and without a default, are left out), by field name."""
    given: dict[str, Any] = {}
    for opt in options:
        value = getattr(args, opt.dest) if opt.owner is owner else None
        if value is not None:
            given[opt.field] = opt.field_value(value)
    return given


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` with ``(default: X)`` after every option that has a default: one that is not
    None (an option the caller fills says what it is in its own help) and not a flag that is
    off unless given; a help text that already names its default is left as it is, and an
    option without help text gets the default alone."""

    @staticmethod
    def _default_text(action: argparse.Action) -> str | None:
        default = action.default
        # Identity, not equality: a default of 0 or 0.0 equals False and is shown.
        if not action.option_strings or any(default is v for v in (None, False, argparse.SUPPRESS)):
            return None
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else str(default)
        return f"(default: {shown.replace('%', '%%')})"

    def _format_action(self, action: argparse.Action) -> str:
        shown = self._default_text(action)
        if not action.help and shown is not None:
            action = copy.copy(action)
            action.help = shown
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        shown = self._default_text(action)
        if shown is None or "default" in text:
            return action.help
        return f"{text} {shown}"


#: The longest a rank other than 0 waits, after a usage error, for rank 0 to say it printed:
#: under torchrun the first rank to exit makes the agent stop the others, and rank 0 must have
#: printed by then.
USAGE_ERROR_WAIT_S = 30.0


def _job_rank() -> int | None:
    """This process's rank under torchrun (``RANK``), None outside it."""
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def _printed_key() -> str:
    env = os.environ
    run = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"hp_train/usage_error/{run}/printed"


def _job_store() -> Any:
    """torchrun's store (:func:`hp_train.observe.errors.torchrun_store`), or None outside a
    multi-rank torchrun job or when it cannot be reached."""
    from hp_train.observe.errors import torchrun_store

    try:
        found = torchrun_store()
    except (RuntimeError, ValueError):
        return None
    return None if found is None else found[0]


class JobArgumentParser(argparse.ArgumentParser):
    """An argument parser for a command every rank of a job runs: a usage error (and
    ``--help``) is printed by rank 0 alone (or by the process, outside torchrun); every rank
    exits with argparse's status 2, the others once rank 0 has printed (through torchrun's
    store, at most :data:`USAGE_ERROR_WAIT_S`), so that they do not stop rank 0 before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def print_help(self, file: SupportsWrite[str] | None = None) -> None:
        """Argparse's ``--help``, on rank 0 only."""
        if _job_rank() in (None, 0):
            super().print_help(file)

    def error(self, message: str) -> NoReturn:
        """Argparse's usage error (usage and message on stderr, exit status 2), printed by
        rank 0 only."""
        rank = _job_rank()
        if rank is None:
            super().error(message)
        store = _job_store()
        if rank == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
            if store is not None:
                store.set(_printed_key(), "1")
        elif store is not None:
            # Rank 0 gone or never getting here raises: exit all the same.
            with contextlib.suppress(RuntimeError):
                store.wait([_printed_key()], timedelta(seconds=USAGE_ERROR_WAIT_S))
        self.exit(2)

"""Where each upstream HyperParallel name lives in the hp-* libraries, and the migration table.

The table is generated from the package itself: a name re-exported unchanged is found by
identity in the hp-* libraries' public modules (so the row cannot name the wrong function), an
adapter names the hp-* function or class it adapts with :func:`adapts` (and
``tests/test_hyper_parallel_table.py`` checks that the target exists), and a name that is not
offered says so with :func:`not_offered_here`. ``README.md`` holds exactly
:func:`migration_table`'s text (a test compares them).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "PUBLIC_MODULES",
    "Origin",
    "Row",
    "adapts",
    "migration_table",
    "not_offered_here",
    "resolve",
    "rows",
    "upstream_modules",
]

_T = TypeVar("_T")

#: The hp-* modules whose names count as public targets, in search order.
PUBLIC_MODULES: tuple[str, ...] = (
    "hp_layout",
    "hp_dtensor",
    "hp_dtensor.parallel",
    "hp_fsdp",
    "hp_muon",
    "hp_mpmd",
    "hp_offload",
    "hp_kernels",
)


@dataclass(frozen=True)
class Origin:
    """What an upstream name is here.

    Attributes:
        target: the dotted hp-* path it adapts or re-exports (``"hp_fsdp.fully_shard"``); for a
            name not offered, what exists instead.
        how: one line for the table.
        offered: False for a name that only raises :class:`~hyper_parallel.NotOfferedError`.
    """

    target: str
    how: str
    offered: bool = True


@dataclass(frozen=True)
class Row:
    """One row of the migration table: upstream ``hyper_parallel.<name>`` and where it lives."""

    name: str
    target: str
    distribution: str
    how: str


_MARKED: list[tuple[object, Origin]] = []


def adapts(target: str, how: str) -> Callable[[_T], _T]:
    """Mark the decorated function or class as the upstream-shaped adapter of ``target`` (a
    dotted path into a public hp-* module); ``how`` says in one line what it adapts."""

    def mark(obj: _T) -> _T:
        _MARKED.append((obj, Origin(target, f"adapter: {how}")))
        return obj

    return mark


def not_offered_here(instead: str, why: str) -> Callable[[_T], _T]:
    """Mark the decorated upstream name as named but not offered: using it raises
    :class:`~hyper_parallel.NotOfferedError`; ``instead`` is the dotted path of what exists."""

    def mark(obj: _T) -> _T:
        _MARKED.append((obj, Origin(instead, f"not offered: {why}", offered=False)))
        return obj

    return mark


def resolve(path: str) -> object:
    """The object at dotted ``path`` (``"hp_fsdp.fully_shard"``), importing its module.

    Raises:
        LookupError: nothing of that name exists.
    """
    module_name, _, attribute = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise LookupError(f"{path} does not exist ({exc})") from exc


def _marked(obj: object) -> Origin | None:
    for candidate, origin in _MARKED:
        if candidate is obj:
            return origin
    return None


def _reexported(name: str, obj: object) -> str:
    defining = str(getattr(obj, "__module__", "")).split(".")[0]
    found = [
        f"{module_name}.{name}"
        for module_name in PUBLIC_MODULES
        if getattr(importlib.import_module(module_name), name, None) is obj
    ]
    if not found:
        raise LookupError(
            f"hyper_parallel.{name} is neither an adapter (hyper_parallel.migration.adapts) nor "
            f"re-exported from a public hp-* module {list(PUBLIC_MODULES)}"
        )
    # The package that defines it, if it exports it, else the first that does.
    mine = [path for path in found if path.split(".")[0] == defining]
    return (mine or found)[0]


def _distribution(path: str) -> str:
    return path.split(".")[0].replace("_", "-")


def rows() -> list[Row]:
    """One :class:`Row` per name of ``hyper_parallel.UPSTREAM_NAMES``, in that order."""
    package = importlib.import_module("hyper_parallel")
    out = []
    for name in package.UPSTREAM_NAMES:
        obj = getattr(package, name)
        origin = _marked(obj)
        if origin is None:
            target = _reexported(name, obj)
            out.append(Row(name, target, _distribution(target), "same object"))
        else:
            out.append(Row(name, origin.target, _distribution(origin.target), origin.how))
    return out


def upstream_modules() -> dict[str, list[str]]:
    """Every ``hyper_parallel.core.*`` module (upstream's import paths) and the names it
    serves (its ``__all__``), by module name."""
    core = importlib.import_module("hyper_parallel.core")
    found = {core.__name__: list(getattr(core, "__all__", []))}
    for info in pkgutil.walk_packages(core.__path__, core.__name__ + "."):
        module = importlib.import_module(info.name)
        found[info.name] = list(getattr(module, "__all__", []))
    return {name: names for name, names in sorted(found.items()) if names}


def migration_table() -> str:
    """The migration table (markdown): upstream name -> hp-* name and package, then the
    upstream module paths this package serves. ``README.md`` contains exactly this text."""
    lines = [
        "| upstream `hyper_parallel.` | here | package | how |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| `{r.name}` | `{r.target}` | {r.distribution} | {r.how} |" for r in rows()]
    lines += ["", "| upstream module | serves |", "| --- | --- |"]
    for module_name, names in upstream_modules().items():
        served = ", ".join(f"`{n}`" for n in names)
        lines.append(f"| `{module_name}` | {served} |")
    return "\n".join(lines) + "\n"

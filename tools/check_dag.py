#!/usr/bin/env python3
"""Enforce the package dependency DAG of docs/architecture.md ("Packages and their dependencies").

Run as ``python tools/check_dag.py [--root DIR]``; exits 1 with one message per problem.

Checks, for every directory ``packages/<dist>/``:

(a) the hp-* dependencies declared in its ``pyproject.toml`` (required and optional) are
    allowed by ``ALLOWED_DEPS`` and exist under ``packages/``;
(b) every ``import``/``from ... import`` of an ``hp_*`` module in its ``src/`` and ``tests/``
    (found with ``ast``, nested imports and ``importlib.import_module("...")`` included) names
    the package itself or a declared dependency;
(c) restricted third-party imports (``RESTRICTED_IMPORTS``): ``hp_layout`` never imports torch,
    and imports numpy only in ``hp_layout/reference.py``; no package imports a test-only
    third-party package (``TEST_ONLY_THIRD_PARTY``: transformers) from ``src/``; the required
    dependencies name none of them;
(d) at run time, in a fresh interpreter with only ``packages/hp-layout/src`` added to the path,
    importing ``hp_layout`` and all its submodules except ``hp_layout.reference`` neither
    loads nor even tries to import torch or numpy;
(e) every package directory is in ``ALLOWED_DEPS`` (a new package needs a row there);
(f) the package layout: ``[project].name`` equals the directory name; ``src/<import>/``
    (with ``__init__.py`` and ``py.typed``), ``tests/``, ``README.md`` and ``CHANGELOG.md``
    exist; a ``test`` extra is declared;
(g) test-only packages (``TEST_ONLY``, i.e. ``hp_testing``): other packages list them only in
    their ``test`` extra (never in ``[project].dependencies`` or another extra) and import
    them only from ``tests/``, never from ``src/``; and ``hp_testing``'s own ``src/`` imports
    only the standard library and ``ALLOWED_THIRD_PARTY`` (torch, pytest), which are also
    the only third-party requirements it may declare;
(h) the cross-package contract (packages cooperate only through public APIs), in ``src/``
    and ``tests/``: a package never imports a private module or name of another hp package,
    i.e. a dotted path with a component starting with ``_`` (dunders such as ``__version__``
    aside), found as in (b), ``from <pkg> import _submodule`` and ``from <mod> import
    _NAME`` included; and it never uses another package's private state by name. Such
    attribute names follow the convention ``_hp_<short>_...`` (``<short>``: the import name
    without ``hp_``, the longest matching one owning the name), so every string literal that
    is such a name and every attribute access ``x._hp_...`` must carry the package's own
    prefix: one of another package's is an error (use its public contract), and so is a
    ``_hp_`` name with no package's prefix, whose owner cannot be told (rename it).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib.machinery import all_suffixes
from pathlib import Path
from typing import Any

TABLE_NAME = "ALLOWED_DEPS in tools/check_dag.py"

#: Test-only packages: others may list them only in their `test` extra and import them only
#: from tests/ (check (g)); they are never runtime dependencies.
TEST_ONLY: frozenset[str] = frozenset({"hp_testing"})

_BELOW_SIBLINGS = frozenset({"hp_dtensor", "hp_layout", "hp_kernels"}) | TEST_ONLY

#: import name -> the hp_* packages it may depend on (directly). Siblings never import each
#: other; shared contracts live in the package below them. TEST_ONLY entries are allowed in
#: the `test` extra only (check (g)).
ALLOWED_DEPS: Mapping[str, frozenset[str]] = {
    "hp_testing": frozenset(),  # test helpers: torch and pytest only, no hp_* package
    "hp_layout": frozenset(),  # pure Python: no torch, no numpy at import time
    "hp_kernels": TEST_ONLY,  # torch only
    "hp_dtensor": frozenset({"hp_layout", "hp_kernels"}) | TEST_ONLY,
    "hp_fsdp": _BELOW_SIBLINGS,
    "hp_muon": _BELOW_SIBLINGS,
    "hp_mpmd": _BELOW_SIBLINGS,
    "hp_offload": _BELOW_SIBLINGS,
    # The whole job's plan (JobPlan) and its pricing: reads the libraries' pure planners.
    "hp_planner": frozenset({"hp_layout", "hp_dtensor", "hp_fsdp", "hp_muon", "hp_mpmd"})
    | TEST_ONLY,
    # The training application on top: it composes the libraries (never imported by them).
    "hp_train": frozenset(
        {
            "hp_layout",
            "hp_dtensor",
            "hp_kernels",
            "hp_fsdp",
            "hp_muon",
            "hp_mpmd",
            "hp_offload",
            "hp_planner",
        }
    )
    | TEST_ONLY,
    # Reinforcement learning on the trainer (GRPO, rollouts, weight sync); nothing imports it.
    "hp_rl": frozenset(
        {
            "hp_layout",
            "hp_dtensor",
            "hp_kernels",
            "hp_fsdp",
            "hp_muon",
            "hp_offload",
            "hp_planner",
            "hp_train",
        }
    )
    | TEST_ONLY,
    # The umbrella on top of everything (HyperParallel's names over the libraries; hp-train only
    # as its `train` extra); no package may import or depend on it (see UMBRELLA).
    "hyper_parallel": frozenset(
        {
            "hp_layout",
            "hp_dtensor",
            "hp_kernels",
            "hp_fsdp",
            "hp_muon",
            "hp_mpmd",
            "hp_offload",
            "hp_planner",
            "hp_train",
        }
    )
    | TEST_ONLY,
}

#: Packages of this repository whose names lack the ``hp`` prefix: the umbrella distribution
#: ``hyper-parallel``. They count as hp packages for every check (so an import of one from
#: another package is checked against the DAG table, where no row allows it).
UMBRELLA: frozenset[str] = frozenset({"hyper_parallel"})


@dataclass(frozen=True)
class Restriction:
    """A third-party top-level module a package may import only in the listed modules."""

    module: str
    only_in: frozenset[str] = frozenset()  # empty: nowhere


#: Third-party packages the tests use and no package may need at run time (real models from
#: Hugging Face, for instance): restricted everywhere but in the test-only packages (check (c)).
TEST_ONLY_THIRD_PARTY: tuple[str, ...] = ("transformers",)

_SPECIFIC_RESTRICTIONS: Mapping[str, tuple[Restriction, ...]] = {
    "hp_layout": (
        Restriction("torch"),
        Restriction("torch_npu"),
        Restriction("numpy", only_in=frozenset({"hp_layout.reference"})),
    ),
}

#: import name -> restricted third-party imports in its src/ (static check (c)).
RESTRICTED_IMPORTS: Mapping[str, tuple[Restriction, ...]] = {
    name: (
        *_SPECIFIC_RESTRICTIONS.get(name, ()),
        *(Restriction(module) for module in TEST_ONLY_THIRD_PARTY if name not in TEST_ONLY),
    )
    for name in ALLOWED_DEPS
}


@dataclass(frozen=True)
class RuntimeRule:
    """Importing the package (minus ``excluded`` modules) must not load ``forbidden``."""

    forbidden: frozenset[str]
    excluded: frozenset[str]


#: import name -> runtime import rule (check (d)).
RUNTIME_RULES: Mapping[str, RuntimeRule] = {
    "hp_layout": RuntimeRule(
        forbidden=frozenset({"torch", "numpy"}),
        excluded=frozenset({"hp_layout.reference"}),
    ),
}

#: import name -> the only third-party top-level modules its src/ may import (the standard
#: library aside), and the only non-hp requirements its [project].dependencies may name.
ALLOWED_THIRD_PARTY: Mapping[str, frozenset[str]] = {
    "hp_testing": frozenset({"torch", "pytest"}),
}

#: import name -> third-party modules its src/ may also import, declared in an extra only
#: (never a runtime requirement): hp_testing.hf builds Hugging Face models for tests.
ALLOWED_OPTIONAL_IMPORTS: Mapping[str, frozenset[str]] = {
    "hp_testing": frozenset({"transformers"}),
}

_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)")
_TEST_EXTRA = "test"


def normalize(name: str) -> str:
    """PEP 503 normalization of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The normalized distribution name of a PEP 508 requirement string."""
    match = _REQ_NAME.match(requirement)
    if match is None:
        raise ValueError(f"cannot parse requirement {requirement!r}")
    return normalize(match.group(1))


def import_name(dist: str) -> str:
    return normalize(dist).replace("-", "_")


def dist_name(module: str) -> str:
    return module.replace("_", "-")


def is_hp(module_or_dist: str) -> bool:
    return module_or_dist.startswith(("hp_", "hp-")) or import_name(module_or_dist) in UMBRELLA


@dataclass(frozen=True)
class Package:
    dist: str
    directory: Path
    project: Mapping[str, Any]

    @property
    def import_name(self) -> str:
        return import_name(self.dist)

    @property
    def src(self) -> Path:
        return self.directory / "src"

    def requirements(self, *, include_test: bool) -> dict[str, str]:
        """Declared requirement strings keyed by normalized name (required + extras)."""
        reqs: list[str] = list(self.project.get("dependencies", []))
        extras: Mapping[str, list[str]] = self.project.get("optional-dependencies", {})
        for extra, items in extras.items():
            if include_test or extra != _TEST_EXTRA:
                reqs.extend(items)
        return {requirement_name(r): r for r in reqs}

    def requirement_sections(self) -> Iterator[tuple[str, str]]:
        """(section, requirement) for every declared requirement; section is
        ``"[project].dependencies"`` or the extra's name."""
        for requirement in self.project.get("dependencies", []):
            yield "[project].dependencies", requirement
        extras: Mapping[str, list[str]] = self.project.get("optional-dependencies", {})
        for extra, items in extras.items():
            for requirement in items:
                yield extra, requirement

    def hp_deps(self, *, include_test: bool) -> set[str]:
        """Declared hp_* dependencies as import names."""
        names = self.requirements(include_test=include_test)
        return {import_name(n) for n in names if is_hp(n)}


@dataclass(frozen=True)
class ImportSite:
    path: Path
    lineno: int
    importer: str  # dotted module name of the importing file
    imported: str  # dotted module name imported
    names: tuple[str, ...] = ()  # the names of `from imported import ...`, else empty

    @property
    def top(self) -> str:
        return self.imported.split(".", 1)[0]


class Report:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, message: str) -> None:
        self.errors.append(message)


def discover(root: Path, report: Report) -> list[Package]:
    packages_dir = root / "packages"
    if not packages_dir.is_dir():
        report.error(f"{packages_dir}: no packages/ directory under --root {root}")
        return []
    found: list[Package] = []
    for directory in sorted(p for p in packages_dir.iterdir() if p.is_dir()):
        if directory.name.startswith((".", "_")):
            continue
        pyproject = directory / "pyproject.toml"
        if not pyproject.is_file():
            report.error(f"{rel(directory, root)}: package directory without pyproject.toml")
            continue
        try:
            data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            report.error(f"{rel(pyproject, root)}: invalid TOML: {exc}")
            continue
        project = data.get("project")
        if not isinstance(project, dict) or "name" not in project:
            report.error(f"{rel(pyproject, root)}: missing [project] table with a name")
            continue
        found.append(Package(dist=directory.name, directory=directory, project=project))
    return found


def rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def check_layout(pkg: Package, root: Path, report: Report) -> None:
    """(f) Directory/name/layout conventions."""
    name = normalize(str(pkg.project["name"]))
    where = rel(pkg.directory, root)
    if name != pkg.dist:
        report.error(
            f"{where}: [project].name is {pkg.project['name']!r}, expected {pkg.dist!r} "
            "(the directory name)"
        )
    pkg_dir = pkg.src / pkg.import_name
    required = [
        pkg_dir / "__init__.py",
        pkg_dir / "py.typed",
        pkg.directory / "tests",
        pkg.directory / "README.md",
        pkg.directory / "CHANGELOG.md",
    ]
    for path in required:
        if not path.exists():
            report.error(
                f"{rel(path, root)}: missing (every package needs it, see docs/architecture.md)"
            )
    if _TEST_EXTRA not in pkg.project.get("optional-dependencies", {}):
        report.error(
            f"{where}/pyproject.toml: no [project.optional-dependencies] {_TEST_EXTRA} = [...] "
            "(what the package's tests need; CI installs it)"
        )


def check_known(packages: Sequence[Package], root: Path, report: Report) -> None:
    """(e) Every package directory has a row in the DAG table."""
    for pkg in packages:
        if pkg.import_name not in ALLOWED_DEPS:
            report.error(
                f"{rel(pkg.directory, root)}: unknown package {pkg.dist!r} "
                f"({pkg.import_name}): add a row for it to {TABLE_NAME} "
                "(and to the dependency DAG of docs/architecture.md) before adding the package"
            )


def check_declared(packages: Sequence[Package], root: Path, report: Report) -> None:
    """(a) Declared hp-* dependencies are allowed by the table and exist."""
    present = {pkg.import_name for pkg in packages}
    for pkg in packages:
        allowed = ALLOWED_DEPS.get(pkg.import_name)
        pyproject = rel(pkg.directory / "pyproject.toml", root)
        for name, requirement in sorted(pkg.requirements(include_test=True).items()):
            if not is_hp(name):
                continue
            dep = import_name(name)
            if dep == pkg.import_name:
                report.error(f"{pyproject}: {pkg.dist} declares a dependency on itself")
                continue
            if dep not in ALLOWED_DEPS:
                report.error(
                    f"{pyproject}: {pkg.dist} depends on unknown package {name!r} "
                    f"(not in {TABLE_NAME})"
                )
                continue
            if allowed is not None and dep not in allowed:
                report.error(
                    f"{pyproject}: {pkg.dist} declares {requirement!r}, which the DAG forbids; "
                    f"{pkg.dist} may depend only on {fmt_set(allowed)}"
                )
            if dep not in present:
                report.error(
                    f"{pyproject}: {pkg.dist} depends on {name!r}, but there is no packages/{name}/"
                )
    check_test_only_declared(packages, root, report)
    for pkg, restrictions in _restricted(packages):
        required = {requirement_name(r): r for r in pkg.project.get("dependencies", [])}
        for restriction in restrictions:
            name = normalize(restriction.module)
            if name in required:
                report.error(
                    f"{rel(pkg.directory / 'pyproject.toml', root)}: {pkg.dist} must not "
                    f"require {name} (found {required[name]!r} in [project].dependencies)"
                )


def check_test_only_declared(packages: Sequence[Package], root: Path, report: Report) -> None:
    """(g) TEST_ONLY packages only in `test` extras; allow-listed third-party requirements."""
    for pkg in packages:
        pyproject = rel(pkg.directory / "pyproject.toml", root)
        allowed_third_party = ALLOWED_THIRD_PARTY.get(pkg.import_name)
        for section, requirement in pkg.requirement_sections():
            name = requirement_name(requirement)
            dep = import_name(name)
            if dep in TEST_ONLY and dep != pkg.import_name and section != _TEST_EXTRA:
                where = section if section.startswith("[") else f"the {section!r} extra"
                report.error(
                    f"{pyproject}: {pkg.dist} declares {requirement!r} in {where}; "
                    f"{name} is test-only: list it only in [project.optional-dependencies] "
                    f"{_TEST_EXTRA}"
                )
            if (
                allowed_third_party is not None
                and section == "[project].dependencies"
                and not is_hp(name)
                and dep not in allowed_third_party
            ):
                report.error(
                    f"{pyproject}: {pkg.dist} requires {requirement!r}; its only third-party "
                    f"dependencies may be {fmt_set(allowed_third_party)}"
                )


def _restricted(packages: Sequence[Package]) -> Iterator[tuple[Package, tuple[Restriction, ...]]]:
    for pkg in packages:
        restrictions = RESTRICTED_IMPORTS.get(pkg.import_name)
        if restrictions:
            yield pkg, restrictions


def fmt_set(names: frozenset[str] | set[str]) -> str:
    return "{" + ", ".join(sorted(names)) + "}" if names else "nothing (no hp-* packages)"


def module_name(path: Path, base: Path) -> str:
    """Dotted module name of ``path`` relative to the import root ``base``."""
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _dynamic_import_target(node: ast.Call) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in {"import_module", "__import__"} or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def iter_imports(path: Path, base: Path, report: Report, root: Path) -> Iterator[ImportSite]:
    """Every absolute import in ``path`` (at any nesting depth)."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        report.error(f"{rel(path, root)}:{exc.lineno}: cannot parse: {exc.msg}")
        return
    yield from import_sites(tree, path, module_name(path, base))


def import_sites(tree: ast.AST, path: Path, importer: str) -> Iterator[ImportSite]:
    """Every absolute import in the parsed ``tree`` of ``path`` (at any nesting depth)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield ImportSite(path, node.lineno, importer, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                names = tuple(alias.name for alias in node.names)
                yield ImportSite(path, node.lineno, importer, node.module, names)
        elif isinstance(node, ast.Call):
            target = _dynamic_import_target(node)
            if target is not None and not target.startswith("."):
                yield ImportSite(path, node.lineno, importer, target)


def python_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(
        p
        for p in directory.rglob("*.py")
        if not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


@dataclass
class ImportStats:
    files: int = 0
    hp_imports: int = 0


def check_imports(
    packages: Sequence[Package], root: Path, report: Report, stats: ImportStats
) -> None:
    """(b) hp_* imports are declared; (c) restricted third-party imports."""
    for pkg in packages:
        restrictions = {r.module: r for r in RESTRICTED_IMPORTS.get(pkg.import_name, ())}
        third_party = ALLOWED_THIRD_PARTY.get(pkg.import_name)
        optional = ALLOWED_OPTIONAL_IMPORTS.get(pkg.import_name, frozenset())
        tests = pkg.directory / "tests"
        for base, files, include_test in (
            (pkg.src, python_files(pkg.src), False),
            (tests, python_files(tests), True),
        ):
            declared = pkg.hp_deps(include_test=include_test)
            stats.files += len(files)
            for path in files:
                for site in iter_imports(path, base, report, root):
                    where = f"{rel(site.path, root)}:{site.lineno}"
                    if is_hp(site.top):
                        stats.hp_imports += 1
                        _check_hp_import(pkg, site, where, declared, include_test, report)
                    elif (
                        not include_test
                        and third_party is not None
                        and site.top not in third_party | optional
                        and site.top not in sys.stdlib_module_names
                    ):
                        extras = f" and, from an extra, {fmt_set(optional)}" if optional else ""
                        report.error(
                            f"{where}: {site.importer} imports {site.imported}; "
                            f"{pkg.import_name} may import only the standard library and "
                            f"{fmt_set(third_party)}{extras}"
                        )
                    elif not include_test and site.top in restrictions:
                        restriction = restrictions[site.top]
                        if site.importer not in restriction.only_in:
                            allowed = (
                                f"only in {fmt_set(restriction.only_in)}"
                                if restriction.only_in
                                else "nowhere"
                            )
                            report.error(
                                f"{where}: {site.importer} imports {site.imported}; "
                                f"{pkg.import_name} may import {site.top} {allowed}"
                            )


def _check_hp_import(
    pkg: Package,
    site: ImportSite,
    where: str,
    declared: set[str],
    include_test: bool,
    report: Report,
) -> None:
    if site.top in TEST_ONLY and site.top != pkg.import_name and not include_test:
        report.error(
            f"{where}: {site.importer} imports {site.imported}; {site.top} is test-only: "
            "import it only from tests/, never from src/"
        )
        return
    if site.top == pkg.import_name or site.top in declared:
        return
    allowed = ALLOWED_DEPS.get(pkg.import_name, frozenset())
    scope = "its dependencies (incl. extras)" if include_test else "[project].dependencies"
    if site.top not in ALLOWED_DEPS:
        why = f"{site.top} is not a known package (not in {TABLE_NAME})"
    elif site.top in allowed:
        why = f"{dist_name(site.top)} is not in {pkg.dist}'s {scope}: declare it"
    else:
        why = (
            f"the DAG forbids {pkg.import_name} -> {site.top} "
            f"({pkg.import_name} may import only {fmt_set(allowed)})"
        )
    report.error(f"{where}: {site.importer} imports {site.imported}; {why}")


# --- (h) the cross-package contract -------------------------------------------------------

#: Attribute names carrying a package's private state start with this, then the owner's
#: short name (its import name without ``hp_``) and ``_``: ``_hp_fsdp_state``.
PRIVATE_STATE_PREFIX = "_hp_"


def is_private(component: str) -> bool:
    """Whether a module-path component or name is private: a leading underscore, except for
    dunders (``__version__``, ``__main__``), which are public by Python's convention."""
    dunder = len(component) > 4 and component.startswith("__") and component.endswith("__")
    return component.startswith("_") and not dunder


def short_name(package: str) -> str:
    """The short name of an import name in ``_hp_<short>_`` names: ``hp_fsdp`` -> ``fsdp``."""
    return package.removeprefix("hp_")


def state_owner(name: str, shorts: Mapping[str, str]) -> str | None:
    """The package owning the ``_hp_<short>_...`` attribute ``name``, or None if none does.

    ``shorts`` maps short names to import names. The short must be followed by ``_`` and a
    non-empty rest, so ``_hp_layout`` (no rest) is owned by no package rather than by
    hp_layout; where shorts overlap (``mp``, ``mp_x``) the longest match owns the name.
    """
    rest = name.removeprefix(PRIVATE_STATE_PREFIX)
    matches = [short for short in shorts if rest.startswith(short + "_") and rest != short + "_"]
    return shorts[max(matches, key=len)] if matches else None


@dataclass
class ContractStats:
    """What check (h) looked at, for the summary."""

    hp_imports: int = 0  # imports of other hp packages checked for private parts
    state_names: int = 0  # `_hp_` string literals and attribute accesses seen


def check_contract(
    packages: Sequence[Package], root: Path, report: Report, stats: ContractStats
) -> None:
    """(h) No import of another package's private modules/names, no use of its private state."""
    by_name = {pkg.import_name: pkg for pkg in packages}
    shorts = {short_name(name): name for name in by_name if is_hp(name)}
    for pkg in packages:
        for base in (pkg.src, pkg.directory / "tests"):
            for path in python_files(base):
                try:
                    tree = ast.parse(path.read_bytes(), filename=str(path))
                except SyntaxError:
                    continue  # (b) already reports the file it cannot parse
                importer = module_name(path, base)
                for site in import_sites(tree, path, importer):
                    if is_hp(site.top) and site.top != pkg.import_name:
                        stats.hp_imports += 1
                        _check_private_import(site, by_name.get(site.top), root, report)
                for lineno, what, name in _state_names(tree):
                    stats.state_names += 1
                    where = f"{rel(path, root)}:{lineno}"
                    _check_state_name(pkg, shorts, where, importer, what, name, report)


def _check_private_import(
    site: ImportSite, owner: Package | None, root: Path, report: Report
) -> None:
    where = f"{rel(site.path, root)}:{site.lineno}"
    advice = f"use {site.top}'s public API instead (or have {site.top} make it public)"
    parts = site.imported.split(".")
    if any(is_private(part) for part in parts):
        report.error(
            f"{where}: {site.importer} imports {site.imported}, a private module of "
            f"{site.top}; {advice}"
        )
        return
    for name in site.names:
        if not is_private(name):
            continue
        if owner is not None and _is_submodule(owner, parts, name):
            report.error(
                f"{where}: {site.importer} imports {site.imported}.{name} (from "
                f"{site.imported} import {name}), a private module of {site.top}; {advice}"
            )
        else:
            report.error(
                f"{where}: {site.importer} imports the private name {name} from "
                f"{site.imported}; {advice}"
            )


def _is_submodule(owner: Package, parts: Sequence[str], name: str) -> bool:
    """Whether ``from <parts> import <name>`` names a module of ``owner`` (a file on disk)
    rather than an attribute; only the message depends on it, both are errors."""
    directory = owner.src.joinpath(*parts)
    if (directory / name / "__init__.py").is_file():
        return True
    return any((directory / (name + suffix)).is_file() for suffix in all_suffixes())


def _state_names(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """(line, description, name) of every ``_hp_`` string literal and attribute access."""
    # Pieces of an f-string are fragments of a name, not names: skip them.
    fragments = {
        id(part)
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        for part in node.values
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith(PRIVATE_STATE_PREFIX):
            yield node.lineno, f"the attribute .{node.attr}", node.attr
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(PRIVATE_STATE_PREFIX)
            and node.value.isidentifier()  # a name, not prose mentioning one (docstrings)
            and id(node) not in fragments
        ):
            yield node.lineno, f"the string {node.value!r}", node.value


def _check_state_name(
    pkg: Package,
    shorts: Mapping[str, str],
    where: str,
    importer: str,
    what: str,
    name: str,
    report: Report,
) -> None:
    owner = state_owner(name, shorts)
    if owner == pkg.import_name:
        return
    if owner is not None:
        report.error(
            f"{where}: {importer} uses {what}, private state of {owner} "
            f"({PRIVATE_STATE_PREFIX}{short_name(owner)}_ prefix); use {owner}'s public "
            "contract instead"
        )
        return
    mine = short_name(pkg.import_name)
    rest = name.removeprefix(PRIVATE_STATE_PREFIX).strip("_")
    # A bare `_hp_<own short>` has nothing to keep after the new prefix: use a placeholder.
    renamed = f"{PRIVATE_STATE_PREFIX}{mine}_{rest if rest not in ('', mine) else '<what>'}"
    report.error(
        f"{where}: {importer} uses {what}, a {PRIVATE_STATE_PREFIX} name with no package's "
        f"{PRIVATE_STATE_PREFIX}<short>_ prefix (its owner cannot be told): rename it "
        f"{renamed} if it is {pkg.import_name}'s own state, "
        "otherwise use its owner's public contract"
    )


# Runs in a fresh interpreter: argv = [src, package, forbidden (comma list), excluded (comma)].
_RUNTIME_PROBE = r"""
import importlib, importlib.abc, json, pkgutil, sys, traceback

src, package, forbidden, excluded = sys.argv[1:5]
forbidden = set(filter(None, forbidden.split(",")))
excluded = set(filter(None, excluded.split(",")))
sys.path.insert(0, src)
state = {"current": package}
result = {"imported": [], "attempts": [], "loaded": [], "errors": []}


class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in forbidden:
            frames = [f for f in traceback.extract_stack() if f.filename.startswith(src)]
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
            result["attempts"].append([state["current"], fullname, where])
        return None


sys.meta_path.insert(0, Spy())


def load(name):
    state["current"] = name
    before = set(sys.modules)
    try:
        module = importlib.import_module(name)
    except BaseException as exc:
        result["errors"].append([name, f"{type(exc).__name__}: {exc}"])
        return None
    result["imported"].append(name)
    for mod in sorted(set(sys.modules) - before):
        if mod in forbidden:
            result["loaded"].append([name, mod])
    return module


def skip(name):
    return name.rsplit(".", 1)[-1] == "__main__" or any(
        name == e or name.startswith(e + ".") for e in excluded
    )


def walk(module):
    for info in pkgutil.iter_modules(getattr(module, "__path__", []), module.__name__ + "."):
        if skip(info.name):
            continue
        child = load(info.name)
        if child is not None and info.ispkg:
            walk(child)


top = load(package)
if top is not None:
    walk(top)
print(json.dumps(result))
"""


def check_runtime(packages: Sequence[Package], root: Path, report: Report) -> list[str]:
    """(d) Import the package and its submodules in a subprocess; watch sys.modules."""
    summaries: list[str] = []
    for pkg in packages:
        rule = RUNTIME_RULES.get(pkg.import_name)
        if rule is None or not (pkg.src / pkg.import_name).is_dir():
            continue
        cmd = [
            sys.executable,
            "-I",
            "-c",
            _RUNTIME_PROBE,
            str(pkg.src.resolve()),
            pkg.import_name,
            ",".join(sorted(rule.forbidden)),
            ",".join(sorted(rule.excluded)),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            report.error(
                f"(d) import probe for {pkg.import_name} crashed (exit {proc.returncode}):\n"
                f"{proc.stderr.strip()}"
            )
            continue
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        for name, message in result["errors"]:
            report.error(f"(d) importing {name} failed: {message}")
        for importer, mod, where in result["attempts"]:
            report.error(
                f"(d) importing {importer} tries to import {mod} (at {where}); "
                f"{pkg.import_name} must not import {fmt_set(rule.forbidden)} "
                f"outside {fmt_set(rule.excluded)}"
            )
        for importer, mod in result["loaded"]:
            report.error(f"(d) importing {importer} loads {mod} into sys.modules")
        summaries.append(
            f"{pkg.import_name}: {len(result['imported'])} modules imported "
            f"(excluding {fmt_set(rule.excluded)}); none loads {fmt_set(rule.forbidden)}"
        )
    return summaries


def run(root: Path) -> int:
    root = root.resolve()
    report = Report()
    packages = discover(root, report)
    for pkg in packages:
        check_layout(pkg, root, report)
    check_known(packages, root, report)
    check_declared(packages, root, report)
    stats = ImportStats()
    check_imports(packages, root, report, stats)
    contract = ContractStats()
    check_contract(packages, root, report, contract)
    runtime = check_runtime(packages, root, report)

    listing = ", ".join(f"{p.dist} -> {fmt_set(p.hp_deps(include_test=True))}" for p in packages)
    print(f"check_dag: {len(packages)} package(s) under {root / 'packages'}: {listing or '-'}")
    print("  (a) declared hp-* dependencies allowed by the DAG table and present")
    print(
        f"  (b) {stats.hp_imports} hp_* import(s) in {stats.files} file(s) of src/ and tests/ "
        "are declared dependencies"
    )
    for pkg_name, restrictions in RESTRICTED_IMPORTS.items():
        rules = ", ".join(
            f"{r.module} only in {fmt_set(r.only_in)}" if r.only_in else f"{r.module} never"
            for r in restrictions
        )
        print(f"  (c) {pkg_name} imports {rules}")
    for line in runtime or ["no package with a runtime rule present"]:
        print(f"  (d) runtime: {line}")
    print(f"  (e) every package directory has a row in {TABLE_NAME}")
    print(
        "  (f) layout: name, src/<import>/{__init__.py,py.typed}, tests/, README.md, "
        "CHANGELOG.md, [test] extra"
    )
    print(
        f"  (g) test-only {fmt_set(set(TEST_ONLY))}: only in `test` extras, imported only from "
        "tests/; "
        + ", ".join(
            f"{name} imports only the standard library and {fmt_set(allowed)}"
            for name, allowed in ALLOWED_THIRD_PARTY.items()
        )
    )
    shorts = fmt_set({short_name(p.import_name) for p in packages if is_hp(p.import_name)})
    print(
        f"  (h) contract: {contract.hp_imports} import(s) of another hp package name no private "
        f"module or name; {contract.state_names} {PRIVATE_STATE_PREFIX}... string(s)/attribute(s) "
        f"carry their own package's {PRIVATE_STATE_PREFIX}<short>_ prefix ({shorts})"
    )
    if report.errors:
        print(f"\ncheck_dag: FAILED, {len(report.errors)} problem(s):", file=sys.stderr)
        for message in report.errors:
            print(f"  - {message}", file=sys.stderr)
        return 1
    print("check_dag: OK")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository root holding packages/ (default: this checkout)",
    )
    args = parser.parse_args(argv)
    return run(args.root)


if __name__ == "__main__":
    sys.exit(main())

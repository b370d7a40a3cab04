#!/usr/bin/env python3
"""Report the structural debts of the packages' sources: long functions and import cycles.

Run as ``python tools/check_structure.py [--root DIR] [--summary] [--max-lines N]``. It reads
every ``packages/*/src/**/*.py`` (with ``ast``; nothing is imported) and reports

(a) every function or method longer than ``--max-lines`` (80) lines, counted from its ``def``
    line to its last line (decorators excluded, docstring included), with its length, file,
    line and qualified name (``Class.method``, ``outer.inner``);
(b) every import cycle among the module-level imports of one package (the modules under one
    ``src/<import name>/``), printed as the strongly connected components of the import graph.
    A package's ``__init__`` is a module like any other, so ``hp_x/__init__.py`` importing
    ``hp_x.a`` while ``hp_x/a.py`` does ``from hp_x import B`` is a cycle. Imports inside a
    function body or under ``if TYPE_CHECKING:`` are not edges: they do not run at import time.
    ``from pkg import name`` is an edge to ``pkg`` (it reads ``pkg``'s namespace, which may be
    partly initialized) and also to ``pkg.name`` when that is a submodule; ``import pkg.mod`` is
    an edge to ``pkg.mod`` only (it reads no namespace of a parent).

``--summary`` prints the two counts only. The exit status is 1 when anything is found, else 0.
Why: a long function hides several concepts in one place, and an import cycle makes the
import order (and so which names exist when) depend on which module a user imports first.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

MAX_LINES = 80


@dataclass(frozen=True)
class LongFunction:
    """A function over the line limit: where it is and how long it is."""

    path: Path
    line: int
    qualname: str
    length: int


@dataclass(frozen=True)
class ImportCycle:
    """One strongly connected component of two or more modules."""

    package: str
    modules: tuple[str, ...]


@dataclass(frozen=True)
class Report:
    """Everything found under one repository root."""

    long_functions: tuple[LongFunction, ...]
    cycles: tuple[ImportCycle, ...]

    @property
    def clean(self) -> bool:
        """True when nothing was found."""
        return not self.long_functions and not self.cycles


def source_files(root: Path) -> Iterator[tuple[str, Path, Path]]:
    """Yield ``(import name, src dir, file)`` for every ``packages/*/src/<pkg>/**/*.py``."""
    for src in sorted((root / "packages").glob("*/src")):
        for pkg_dir in sorted(p for p in src.iterdir() if (p / "__init__.py").is_file()):
            for path in sorted(pkg_dir.rglob("*.py")):
                yield pkg_dir.name, src, path


def module_name(src: Path, path: Path) -> str:
    """The dotted module name of ``path`` below ``src`` (a package's ``__init__`` is its name)."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# ---------------------------------------------------------------------------- long functions


def long_functions(tree: ast.Module, path: Path, max_lines: int) -> list[LongFunction]:
    """Every function or method in ``tree`` whose ``def``-to-end span exceeds ``max_lines``."""
    found: list[LongFunction] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                qualname = f"{prefix}{child.name}"
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > max_lines:
                    found.append(LongFunction(path, child.lineno, qualname, length))
                visit(child, f"{qualname}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


# ------------------------------------------------------------------------------ import graph


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` (any module prefix)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def module_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported.

    Function bodies are skipped (they run later); so is the body of ``if TYPE_CHECKING:``
    (never at run time), but not its ``else``. Class bodies, ``try``, ``with`` and other
    ``if`` blocks run at import time and are searched.
    """

    def walk(body: Sequence[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for stmt in body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                yield stmt
            elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            elif isinstance(stmt, ast.If):
                if not _is_type_checking(stmt.test):
                    yield from walk(stmt.body)
                yield from walk(stmt.orelse)
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    for sub in getattr(stmt, field, []):
                        if isinstance(sub, ast.stmt):
                            yield from walk([sub])
                        elif hasattr(sub, "body"):
                            yield from walk(sub.body)

    yield from walk(tree.body)


def import_targets(
    stmt: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: frozenset[str]
) -> Iterator[str]:
    """The modules of ``modules`` that ``stmt``, written in ``module``, imports."""
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.name in modules:
                yield alias.name
        return
    if stmt.level:
        base_parts = module.split(".") if is_package else module.split(".")[:-1]
        base_parts = base_parts[: len(base_parts) - (stmt.level - 1)]
        base = ".".join([*base_parts, stmt.module] if stmt.module else base_parts)
    else:
        base = stmt.module or ""
    if base in modules:
        yield base
    for alias in stmt.names:
        if f"{base}.{alias.name}" in modules:
            yield f"{base}.{alias.name}"


def import_graph(files: Mapping[str, tuple[Path, ast.Module]]) -> dict[str, set[str]]:
    """Module -> the modules of the same set it imports at module level."""
    modules = frozenset(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for name, (path, tree) in files.items():
        is_package = path.name == "__init__.py"
        for stmt in module_level_imports(tree):
            graph[name].update(import_targets(stmt, name, is_package, modules))
        graph[name].discard(name)  # an __init__'s ``from . import sub`` reads its own namespace
    return graph


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative, deterministic order)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def import_cycles(package: str, files: Mapping[str, tuple[Path, ast.Module]]) -> list[ImportCycle]:
    """The import cycles among one package's modules."""
    graph = import_graph(files)
    return [ImportCycle(package, tuple(c)) for c in strongly_connected(graph) if len(c) > 1]


# ------------------------------------------------------------------------------------ driver


def check(root: Path, max_lines: int = MAX_LINES) -> Report:
    """Measure every package source under ``root``."""
    longs: list[LongFunction] = []
    per_package: dict[str, dict[str, tuple[Path, ast.Module]]] = {}
    for package, src, path in source_files(root):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        longs.extend(long_functions(tree, path.relative_to(root), max_lines))
        per_package.setdefault(package, {})[module_name(src, path)] = (path, tree)
    cycles = [c for pkg, files in sorted(per_package.items()) for c in import_cycles(pkg, files)]
    return Report(tuple(longs), tuple(cycles))


def render(report: Report, max_lines: int, summary: bool) -> str:
    """The report as text: counts only with ``summary``, else one line per finding."""
    lines = [
        f"functions over {max_lines} lines: {len(report.long_functions)}",
        f"import cycles: {len(report.cycles)}",
    ]
    if summary:
        return "\n".join(lines)
    out = [lines[0]]
    out += [f"  {f.path}:{f.line}: {f.qualname} ({f.length} lines)" for f in report.long_functions]
    out.append(lines[1])
    out += [f"  {c.package}: {' <-> '.join(c.modules)}" for c in report.cycles]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--summary", action="store_true", help="print the counts only")
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    args = parser.parse_args(argv)
    report = check(args.root, args.max_lines)
    print(render(report, args.max_lines, args.summary))
    return 0 if report.clean else 1


if __name__ == "__main__":
    sys.exit(main())

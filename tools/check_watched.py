#!/usr/bin/env python3
"""Report every collective in the packages' sources that the collective watchdog cannot name.

Run as ``python tools/check_watched.py [--root DIR]``. A collective or point-to-point call of
``torch.distributed`` (``dist.all_reduce(...)``, ``dist.batch_isend_irecv(...)``, ...) in
``packages/*/src/**/*.py`` must be visible to :mod:`hp_dtensor.watchdog`, so that a rank that
never joins it (or dies in it) is named with the collective, not left to the backend's bare
``Timed out waiting 3000ms``. A call is watched when

(a) it runs inside ``with ...watch(...)``;
(b) it is an argument of a call to ``watch_async`` or ``watch_p2p``;
(c) its result is assigned to a name that the same function passes to ``watch_async`` or
    ``watch_p2p``; or
(d) its statement carries a ``# watched: <where>`` comment (a coalesced batch whose handle is
    watched, a batch whose per-operation handles are).

Packages in :data:`EXEMPT` are skipped, each for the reason given there. The exit status is 1
when an unwatched call is found, else 0. Files are read with ``ast``; nothing is imported.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The calls of ``torch.distributed`` that wait on other ranks.
COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
    }
)
#: Names ``torch.distributed`` is imported as in the sources.
MODULE_NAMES = frozenset({"dist", "c10d"})
#: Packages not checked, and why.
EXEMPT = {
    "hp-testing": "the test harness: its rank pool's collectives carry their own timeouts",
    "hp-offload": (
        "depends on torch only (not hp-dtensor); TensorPool names each wait itself "
        "(TensorPool._wait: 'the request all-gather', the transfer and its peer)"
    ),
}
_ASYNC_WATCHERS = ("watch_async", "watch_p2p")
_MARK = "# watched:"


@dataclass(frozen=True)
class Unwatched:
    """A collective call no watchdog context sees."""

    path: Path
    line: int
    call: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.call}"


def _callee(node: ast.Call) -> str:
    return ast.unparse(node.func)


def _is_collective(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in COLLECTIVES
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id in MODULE_NAMES
    )


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _watched_names(function: ast.AST) -> set[str]:
    """The names passed (anywhere in their arguments) to watch_async / watch_p2p."""
    names: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and _callee(node).endswith(_ASYNC_WATCHERS):
            for argument in [*node.args, *(k.value for k in node.keywords)]:
                names |= {n.id for n in ast.walk(argument) if isinstance(n, ast.Name)}
    return names


def _is_watched(node: ast.Call, parents: dict[ast.AST, ast.AST], lines: Sequence[str]) -> bool:
    statement: ast.stmt | None = None
    current: ast.AST = node
    while current in parents:
        parent = parents[current]
        if statement is None and isinstance(parent, ast.stmt):
            statement = parent
        if isinstance(parent, ast.With) and any(
            isinstance(item.context_expr, ast.Call) and _callee(item.context_expr).endswith("watch")
            for item in parent.items
        ):
            return True
        if isinstance(parent, ast.Call) and _callee(parent).endswith(_ASYNC_WATCHERS):
            return True
        if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef):
            if isinstance(statement, ast.Assign):
                targets = {
                    n.id for t in statement.targets for n in ast.walk(t) if isinstance(n, ast.Name)
                }
                if targets & _watched_names(parent):
                    return True
            break
        current = parent
    first = statement.lineno if statement is not None else node.lineno
    last = statement.end_lineno or first if statement is not None else node.lineno
    return any(_MARK in lines[i - 1] for i in range(first, last + 1))


def find_unwatched(root: Path) -> Iterator[Unwatched]:
    """Every unwatched collective call under ``root/packages/*/src``, in file order."""
    for package in sorted(p for p in (root / "packages").iterdir() if p.is_dir()):
        if package.name in EXEMPT:
            continue
        for path in sorted((package / "src").rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text, filename=str(path))
            parents = _parents(tree)
            lines = text.splitlines()
            for node in ast.walk(tree):
                if _is_collective(node):
                    assert isinstance(node, ast.Call)
                    if not _is_watched(node, parents, lines):
                        call = ast.unparse(node)
                        yield Unwatched(path.relative_to(root), node.lineno, call[:100])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args(argv)
    found = sorted(find_unwatched(args.root), key=lambda u: (str(u.path), u.line))
    for unwatched in found:
        print(unwatched)
    if found:
        print(
            f"check_watched: {len(found)} collective(s) the watchdog cannot name: wrap each in "
            "`with hp_dtensor.watchdog.watch(name, group):`, or pass its work to watch_async / "
            "watch_p2p",
            file=sys.stderr,
        )
        return 1
    print("check_watched: OK (every collective is named on a timeout or a lost peer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

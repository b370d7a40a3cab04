"""Every benchmark prints the machine it ran on (figures from different CPUs are not
comparable): each script in ``benchmarks/`` calls ``_machine.machine_line`` in its ``main``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def _calls_in_main(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    main = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    assert main is not None, f"{path.name} has no main()"
    return {
        n.func.id
        for n in ast.walk(main)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_main_prints_the_machine_line(script: Path) -> None:
    assert "machine_line" in _calls_in_main(script), (
        f"{script.name}: print _machine.machine_line() in main() (CPU model and capability)"
    )

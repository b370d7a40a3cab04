"""Tests for tools/check_structure.py on small synthetic packages written to tmp_path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import check_structure

CHECKER = Path(check_structure.__file__).resolve()


def write_src(root: Path, dist: str, files: Mapping[str, str]) -> None:
    """Write ``packages/<dist>/src/<relative path>`` for each file (dedented)."""
    src = root / "packages" / dist / "src"
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def function_of(length: int, name: str, indent: str = "") -> str:
    """A function whose ``def`` line to last line spans exactly ``length`` lines."""
    body = [f"{indent}    x{i} = {i}" for i in range(length - 2)]
    return "\n".join([f"{indent}def {name}() -> None:", *body, f"{indent}    return None"]) + "\n"


def run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECKER), "--root", str(root), *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_81_line_function_is_found_80_is_not(tmp_path: Path) -> None:
    decorated = "@staticmethod\n@staticmethod\n" + function_of(80, "decorated", "    ")
    files = {
        "hp_a/__init__.py": "",
        "hp_a/mod.py": function_of(81, "too_long")
        + function_of(80, "just_fits")
        + "class Box:\n"
        + function_of(81, "method", "    ")
        + decorated.replace("@", "    @"),
    }
    write_src(tmp_path, "hp-a", files)
    report = check_structure.check(tmp_path)
    found = {(f.qualname, f.length) for f in report.long_functions}
    assert found == {("too_long", 81), ("Box.method", 81)}
    assert report.cycles == ()
    assert run(tmp_path).returncode == 1


def test_docstring_counts_and_nested_names(tmp_path: Path) -> None:
    outer = 'def outer() -> None:\n    """Doc."""\n' + function_of(81, "inner", "    ")
    write_src(tmp_path, "hp-a", {"hp_a/__init__.py": "", "hp_a/m.py": outer})
    found = {(f.qualname, f.length) for f in check_structure.check(tmp_path).long_functions}
    assert found == {("outer", 83), ("outer.inner", 81)}


def test_cycle_through_init(tmp_path: Path) -> None:
    files = {
        "hp_x/__init__.py": "from hp_x.a import A\nB = 1\n",
        "hp_x/a.py": "from hp_x import B\nA = B\n",
        "hp_x/b.py": "import hp_x.a\n",
    }
    write_src(tmp_path, "hp-x", files)
    report = check_structure.check(tmp_path)
    assert [(c.package, c.modules) for c in report.cycles] == [("hp_x", ("hp_x", "hp_x.a"))]
    result = run(tmp_path)
    assert result.returncode == 1
    assert "hp_x <-> hp_x.a" in result.stdout


def test_relative_cycle_between_submodules(tmp_path: Path) -> None:
    files = {
        "hp_x/__init__.py": "",
        "hp_x/sub/__init__.py": "from . import p\n",
        "hp_x/sub/p.py": "from .q import Q\n",
        "hp_x/sub/q.py": "from ..sub.p import P\n",
    }
    write_src(tmp_path, "hp-x", files)
    cycles = check_structure.check(tmp_path).cycles
    assert [c.modules for c in cycles] == [("hp_x.sub.p", "hp_x.sub.q")]


def test_type_checking_and_function_imports_are_not_cycles(tmp_path: Path) -> None:
    files = {
        "hp_x/__init__.py": "from hp_x.a import A\n",
        "hp_x/a.py": textwrap.dedent(
            """\
            from typing import TYPE_CHECKING
            import typing
            if TYPE_CHECKING:
                from hp_x import A
            if typing.TYPE_CHECKING:
                from hp_x.b import B
            def late() -> None:
                from hp_x import A
            class A:
                def method(self) -> None:
                    import hp_x.b
            """
        ),
        "hp_x/b.py": "from hp_x.a import A\nB = A\n",
    }
    write_src(tmp_path, "hp-x", files)
    report = check_structure.check(tmp_path)
    assert report.cycles == ()
    result = run(tmp_path, "--summary")
    assert result.returncode == 0
    assert result.stdout.splitlines() == ["functions over 80 lines: 0", "import cycles: 0"]


def test_import_in_else_of_type_checking_and_in_try_is_an_edge(tmp_path: Path) -> None:
    files = {
        "hp_x/__init__.py": "try:\n    from hp_x.a import A\nexcept ImportError:\n    pass\n",
        "hp_x/a.py": "if TYPE_CHECKING:\n    pass\nelse:\n    from hp_x import B\n",
    }
    write_src(tmp_path, "hp-x", files)
    assert [c.modules for c in check_structure.check(tmp_path).cycles] == [("hp_x", "hp_x.a")]


def test_summary_prints_counts_and_fails(tmp_path: Path) -> None:
    files = {
        "hp_x/__init__.py": "from hp_x import a\n",
        "hp_x/a.py": "from hp_x import b\n" + function_of(90, "f"),
        "hp_x/b.py": "from hp_x import a\n",
    }
    write_src(tmp_path, "hp-x", files)
    result = run(tmp_path, "--summary")
    assert result.returncode == 1
    assert result.stdout.splitlines() == ["functions over 80 lines: 1", "import cycles: 1"]

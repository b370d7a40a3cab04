"""CI collects every package's tests in each of its pytest processes (nox ``tests-all``),
where pytest's default import mode puts each tests folder on ``sys.path`` and imports its
modules by their bare names: two modules of one name in different packages would clash (a
collection error, or one package's helper imported by another's tests). Every module name must
be unique."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_folder_module_name_is_unique() -> None:
    folders = [*sorted(ROOT.glob("packages/*/tests")), ROOT / "tests" / "integration"]
    where: dict[str, list[str]] = defaultdict(list)
    for folder in folders:
        for module in folder.glob("*.py"):
            if module.name != "conftest.py":  # pytest imports conftests by path, not name
                where[module.stem].append(str(module.relative_to(ROOT)))
    assert len(folders) > 5
    clashes = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not clashes, f"module names used in more than one tests folder: {clashes}"

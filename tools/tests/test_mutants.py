"""Tests for tools/mutants/: the real list against the current tree, and the runner on a small
fake repository built in tmp_path (mutants that are caught, survive, time out, or whose tests
fail without them)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mutants import run

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------
# The real list
# ------------------------------------------------------------------------------------------------


def test_every_snippet_of_the_list_occurs_exactly_once_in_the_current_tree() -> None:
    mutants = run.load_mutants()
    assert len(mutants) >= 8  # the core paths listed in tools/mutants/README.md
    assert run.list_problems(mutants, REPO) == []


def test_every_mutant_is_tested_by_its_own_package() -> None:
    for mutant in run.load_mutants():
        parts = Path(mutant.file).parts
        assert parts[0] == "packages", mutant.id
        for test in mutant.tests:
            assert test.startswith(f"packages/{parts[1]}/tests/"), (mutant.id, test)


# ------------------------------------------------------------------------------------------------
# Parsing and checking a list
# ------------------------------------------------------------------------------------------------

GOOD: dict[str, Any] = {
    "id": "m",
    "file": "pkg.py",
    "original": "a + b",
    "replacement": "a - b",
    "tests": ["tests/test_pkg.py"],
    "description": "adds become subtractions",
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"id": ""}, "'id' must be a non-empty string"),
        ({"file": "/abs/pkg.py"}, "relative to the repository root"),
        ({"file": "../pkg.py"}, "relative to the repository root"),
        ({"replacement": "a + b"}, "other than 'original'"),
        ({"tests": []}, "'tests' must be a non-empty list"),
        ({"tests": "tests/test_pkg.py"}, "'tests' must be a non-empty list"),
        ({"timeout": 0}, "positive number of seconds"),
        ({"timeout": True}, "positive number of seconds"),
        ({"k": ""}, "'k' must be a non-empty string"),
        ({"description": None}, "'description' must be a non-empty string"),
        ({"extra": 1}, "unknown keys ['extra']"),
    ],
)
def test_malformed_entries_are_named(change: dict[str, Any], message: str) -> None:
    with pytest.raises(run.MutantListError, match=f"mutant .*{re.escape(message)}"):
        run.parse_mutants({"mutant": [{**GOOD, **change}]})


def test_list_level_errors() -> None:
    with pytest.raises(run.MutantListError, match="no \\[\\[mutant\\]\\] tables"):
        run.parse_mutants({})
    with pytest.raises(run.MutantListError, match="the id is used twice"):
        run.parse_mutants({"mutant": [GOOD, GOOD]})


def test_parsed_fields_and_pytest_arguments() -> None:
    (mutant,) = run.parse_mutants({"mutant": [{**GOOD, "k": "fast", "timeout": 5}]})
    assert mutant.pytest_args() == ["tests/test_pkg.py", "-k", "fast"]
    assert mutant.timeout == 5.0


def test_list_problems_name_missing_files_snippets_and_tests(tmp_path: Path) -> None:
    (tmp_path / "pkg.py").write_text("x = a + b\ny = a + b\n")
    (tmp_path / "one.py").write_text("x = a + b\n")
    mutants = run.parse_mutants(
        {
            "mutant": [
                {**GOOD, "id": "twice"},
                {**GOOD, "id": "absent", "original": "a * b"},
                {**GOOD, "id": "nofile", "file": "gone.py"},
                {**GOOD, "id": "fine", "file": "one.py"},
            ]
        }
    )
    problems = run.list_problems(mutants, tmp_path)
    assert problems[0].startswith("twice: the original snippet occurs 2 times in pkg.py")
    assert problems[1] == "twice: test path tests/test_pkg.py does not exist"
    assert problems[2].startswith("absent: the original snippet occurs 0 times")
    assert problems[4] == "nofile: gone.py does not exist"
    assert problems[5] == "fine: test path tests/test_pkg.py does not exist"
    assert len(problems) == 6


def test_select_by_ids() -> None:
    mutants = run.parse_mutants({"mutant": [{**GOOD, "id": n} for n in ("a", "b", "c")]})
    assert [m.id for m in run.select(mutants, [])] == ["a", "b", "c"]
    assert [m.id for m in run.select(mutants, ["c,a"])] == ["a", "c"]
    assert [m.id for m in run.select(mutants, ["b", "a"])] == ["a", "b"]
    with pytest.raises(run.MutantListError, match=r"unknown mutant ids \['d'\]"):
        run.select(mutants, ["a,d"])


def test_apply_and_restore_round_trip_and_drop_the_bytecode(tmp_path: Path) -> None:
    source = tmp_path / "pkg.py"
    source.write_text("def f(a, b):\n    return a + b\n")
    cached = Path(importlib.util.cache_from_source(str(source)))
    cached.parent.mkdir()
    cached.write_bytes(b"stale")
    (mutant,) = run.parse_mutants({"mutant": [GOOD]})
    original = run.apply(tmp_path, mutant)
    assert source.read_text() == "def f(a, b):\n    return a - b\n"
    assert not cached.exists()
    run.restore(tmp_path, mutant, original)
    assert source.read_text() == original == "def f(a, b):\n    return a + b\n"
    # Applying twice finds the snippet gone.
    run.apply(tmp_path, mutant)
    with pytest.raises(run.MutantListError, match="occurs 0 times in the copy"):
        run.apply(tmp_path, mutant)


# ------------------------------------------------------------------------------------------------
# The runner on a fake repository
# ------------------------------------------------------------------------------------------------

MODULE = '''\
"""Arithmetic."""


def add(a, b):
    return a + b


def mul(a, b):
    return a * b


def neg(a):
    return -a
'''

TESTS = """\
from fake_pkg import add, neg


def test_add():
    assert add(2, 3) == 5


def test_neg_is_wrong():
    assert neg(1) == 1
"""

LIST = """\
[[mutant]]
id = "add-breaks"
file = "packages/fake-pkg/src/fake_pkg/__init__.py"
original = "    return a + b"
replacement = "    return a - b"
tests = ["packages/fake-pkg/tests/test_fake.py::test_add"]
description = "add subtracts"

[[mutant]]
id = "mul-untested"
file = "packages/fake-pkg/src/fake_pkg/__init__.py"
original = "    return a * b"
replacement = "    return a ** b"
tests = ["packages/fake-pkg/tests/test_fake.py"]
k = "add"
description = "nothing tests mul"

[[mutant]]
id = "add-hangs"
file = "packages/fake-pkg/src/fake_pkg/__init__.py"
original = "    return a + b"
replacement = "    return __import__('time').sleep(120)"
tests = ["packages/fake-pkg/tests/test_fake.py::test_add"]
timeout = 8
description = "add never returns"

[[mutant]]
id = "neg-baseline"
file = "packages/fake-pkg/src/fake_pkg/__init__.py"
original = "    return -a"
replacement = "    return a"
tests = ["packages/fake-pkg/tests/test_fake.py::test_neg_is_wrong"]
description = "its test fails on the unmodified code"
"""


def fake_repository(root: Path) -> Path:
    """A tree with one package, ``fake_pkg``, its tests, and LIST as its mutants."""
    src = root / "packages" / "fake-pkg" / "src" / "fake_pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text(MODULE)
    tests = root / "packages" / "fake-pkg" / "tests"
    tests.mkdir()
    (tests / "test_fake.py").write_text(TESTS)
    (root / "pyproject.toml").write_text('[tool.pytest.ini_options]\nminversion = "8.0"\n')
    (root / ".git").mkdir()  # left out of the copy
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / "mutants.toml").write_text(LIST)
    return root


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_runner_judges_each_outcome_and_leaves_the_source_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = fake_repository(tmp_path / "repo")
    before = _snapshot(repo)
    status = run.main(["--source", str(repo), "--mutants", str(repo / "mutants.toml")])
    out = capsys.readouterr().out
    ids = ("add-breaks", "mul-untested", "add-hangs", "neg-baseline")
    rows = {i: line for line in out.splitlines() for i in ids if line.startswith(f"{i} ")}
    assert "caught " in rows["add-breaks"], out
    assert "survived" in rows["mul-untested"], out
    assert "caught (timeout)" in rows["add-hangs"], out
    assert "baseline fails" in rows["neg-baseline"], out
    assert "4 mutants: 2 caught, 1 survived, 1 not judged" in out
    assert status == 1  # a survivor
    assert _snapshot(repo) == before
    copy = Path(out.split("scratch copy: ", 1)[1].split()[0])
    assert not copy.exists()  # removed without --keep


def test_runner_exit_status_without_survivors(tmp_path: Path) -> None:
    repo = fake_repository(tmp_path / "repo")
    argv = ["--source", str(repo), "--mutants", str(repo / "mutants.toml")]
    assert run.main([*argv, "--only", "add-breaks"]) == 0
    assert run.main([*argv, "--only", "add-breaks,neg-baseline"]) == 2


def test_copy_leaves_out_git_and_caches(tmp_path: Path) -> None:
    repo = fake_repository(tmp_path / "repo")
    (repo / "packages" / "fake-pkg" / "src" / "fake_pkg" / "__pycache__").mkdir()
    (repo / ".venv").mkdir()
    copy = run.make_copy(repo, tmp_path / "copy")
    assert (copy / "packages" / "fake-pkg" / "tests" / "test_fake.py").is_file()
    assert (copy / "mutants.toml").is_file()
    for left_out in (".git", ".venv", "packages/fake-pkg/src/fake_pkg/__pycache__"):
        assert not (copy / left_out).exists(), left_out


def test_import_check_refuses_code_imported_from_elsewhere(tmp_path: Path) -> None:
    repo = fake_repository(tmp_path / "repo")
    copy = run.make_copy(repo, tmp_path / "copy")
    env = run.environment_for(copy, base=os.environ)
    assert run.import_problems(copy, env) == []
    # The source tree's package ahead of the copy's: what an install of the source would do.
    elsewhere = dict(env, PYTHONPATH=str(repo / "packages" / "fake-pkg" / "src"))
    (problem,) = run.import_problems(copy, elsewhere)
    assert problem.startswith("fake_pkg is imported from ")
    assert problem.endswith("not from the scratch copy")


def test_check_and_list_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo = fake_repository(tmp_path / "repo")
    argv = ["--source", str(repo), "--mutants", str(repo / "mutants.toml")]
    assert run.main([*argv, "--check"]) == 0
    assert "4 mutants; every snippet occurs exactly once" in capsys.readouterr().out
    assert run.main([*argv, "--list", "--only", "mul-untested"]) == 0
    assert capsys.readouterr().out.startswith("mul-untested\t")
    (repo / "packages" / "fake-pkg" / "src" / "fake_pkg" / "__init__.py").write_text("")
    assert run.main([*argv, "--check"]) == 2
    assert "occurs 0 times" in capsys.readouterr().err


def test_the_script_runs_on_its_own() -> None:
    script = Path(run.__file__)
    done = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{len(run.load_mutants())} mutants;")

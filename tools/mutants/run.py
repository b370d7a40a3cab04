"""Run the planted faults of ``tools/mutants/mutants.toml`` and report which are caught.

For every selected mutant: the tests it names must pass on an unmodified scratch copy of the
working tree (else it is reported ``baseline fails``); then its snippet is replaced in the copy,
the tests are run again (``caught`` when they fail, ``survived`` when they pass) and the file is
restored. A table is printed at the end; the exit status is 1 if any mutant survived, 2 if none
survived but some could not be judged (baseline fails, errors, bad list), 0 if all were caught.

The copy is a plain copy of the working tree (uncommitted and untracked files included; ``.git``,
``.nox``, virtual environments, ``dist`` and caches left out), so the source tree is never
touched. Its code must be what the tests import:

* ``nox -s mutants`` copies the tree (``--copy-to``), installs every package editable from the
  copy into the session's venv, then runs this script on it (``--tree``);
* ``python tools/mutants/run.py`` in an environment whose packages are installed editable from
  the source tree puts the copy's ``packages/*/src`` first on ``PYTHONPATH`` (editable installs
  by path entries come after it). Either way, before anything runs, a check imports every package
  and stops if one is imported from anywhere but the copy.

Standard library only (no torch): the ``dag`` session tests it without the packages installed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MUTANTS_FILE = Path(__file__).resolve().parent / "mutants.toml"
DEFAULT_TIMEOUT = 900.0

#: Names (at any depth) the scratch copy leaves out: version control, environments, build
#: outputs and caches. None of them holds source the tests need.
EXCLUDED_NAMES = frozenset(
    {
        ".git",
        ".nox",
        ".venv",
        "venv",
        "dist",
        "__pycache__",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        ".hypothesis",
        "build",
        "hp_train_out",
    }
)
#: Left out at the top of the tree only (ignored run outputs of the repository's tooling).
EXCLUDED_AT_TOP = frozenset({"runs", ".device"})

CAUGHT = "caught"
SURVIVED = "survived"
BASELINE_FAILS = "baseline fails"
ERROR = "error"

#: pytest exit codes: 1 tests failed, 2 interrupted (e.g. a collection error: the mutant broke
#: an import); 3 internal error, 4 usage error and 5 no tests collected say nothing about the
#: mutant, so they are errors of the list or of the run, never a catch.
_PYTEST_FAILED = frozenset({1, 2})

_FIELDS = {"id", "file", "original", "replacement", "tests", "k", "timeout", "description"}


class MutantListError(ValueError):
    """The mutant list is malformed."""


@dataclass(frozen=True)
class Mutant:
    """One planted fault (see the comment at the top of mutants.toml)."""

    id: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    description: str
    k: str | None = None
    timeout: float | None = None

    def pytest_args(self) -> list[str]:
        """The test selection as pytest arguments."""
        return [*self.tests, *(["-k", self.k] if self.k else [])]


@dataclass(frozen=True)
class Outcome:
    """How one run of some tests ended."""

    status: str  # "passed", "failed", "timeout" or "error"
    seconds: float
    detail: str = ""


@dataclass(frozen=True)
class Report:
    """The verdict on one mutant."""

    mutant: Mutant
    result: str  # CAUGHT, SURVIVED, BASELINE_FAILS or ERROR
    seconds: float
    detail: str = ""


# ------------------------------------------------------------------------------------------------
# The list
# ------------------------------------------------------------------------------------------------


def _string(entry: Mapping[str, Any], key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise MutantListError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return value


def parse_mutants(data: Mapping[str, Any], source: str = "mutants.toml") -> list[Mutant]:
    """The mutants of a parsed list (``[[mutant]]`` tables); raises MutantListError."""
    entries = data.get("mutant")
    if not isinstance(entries, list) or not entries:
        raise MutantListError(f"{source}: no [[mutant]] tables")
    mutants: list[Mutant] = []
    seen: set[str] = set()
    for number, entry in enumerate(entries, start=1):
        where = f"{source}: mutant {number}"
        if not isinstance(entry, dict):
            raise MutantListError(f"{where}: not a table")
        unknown = sorted(set(entry) - _FIELDS)
        if unknown:
            raise MutantListError(f"{where}: unknown keys {unknown}; known: {sorted(_FIELDS)}")
        ident = _string(entry, "id", where)
        where = f"{source}: mutant {ident!r}"
        if ident in seen:
            raise MutantListError(f"{where}: the id is used twice")
        seen.add(ident)
        file = _string(entry, "file", where)
        if Path(file).is_absolute() or ".." in Path(file).parts:
            raise MutantListError(f"{where}: 'file' must be relative to the repository root")
        original = _string(entry, "original", where)
        replacement = entry.get("replacement")
        if not isinstance(replacement, str) or replacement == original:
            raise MutantListError(f"{where}: 'replacement' must be a string other than 'original'")
        tests = entry.get("tests")
        if (
            not isinstance(tests, list)
            or not tests
            or not all(isinstance(t, str) and t for t in tests)
        ):
            raise MutantListError(f"{where}: 'tests' must be a non-empty list of strings")
        k = entry.get("k")
        if k is not None and (not isinstance(k, str) or not k):
            raise MutantListError(f"{where}: 'k' must be a non-empty string")
        timeout = entry.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise MutantListError(f"{where}: 'timeout' must be a positive number of seconds")
        mutants.append(
            Mutant(
                id=ident,
                file=file,
                original=original,
                replacement=replacement,
                tests=tuple(tests),
                description=_string(entry, "description", where),
                k=k,
                timeout=None if timeout is None else float(timeout),
            )
        )
    return mutants


def load_mutants(path: Path = MUTANTS_FILE) -> list[Mutant]:
    """The mutants of the list at ``path``; raises MutantListError (or OSError)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise MutantListError(f"{path}: {exc}") from exc
    return parse_mutants(data, str(path))


def list_problems(mutants: Iterable[Mutant], root: Path) -> list[str]:
    """Why mutants cannot be applied to the tree at ``root``: a missing file, a snippet that
    occurs zero or several times, a test path that does not exist."""
    problems: list[str] = []
    for mutant in mutants:
        path = root / mutant.file
        if not path.is_file():
            problems.append(f"{mutant.id}: {mutant.file} does not exist")
            continue
        count = path.read_text(encoding="utf-8").count(mutant.original)
        if count != 1:
            problems.append(
                f"{mutant.id}: the original snippet occurs {count} times in {mutant.file} "
                f"(must be exactly once): {mutant.original!r}"
            )
        for test in mutant.tests:
            test_path = test.split("::", 1)[0]
            if not (root / test_path).exists():
                problems.append(f"{mutant.id}: test path {test_path} does not exist")
    return problems


def select(mutants: Sequence[Mutant], only: Sequence[str]) -> list[Mutant]:
    """The mutants named in ``only`` (ids, each possibly a comma-separated list), in list
    order; all of them when ``only`` is empty. Raises MutantListError for an unknown id."""
    wanted = {name.strip() for item in only for name in item.split(",") if name.strip()}
    if not wanted:
        return list(mutants)
    known = {m.id for m in mutants}
    unknown = sorted(wanted - known)
    if unknown:
        raise MutantListError(f"unknown mutant ids {unknown}; known: {sorted(known)}")
    return [m for m in mutants if m.id in wanted]


# ------------------------------------------------------------------------------------------------
# The scratch copy
# ------------------------------------------------------------------------------------------------


def make_copy(source: Path, dest: Path) -> Path:
    """Copy the working tree at ``source`` into ``dest`` (which must not exist yet)."""
    top = str(source)

    def ignore(directory: str, names: list[str]) -> set[str]:
        left_out = {n for n in names if n in EXCLUDED_NAMES or n.endswith(".egg-info")}
        if directory == top:
            left_out |= EXCLUDED_AT_TOP.intersection(names)
        return left_out

    shutil.copytree(source, dest, symlinks=True, ignore=ignore)
    return dest


def src_dirs(tree: Path) -> list[Path]:
    """The ``packages/*/src`` folders of ``tree``."""
    return sorted(p for p in tree.glob("packages/*/src") if p.is_dir())


def import_names(tree: Path) -> list[str]:
    """Top-level packages under ``packages/*/src`` of ``tree``."""
    return sorted(
        p.name for src in src_dirs(tree) for p in src.iterdir() if (p / "__init__.py").is_file()
    )


def environment_for(tree: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the tests run in: ``tree``'s sources first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    paths = [str(p) for p in src_dirs(tree)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Multi-process tests on small machines (what the nox sessions set too).
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


_IMPORT_CHECK = """
import importlib, pathlib, sys
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
    except Exception as exc:
        print(f"{name}\\tcannot be imported: {type(exc).__name__}: {exc}")
    else:
        print(f"{name}\\t{pathlib.Path(module.__file__).resolve()}")
"""


def import_problems(tree: Path, env: Mapping[str, str]) -> list[str]:
    """Packages of ``tree`` that, under ``env``, are not imported from ``tree``."""
    names = import_names(tree)
    if not names:
        return [f"no packages under {tree}/packages/*/src"]
    done = subprocess.run(
        # -P: the working directory is not put on sys.path (as for pytest below).
        [sys.executable, "-P", "-c", _IMPORT_CHECK, *names],
        cwd=tree,
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        return [f"the import check failed: {done.stderr.strip()[-2000:]}"]
    problems = []
    resolved = tree.resolve()
    for line in done.stdout.splitlines():
        name, _, where = line.partition("\t")
        if not Path(where).is_absolute() or not Path(where).is_relative_to(resolved):
            problems.append(f"{name} is imported from {where}, not from the scratch copy")
    return problems


# ------------------------------------------------------------------------------------------------
# Running tests
# ------------------------------------------------------------------------------------------------


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the test run ``proc`` and everything it started (its own process group)."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_tests(
    tree: Path, args: Sequence[str], env: Mapping[str, str], timeout: float, log: Path
) -> Outcome:
    """pytest ``args`` in ``tree`` (its root config), output to ``log``."""
    command = [
        sys.executable,
        "-P",
        "-m",
        "pytest",
        "-c",
        str(tree / "pyproject.toml"),
        "--rootdir",
        str(tree),
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        *args,
    ]
    began = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        out.write(("$ " + " ".join(command) + "\n").encode())
        out.flush()
        # A session of its own, so that a timeout ends the rank processes the tests spawned.
        proc = subprocess.Popen(
            command, cwd=tree, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return Outcome("timeout", time.monotonic() - began, f"over {timeout:g} s")
        except BaseException:
            _stop(proc)
            raise
    seconds = time.monotonic() - began
    if code == 0:
        return Outcome("passed", seconds)
    if code in _PYTEST_FAILED:
        return Outcome("failed", seconds, f"pytest exit {code}")
    return Outcome("error", seconds, f"pytest exit {code} (see {log})")


def _forget_bytecode(path: Path) -> None:
    # A rewrite within the second the cached bytecode was stamped with, with the same size,
    # would let Python run the stale .pyc; remove it.
    with contextlib.suppress(NotImplementedError):  # no cache tag: no bytecode cache either
        Path(importlib.util.cache_from_source(str(path))).unlink(missing_ok=True)


def apply(tree: Path, mutant: Mutant) -> str:
    """Put ``mutant`` into ``tree``; returns the file's original text (for :func:`restore`)."""
    path = tree / mutant.file
    text = path.read_text(encoding="utf-8")
    count = text.count(mutant.original)
    if count != 1:
        raise MutantListError(
            f"{mutant.id}: the original snippet occurs {count} times in the copy's {mutant.file}"
        )
    path.write_text(text.replace(mutant.original, mutant.replacement), encoding="utf-8")
    _forget_bytecode(path)
    return text


def restore(tree: Path, mutant: Mutant, text: str) -> None:
    """Undo :func:`apply`."""
    path = tree / mutant.file
    path.write_text(text, encoding="utf-8")
    _forget_bytecode(path)


def judge(
    mutants: Sequence[Mutant],
    tree: Path,
    env: Mapping[str, str],
    default_timeout: float,
    logs: Path,
    echo: bool = True,
) -> list[Report]:
    """Baselines first (each distinct test selection once), then every mutant."""

    def say(line: str) -> None:
        if echo:
            print(line, flush=True)

    def timeout_of(mutant: Mutant) -> float:
        return mutant.timeout or default_timeout

    baselines: dict[tuple[str, ...], Outcome] = {}
    for mutant in mutants:
        key = tuple(mutant.pytest_args())
        if key in baselines:
            continue
        # One run for every mutant with this selection: the longest timeout among them.
        limit = max(timeout_of(m) for m in mutants if tuple(m.pytest_args()) == key)
        log = logs / f"baseline-{len(baselines):02d}.log"
        say(f"baseline: {' '.join(key)}")
        baselines[key] = outcome = run_tests(tree, key, env, limit, log)
        say(f"  {outcome.status} in {outcome.seconds:.0f} s{_suffix(outcome.detail)}")

    reports: list[Report] = []
    for mutant in mutants:
        baseline = baselines[tuple(mutant.pytest_args())]
        if baseline.status != "passed":
            detail = f"unmodified: {baseline.status}{_suffix(baseline.detail)}"
            reports.append(Report(mutant, BASELINE_FAILS, 0.0, detail))
            continue
        say(f"mutant {mutant.id}: {mutant.description}")
        text = apply(tree, mutant)
        try:
            outcome = run_tests(
                tree, mutant.pytest_args(), env, timeout_of(mutant), logs / f"{mutant.id}.log"
            )
        finally:
            restore(tree, mutant, text)
        if outcome.status == "passed":
            result = SURVIVED
        elif outcome.status in ("failed", "timeout"):
            # A timeout is a catch (the tests did not pass), marked as such in the table.
            result = CAUGHT
        else:
            result = ERROR
        detail = "timeout" if outcome.status == "timeout" else outcome.detail
        reports.append(Report(mutant, result, outcome.seconds, detail))
        say(f"  {result} in {outcome.seconds:.0f} s{_suffix(detail)}")
    return reports


def _suffix(detail: str) -> str:
    return f" ({detail})" if detail else ""


def table(reports: Sequence[Report]) -> str:
    """The result table (plain text, one row per mutant, then the descriptions)."""
    rows = [("mutant", "result", "time", "tests")]
    for r in reports:
        result = r.result + (" (timeout)" if r.detail == "timeout" else "")
        seconds = f"{r.seconds:.0f} s" if r.seconds else "-"
        rows.append((r.mutant.id, result, seconds, " ".join(r.mutant.pytest_args())))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        "  ".join([*(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)), row[3]])
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in [*widths, len(rows[0][3])]))
    lines.append("")
    lines += [f"{r.mutant.id}: {r.mutant.description}" for r in reports]
    lines += [f"{r.mutant.id}: {r.detail}" for r in reports if r.result in (BASELINE_FAILS, ERROR)]
    return "\n".join(lines)


def exit_status(reports: Sequence[Report]) -> int:
    """1 if a mutant survived, else 2 if one could not be judged, else 0."""
    results = {r.result for r in reports}
    if SURVIVED in results:
        return 1
    return 2 if results - {CAUGHT} else 0


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Apply each planted fault in a scratch copy of the tree and run its tests.",
    )
    parser.add_argument(
        "--only", action="append", default=[], metavar="ID[,ID]", help="run only these mutants"
    )
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--check", action="store_true", help="only check the list against the source tree"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds per test run unless the mutant sets its own (default {DEFAULT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--mutants", type=Path, default=MUTANTS_FILE, help="the list (default: mutants.toml here)"
    )
    parser.add_argument(
        "--source", type=Path, default=ROOT, help="the tree to copy (default: this repository)"
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--copy-to", type=Path, metavar="DIR", help="only make the scratch copy in DIR and exit"
    )
    where.add_argument(
        "--tree",
        type=Path,
        metavar="DIR",
        help="use the copy already in DIR (made by --copy-to, packages installed from it)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the scratch copy this run made (and print it)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    options = _parser().parse_args(argv)
    source: Path = options.source.resolve()
    try:
        mutants = select(load_mutants(options.mutants), options.only)
    except (MutantListError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if options.list:
        for m in mutants:
            print(f"{m.id}\t{m.file}\t{m.description}")
        return 0
    origin = options.tree.resolve() if options.tree else source
    problems = list_problems(mutants, origin)
    if problems or options.check:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if not problems:
            print(f"{len(mutants)} mutants; every snippet occurs exactly once in {origin}")
        return 2 if problems else 0
    if options.copy_to:
        make_copy(source, options.copy_to.resolve())
        print(f"copied {source} to {options.copy_to}")
        return 0

    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="hp-mutants-"))
    logs = workdir / "logs"
    if options.tree:
        tree = origin
    else:
        tree = make_copy(source, workdir / "tree")
        print(f"scratch copy: {tree}")
    try:
        env = environment_for(tree)
        trouble = import_problems(tree, env)
        if trouble:
            for line in trouble:
                print(f"error: {line}", file=sys.stderr)
            print(
                "error: the tests would not run the copy's code; use `nox -s mutants`, which "
                "installs the packages from the copy",
                file=sys.stderr,
            )
            return 2
        reports = judge(mutants, tree, env, options.timeout, logs)
    finally:
        if not options.tree and not options.keep:
            shutil.rmtree(tree, ignore_errors=True)
    print()
    print(table(reports))
    minutes = (time.monotonic() - began) / 60
    counts = {r: sum(1 for x in reports if x.result == r) for r in (CAUGHT, SURVIVED)}
    print(
        f"\n{len(reports)} mutants: {counts[CAUGHT]} caught, {counts[SURVIVED]} survived, "
        f"{len(reports) - counts[CAUGHT] - counts[SURVIVED]} not judged; {minutes:.1f} min; "
        f"logs in {logs}" + (f"; copy kept in {tree}" if options.keep and not options.tree else "")
    )
    return exit_status(reports)


if __name__ == "__main__":
    sys.exit(main())

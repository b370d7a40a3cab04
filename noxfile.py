"""Nox sessions for the hyper-parallel monorepo.

Every package under ``packages/<dist>/`` gets four sessions, generated from its
``pyproject.toml``:

* ``tests-<dist>``: a fresh venv with only the package and its hp-* DAG closure, installed
  non-editable from local paths in one pip call (plus the package's ``test`` extra), then
  pytest on ``packages/<dist>/tests`` from a directory where ``src/`` is not importable;
* ``mypy-<dist>``: ``mypy --strict`` (root config) over the package's ``src/`` and ``tests/``;
* ``build-<dist>``: wheel + sdist into ``dist/<dist>/``, wheel contents checked, the wheel
  installed with only its DAG closure (no test extras) in a venv of its own and imported from
  site-packages;
* ``check-<dist>``: the three above in one environment (a package's tests against only its DAG
  closure, for working on one package).

Plus ``lint`` (ruff), ``dag`` (tools/check_dag.py, its tests and its types), ``tests-all``
(every package's tests, ``tests/integration`` and mypy over every package in one environment
holding all packages: one torch install and one mypy cache), ``build-all`` (every wheel and
sdist built and checked, then each package's isolated install: its requirements resolved
against the built wheels only, and an import with only its closure's wheels on the path),
``integration`` (``tests/integration`` alone), ``demo``, ``bench``, ``dev``, ``mutants`` and
``ci``. ``lint``, ``dag``, ``tests-all`` and ``build-all`` carry the tag ``ci``: ``nox -t ci``
runs them (that is what CI runs); ``nox -s ci`` queues the same sessions. Every pip call is
constrained by ``constraints/ci.txt`` (torch must never be resolved unpinned).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tarfile
import threading
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS = ROOT / "constraints" / "ci.txt"
PYPROJECT = ROOT / "pyproject.toml"
DIST_DIR = ROOT / "dist"
CI_TAG = "ci"
TEST_EXTRA = "test"

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.error_on_external_run = True

# pip: every install is constrained. PIP_CONSTRAINT also reaches the isolated build
# environments pip creates for the local packages (so hatchling is pinned too); `-c` alone
# does not. --no-compile skips byte-compiling torch's thousands of files at install time.
PIP_ENV: Mapping[str, str] = {"PIP_CONSTRAINT": str(CONSTRAINTS)}
PIP_ARGS: tuple[str, ...] = ("--no-compile", "-c", str(CONSTRAINTS))
# Tests: one BLAS/OpenMP thread per process (2-core machines, multi-process tests).
# PYTHONDONTWRITEBYTECODE is emptied: venvs install with --no-compile, so without it every
# spawned rank process would recompile torch's modules on import.
TEST_ENV: Mapping[str, str] = {
    "OMP_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "",
    # Acceptance tests on third-party trainers fail, not skip, where their tools are missing.
    "HP_REQUIRE_ACCEPTANCE": "1",
}
# The same for every other command that imports torch (the installed-copy and wheel import
# checks, hp-kernels' build, which compiles against it): where the environment sets
# PYTHONDONTWRITEBYTECODE=1, each of those processes compiled torch's modules again, about 11 s
# a process on 2 cores against 2 s once the bytecode is written.
BYTECODE_ENV: Mapping[str, str] = {"PYTHONDONTWRITEBYTECODE": ""}
# Test tools installed without their dependencies (versions pinned in constraints/ci.txt):
# torchtitan's hard requirement on Hugging Face `datasets` cannot resolve against the pinned
# fsspec / huggingface-hub, and the acceptance test never imports it (nor triton, wandb, ...).
NO_DEPS_TEST_REQUIREMENTS: Mapping[str, tuple[str, ...]] = {
    "hp-fsdp": (
        "torchtitan",
        "spmd-types",
        "tyro",
        "docstring-parser",
        "torchdata",
        "tensorboard",
        "protobuf",
        "absl-py",
    ),
}


def _normalize(name: str) -> str:
    out = name.strip().lower()
    for sep in ("_", "."):
        out = out.replace(sep, "-")
    while "--" in out:
        out = out.replace("--", "-")
    return out


def _requirement_name(requirement: str) -> str:
    end = len(requirement)
    for i, char in enumerate(requirement):
        if not (char.isalnum() or char in "-_."):
            end = i
            break
    return _normalize(requirement[:end])


@dataclass(frozen=True)
class Package:
    """What the noxfile needs to know about one ``packages/<dist>/``."""

    dist: str
    path: Path
    deps: tuple[str, ...]  # hp-* dists in [project].dependencies
    requires: tuple[str, ...]  # the other (third-party) entries of [project].dependencies
    test_deps: tuple[str, ...]  # hp-* dists in the `test` extra
    extras: frozenset[str]
    build_requires: tuple[str, ...]

    @property
    def import_name(self) -> str:
        return self.dist.replace("-", "_")


def _hp_names(requirements: Iterable[str]) -> tuple[str, ...]:
    names = (_requirement_name(r) for r in requirements)
    return tuple(sorted({n for n in names if n.startswith("hp-")}))


def discover_packages() -> dict[str, Package]:
    """All ``packages/*/pyproject.toml``, keyed by distribution name (= directory name)."""
    found: dict[str, Package] = {}
    for pyproject in sorted(PACKAGES_DIR.glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        project = data.get("project", {})
        extras: dict[str, list[str]] = project.get("optional-dependencies", {})
        dist = pyproject.parent.name
        found[dist] = Package(
            dist=dist,
            path=pyproject.parent,
            deps=_hp_names(project.get("dependencies", [])),
            requires=tuple(
                r
                for r in project.get("dependencies", [])
                if not _requirement_name(r).startswith("hp-")
            ),
            test_deps=_hp_names(extras.get(TEST_EXTRA, [])),
            extras=frozenset(extras),
            build_requires=tuple(data.get("build-system", {}).get("requires", [])),
        )
    return found


PACKAGES = discover_packages()


def closure(dist: str, *, with_test: bool) -> list[str]:
    """``dist`` and its hp-* dependencies, transitively, dependencies first.

    ``with_test`` also follows the hp-* entries of ``dist``'s own ``test`` extra.
    Raises ValueError for a dependency with no ``packages/<dep>/`` or a cycle.
    """
    order: list[str] = []
    state: dict[str, str] = {}  # "visiting" | "done"

    def visit(name: str, chain: tuple[str, ...], edges: Iterable[str] | None = None) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ValueError(f"dependency cycle: {' -> '.join((*chain, name))}")
        if name not in PACKAGES:
            raise ValueError(
                f"{' -> '.join((*chain, name))}: no packages/{name}/ in this repository"
            )
        state[name] = "visiting"
        for dep in edges if edges is not None else PACKAGES[name].deps:
            visit(dep, (*chain, name))
        state[name] = "done"
        order.append(name)

    root = PACKAGES.get(dist)
    edges = None
    if root is not None and with_test:
        edges = sorted({*root.deps, *root.test_deps})
    visit(dist, (), edges)
    return order


def _closure_or_error(session: nox.Session, dist: str, *, with_test: bool) -> list[str]:
    try:
        return closure(dist, with_test=with_test)
    except ValueError as exc:
        session.error(f"cannot install {dist}: {exc}")


def install_closure(
    session: nox.Session,
    dist: str,
    *,
    test_extra: bool,
    extra_requirements: Iterable[str] = (),
    replace_self: str | None = None,
) -> list[str]:
    """One pip call: ``dist`` (non-editable, local path) + its DAG closure + extras.

    ``replace_self`` installs that file (a built wheel) instead of ``packages/<dist>``.
    """
    pkg = PACKAGES[dist]
    if test_extra and TEST_EXTRA not in pkg.extras:
        session.error(
            f"{pkg.path.relative_to(ROOT)}/pyproject.toml has no "
            f"[project.optional-dependencies] {TEST_EXTRA} = [...] (what its tests need)"
        )
    names = _closure_or_error(session, dist, with_test=test_extra)
    specs: list[str] = []
    for name in names:
        if name != dist:
            specs.append(str(PACKAGES[name].path))
        elif replace_self is not None:
            specs.append(replace_self)
        else:
            specs.append(str(pkg.path) + (f"[{TEST_EXTRA}]" if test_extra else ""))
    install_local(session, names, specs, extra_requirements)
    if test_extra:
        install_no_deps_test_tools(session, [dist])
    return names


def install_no_deps_test_tools(session: nox.Session, names: Iterable[str]) -> None:
    """The :data:`NO_DEPS_TEST_REQUIREMENTS` of packages ``names``, pinned, without deps."""
    tools = sorted({t for n in names for t in NO_DEPS_TEST_REQUIREMENTS.get(n, ())})
    if tools:
        session.install(*PIP_ARGS, "--no-deps", *tools, env=PIP_ENV)


def _compiles_against_torch(pkg: Package) -> bool:
    """Whether building ``pkg`` needs torch (a C++ extension, e.g. hp-kernels)."""
    return "torch" in {_requirement_name(r) for r in pkg.build_requires}


def install_local(
    session: nox.Session, names: Iterable[str], specs: Iterable[str], extra: Iterable[str] = ()
) -> None:
    """One pip call installing the local packages ``names`` (as ``specs``) and ``extra``.

    If one of them compiles against torch, every build requirement of ``names`` (pinned, torch
    included) is installed first and the packages are built without build isolation: an
    isolated build environment would resolve and unpack a torch of its own for every build
    (several GB each time), where this compiles once against the venv's pinned torch.
    """
    names = list(names)
    no_isolation: tuple[str, ...] = ()
    if any(_compiles_against_torch(PACKAGES[n]) for n in names):
        requires = sorted({r for n in names for r in PACKAGES[n].build_requires})
        session.install(*PIP_ARGS, *requires, env=PIP_ENV)
        no_isolation = ("--no-build-isolation",)
    session.install(*PIP_ARGS, *no_isolation, *specs, *extra, env={**PIP_ENV, **BYTECODE_ENV})


def _check_installed_copy(session: nox.Session, *import_names: str) -> None:
    """Fail if one of ``import_names`` would be imported from the source tree, not
    site-packages (one process for all: each start imports torch)."""
    script = (
        "import importlib, pathlib, sys\n"
        "bad = []\n"
        f"for name in {list(import_names)!r}:\n"
        "    f = pathlib.Path(importlib.import_module(name).__file__).resolve()\n"
        "    print(name, 'is imported from', f)\n"
        f"    if f.is_relative_to({str(PACKAGES_DIR)!r}):\n"
        "        bad.append(name)\n"
        "sys.exit(f'error: {bad} from the source tree' if bad else 0)\n"
    )
    session.run("python", "-c", script, log=False, env=BYTECODE_ENV)


def _has_python(directory: Path) -> bool:
    return directory.is_dir() and any(directory.rglob("*.py"))


# ----------------------------------------------------------------------------------------------
# Per-package sessions
# ----------------------------------------------------------------------------------------------


def run_tests(session: nox.Session, pkg: Package) -> None:
    names = install_closure(session, pkg.dist, test_extra=True)
    session.log(f"DAG closure of {pkg.dist}: {' -> '.join(names)}")
    _pytest(session, pkg)


def _pytest(session: nox.Session, pkg: Package) -> None:
    # cwd stays the repository root, where no src/ is importable (and `pytest`, unlike
    # `python -m pytest`, does not put the cwd on sys.path anyway): the tests import the
    # installed, non-editable copy. _check_installed_copy proves it before pytest starts.
    _check_installed_copy(session, pkg.import_name)
    _run_pytest(session, pkg.path / "tests")


def _run_pytest(session: nox.Session, *tests: Path) -> None:
    """pytest on tests folders with the root configuration (extra arguments passed on); the
    slowest tests are listed at the end, where CI's time goes."""
    session.run(
        "pytest", "-c", str(PYPROJECT), "--rootdir", str(ROOT), "--durations=30",
        *map(str, tests), *session.posargs, env=TEST_ENV,
    )  # fmt: skip


def _run_each(steps: Sequence[tuple[str, Callable[[], None]]]) -> list[str]:
    """Run every step, even after one fails; returns the labels of those that failed."""
    failed: list[str] = []
    for label, step in steps:
        try:
            step()
        except CommandFailed:
            failed.append(label)
    return failed


def _run_beside(
    session: nox.Session, tests: Sequence[Path], checks: Sequence[tuple[str, list[str]]]
) -> list[str]:
    """The tests of ``tests`` and the commands of ``checks`` on two processes at once: the
    ``multiprocess`` tests in the foreground; in the background, one after another, the other
    tests (one core each, a fifth of the suite's time) and then ``checks`` (``(label,
    command)`` pairs, run in the session's environment), their report printed after. Measured
    over the whole suite on 2 cores: the machine stood idle 23 % of the time with one process
    (ranks waiting for each other, for timeouts, for process start-up), which the background
    fills. Returns the labels of what failed ("multiprocess tests", "in-process tests", a
    check's label); every command runs even when one fails."""
    common = ("-c", str(PYPROJECT), "--rootdir", str(ROOT), "--durations=15", *map(str, tests))
    report = Path(session.create_tmp()).resolve() / "beside.log"
    env = {
        **os.environ,
        **TEST_ENV,
        "PATH": os.pathsep.join([str(session.bin), os.environ.get("PATH", "")]),
    }
    # No cache plugin here: the two pytest processes would write .pytest_cache at once.
    in_process = [str(Path(session.bin) / "pytest"), *common, "-p", "no:cacheprovider"]
    background = [("in-process tests", [*in_process, "-m", "not multiprocess"]), *checks]
    background_failed: list[str] = []

    def run_background() -> None:
        with report.open("w") as out:
            for label, command in background:
                out.write(f"--- {label}: {' '.join(command)}\n")
                out.flush()
                try:
                    code = subprocess.run(
                        command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
                    ).returncode
                except OSError as error:  # a missing tool fails its step, never silently
                    out.write(f"--- {label}: could not start: {error}\n")
                    code = -1
                out.write(f"--- {label}: exit {code}\n")
                out.flush()
                if code != 0:
                    background_failed.append(label)

    session.log(f"in-process tests, then {len(checks)} checks, in the background: {report}")
    worker = threading.Thread(target=run_background, name="beside")
    worker.start()
    failed: list[str] = []
    try:
        session.run("pytest", *common, "-m", "multiprocess", env=TEST_ENV)
    except CommandFailed:
        failed.append("multiprocess tests")
    finally:
        worker.join()
    session.log(f"the background's report:\n{report.read_text()}")
    return failed + background_failed


def _run_mypy(session: nox.Session, targets: list[str], cache: Path | None = None) -> None:
    """mypy --strict (root configuration) over ``targets``, with ``cache`` (a new one: None)."""
    if cache is None:
        cache = Path(session.create_tmp()) / "mypy_cache"
    session.run("mypy", "--config-file", str(PYPROJECT), "--cache-dir", str(cache), *targets)


def run_mypy(session: nox.Session, pkg: Package) -> None:
    install_closure(session, pkg.dist, test_extra=True, extra_requirements=["mypy"])
    _mypy(session, pkg, extra=session.posargs)


def _mypy(
    session: nox.Session, pkg: Package, cache: Path | None = None, extra: Iterable[str] = ()
) -> None:
    _run_mypy(session, [*_mypy_targets(pkg), *extra], cache)


def _mypy_targets(pkg: Package) -> list[str]:
    return [
        str(d.relative_to(ROOT)) for d in (pkg.path / "src", pkg.path / "tests") if _has_python(d)
    ]


def run_build(session: nox.Session, pkg: Package) -> None:
    # Build against pinned, pre-installed build requirements (no build isolation): an isolated
    # build would resolve its own, unpinned torch for packages that compile against it.
    session.install(*PIP_ARGS, "build", *pkg.build_requires, env=PIP_ENV)
    wheel = _build_checked(session, pkg)
    install_closure(session, pkg.dist, test_extra=False, replace_self=str(wheel))
    session.chdir(session.create_tmp())
    _check_installed_copy(session, pkg.import_name)


@nox.session(name="build-all", tags=[CI_TAG])
def build_all(session: nox.Session) -> None:
    """Every package's wheel and sdist built and checked into ``dist/<dist>/`` (one environment,
    one compile of hp-kernels), then each package's isolated install: pip resolves its wheel's
    requirements with no index but the built wheels and the third-party packages present (a dry
    run whose hp-* choices must be exactly its DAG closure), and it imports from a folder holding
    only its closure's wheels, no other hp-* package importable. build-<dist> does the same for
    one package in a venv of its own."""
    requires = sorted({r for pkg in PACKAGES.values() for r in pkg.build_requires})
    # The packages' third-party requirements too, so that the resolution below needs no index.
    runtime = sorted({r for pkg in PACKAGES.values() for r in pkg.requires})
    session.install(*PIP_ARGS, "build", *requires, *runtime, env=PIP_ENV)
    order = _dag_order()
    wheels = {name: _build_checked(session, PACKAGES[name]) for name in order}
    targets = Path(session.create_tmp()).resolve() / "isolated"
    shutil.rmtree(targets, ignore_errors=True)
    for name, wheel in wheels.items():
        session.run(
            "python", "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
            "--target", str(targets / name), str(wheel),
        )  # fmt: skip
    links = [arg for wheel in wheels.values() for arg in ("--find-links", str(wheel.parent))]
    session.chdir(session.create_tmp())  # where no src/ is importable
    failed: list[str] = []
    for name in order:
        closure_names = closure(name, with_test=False)
        report = targets / f"{name}.resolution.json"
        try:
            session.run(
                "python", "-m", "pip", "install", "--quiet", "--dry-run", "--no-index",
                *links, "--report", str(report), f"{name}=={_version(wheels[name])}",
                env=PIP_ENV,
            )  # fmt: skip
            chosen = sorted(
                _normalize(item["metadata"]["name"])
                for item in json.loads(report.read_text())["install"]
                if _normalize(item["metadata"]["name"]) in PACKAGES
            )
            if chosen != sorted(closure_names):
                session.error(
                    f"{name}: pip would install {chosen}, its DAG closure is {closure_names}"
                )
            path = os.pathsep.join(str(targets / n) for n in closure_names)
            session.run(
                "python", "-c", _import_check(PACKAGES[name].import_name, targets / name),
                env={"PYTHONPATH": path, **BYTECODE_ENV},
            )  # fmt: skip
        except CommandFailed:
            failed.append(name)
    if failed:
        session.error(f"isolated install failed: {', '.join(failed)}")
    _umbrella_quickstart(session, wheels, links)


#: The umbrella distribution (``pip install hyper-parallel``: the whole library stack) and the
#: quick start build-all runs against its wheel installed alone in a fresh venv.
UMBRELLA = "hyper-parallel"
UMBRELLA_QUICKSTART = PACKAGES_DIR / UMBRELLA / "tests" / "quickstart_script.py"


def _umbrella_quickstart(
    session: nox.Session, wheels: Mapping[str, Path], links: Sequence[str]
) -> None:
    """``pip install hyper-parallel`` into a fresh venv, its hp-* packages from the built wheels
    only (``--no-index``, constrained), then upstream's quick start on it (world 1). The venv
    gets the third-party requirements (torch) first, from the usual index."""
    if UMBRELLA not in wheels:
        return
    start = time.monotonic()
    tmp = Path(session.create_tmp())  # relative to the repository root, where nox started
    venv = (tmp if tmp.is_absolute() else ROOT / tmp) / "umbrella-venv"
    shutil.rmtree(venv, ignore_errors=True)
    session.run("python", "-m", "venv", str(venv))  # the base interpreter: nothing installed
    python = str(venv / "bin" / "python")
    names = closure(UMBRELLA, with_test=False)
    third_party = sorted({r for name in names for r in PACKAGES[name].requires})
    pip = (python, "-m", "pip", "install", "--quiet", *PIP_ARGS)
    session.run(*pip, *third_party, env=PIP_ENV, external=True)
    spec = f"{UMBRELLA}=={_version(wheels[UMBRELLA])}"
    session.run(*pip, "--no-index", *links, spec, env=PIP_ENV, external=True)
    session.run(python, str(UMBRELLA_QUICKSTART), env=TEST_ENV, external=True)
    session.log(f"{spec} from the built wheels, quick start: {time.monotonic() - start:.0f} s")


def _version(wheel: Path) -> str:
    """The version in a wheel's file name (``<name>-<version>-<tags>.whl``)."""
    return wheel.name.split("-")[1]


def _import_check(import_name: str, folder: Path) -> str:
    """A script importing ``import_name`` that fails unless it comes from ``folder``."""
    return (
        f"import pathlib, sys, {import_name} as m; f = pathlib.Path(m.__file__).resolve(); "
        f"print('{import_name} is imported from', f); "
        f"sys.exit(None if f.is_relative_to({str(folder)!r}) else 'error: not from its wheel')"
    )


def _build_checked(session: nox.Session, pkg: Package) -> Path:
    """Build the wheel and sdist into ``dist/<dist>/`` and check their contents."""
    outdir = DIST_DIR / pkg.dist
    shutil.rmtree(outdir, ignore_errors=True)
    session.run(
        "python", "-m", "build", "--no-isolation", "--outdir", str(outdir), str(pkg.path),
        env=BYTECODE_ENV,
    )  # fmt: skip
    wheels = sorted(outdir.glob("*.whl"))
    sdists = sorted(outdir.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        session.error(f"expected one wheel and one sdist in {outdir}, got {wheels + sdists}")
    wheel, sdist = wheels[0], sdists[0]

    imp = pkg.import_name
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
    missing = [f for f in (f"{imp}/__init__.py", f"{imp}/py.typed") if f not in in_wheel]
    stray = sorted(n for n in in_wheel if n.split("/", 1)[0] in {"tests", "src"})
    if missing or stray:
        session.error(f"{wheel.name}: missing {missing}, unexpected {stray}")
    with tarfile.open(sdist) as tf:
        in_sdist = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    wanted = ("pyproject.toml", "README.md", f"src/{imp}/__init__.py", f"src/{imp}/py.typed")
    missing = [f for f in wanted if f not in in_sdist]
    if missing:
        session.error(f"{sdist.name}: missing {missing}")
    session.log(f"{wheel.name}: {len(in_wheel)} files incl. {imp}/py.typed; {sdist.name} ok")
    return wheel


def run_check(session: nox.Session, pkg: Package) -> None:
    """tests, mypy and build of one package in one environment: what CI runs (one venv and
    one install instead of three). All three run even when one fails."""
    names = install_closure(
        session,
        pkg.dist,
        test_extra=True,
        extra_requirements=["mypy", "build", *pkg.build_requires],
    )
    session.log(f"DAG closure of {pkg.dist}: {' -> '.join(names)}")
    failed = []
    for label, step in (("tests", _pytest), ("mypy", _mypy)):
        try:
            step(session, pkg)
        except CommandFailed:
            failed.append(label)
    try:
        wheel = _build_checked(session, pkg)
        # The built wheel replaces the source install; it must import from site-packages.
        session.install(*PIP_ARGS, "--force-reinstall", "--no-deps", str(wheel), env=PIP_ENV)
        session.chdir(session.create_tmp())
        _check_installed_copy(session, pkg.import_name)
    except CommandFailed:
        failed.append("build")
    if failed:
        session.error(f"{pkg.dist}: failed: {', '.join(failed)}")


def _register(pkg: Package) -> None:
    """Define tests-/mypy-/build-<dist> and check-<dist> (all three in one environment) for one
    package (CI runs them for every package at once: tests-all and build-all)."""

    def tests(session: nox.Session) -> None:
        run_tests(session, pkg)

    def mypy(session: nox.Session) -> None:
        run_mypy(session, pkg)

    def build(session: nox.Session) -> None:
        run_build(session, pkg)

    def check(session: nox.Session) -> None:
        run_check(session, pkg)

    tests.__doc__ = f"pytest {pkg.dist} against a non-editable install of its DAG closure."
    mypy.__doc__ = f"mypy --strict over {pkg.dist}'s src/ and tests/."
    build.__doc__ = (
        f"Build {pkg.dist}'s wheel + sdist into dist/{pkg.dist}/, install it with only its DAG "
        "closure in a venv of its own, import."
    )
    check.__doc__ = f"tests, mypy and build of {pkg.dist} in one environment (its closure only)."
    nox.session(name=f"tests-{pkg.dist}")(tests)
    nox.session(name=f"mypy-{pkg.dist}")(mypy)
    nox.session(name=f"build-{pkg.dist}")(build)
    nox.session(name=f"check-{pkg.dist}")(check)


# ----------------------------------------------------------------------------------------------
# Repository-wide sessions
# ----------------------------------------------------------------------------------------------


@nox.session(tags=[CI_TAG])
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the whole repository."""
    session.install(*PIP_ARGS, "ruff", env=PIP_ENV)
    failed = []
    for args in (("check", "."), ("format", "--check", "--diff", ".")):
        try:
            session.run("ruff", *args)
        except CommandFailed:
            failed.append(f"ruff {args[0]}")
    if failed:
        session.error(f"{' and '.join(failed)} failed (fix: `ruff check --fix . && ruff format .`)")


@nox.session(tags=[CI_TAG])
def dag(session: nox.Session) -> None:
    """Enforce the package DAG (tools/check_dag.py) and the sources' structure
    (tools/check_structure.py), test and type-check the checkers."""
    session.install(
        *PIP_ARGS,
        "pytest",
        "mypy",
        "-r",
        str(ROOT / "tools" / "requirements-nox.txt"),
        env=PIP_ENV,
    )
    cache = Path(session.create_tmp()) / "mypy_cache"
    steps: list[tuple[str, list[str]]] = [
        ("check_dag.py", ["python", str(ROOT / "tools" / "check_dag.py")]),
        # No function over 80 lines and no import cycle inside a package (issue 40).
        ("check_structure.py", ["python", str(ROOT / "tools" / "check_structure.py")]),
        # Every collective named by the watchdog on a stall or a lost peer (issue 41).
        ("check_watched.py", ["python", str(ROOT / "tools" / "check_watched.py")]),
        (
            "mypy tools noxfile.py",
            [
                "mypy",
                "--config-file",
                str(PYPROJECT),
                "--cache-dir",
                str(cache),
                "tools",
                "noxfile.py",
            ],
        ),
        (
            "pytest tools/tests",
            [
                "pytest",
                "-c",
                str(PYPROJECT),
                "--rootdir",
                str(ROOT),
                "tools/tests",
                *session.posargs,
            ],
        ),
    ]
    failed = []
    for label, cmd in steps:  # run them all, so the checkers' own tests run on a bad tree too
        try:
            session.run(*cmd)
        except CommandFailed:
            failed.append(label)
    if failed:
        session.error(f"failed: {', '.join(failed)}")


#: Packages whose combination tests/integration exercises (siblings in the DAG never import each
#: other, so their tests cannot).
INTEGRATION_PACKAGES: tuple[str, ...] = ("hp-fsdp", "hp-muon")
INTEGRATION_TESTS = ROOT / "tests" / "integration"


@nox.session
def integration(session: nox.Session) -> None:
    """tests/integration: sibling packages together (installed copies), then mypy over them."""
    names: list[str] = []
    for dist in INTEGRATION_PACKAGES:
        names += [n for n in _closure_or_error(session, dist, with_test=True) if n not in names]
    specs = [
        str(PACKAGES[n].path) + (f"[{TEST_EXTRA}]" if n in INTEGRATION_PACKAGES else "")
        for n in names
    ]
    install_local(session, names, specs, ["mypy"])
    for dist in INTEGRATION_PACKAGES:
        _check_installed_copy(session, PACKAGES[dist].import_name)
    _run_pytest(session, INTEGRATION_TESTS)
    _run_mypy(session, [str(INTEGRATION_TESTS.relative_to(ROOT))])


@nox.session(name="tests-all", tags=[CI_TAG])
def tests_all(session: nox.Session) -> None:
    """Every package's tests, tests/integration and mypy --strict over every package, in one
    environment holding all packages (non-editable, with their test extras): one install of
    torch and the test tools, two processes side by side (the multiprocess tests in one; the
    in-process ones, then mypy, in the other: one torch import per pytest process, one rank
    pool per world size) and one mypy cache, instead of one per package. Each package's
    isolated install (only its DAG closure) is checked by build-<dist>; check-<dist> runs a
    package's tests in such an environment. Every step runs even when one fails."""
    names = _install_order()
    specs = [
        str(PACKAGES[n].path) + (f"[{TEST_EXTRA}]" if TEST_EXTRA in PACKAGES[n].extras else "")
        for n in names
    ]
    install_local(session, names, specs, ["mypy"])
    install_no_deps_test_tools(session, names)
    _check_installed_copy(session, *(PACKAGES[name].import_name for name in names))
    tests = [*[PACKAGES[n].path / "tests" for n in names], INTEGRATION_TESTS]
    # One cache for every package: torch's stubs are analysed once, not once per package.
    cache = Path(session.create_tmp()).resolve() / "mypy_cache"
    targets = [(f"mypy {n}", _mypy_targets(PACKAGES[n])) for n in names]
    targets.append(("mypy integration", [str(INTEGRATION_TESTS.relative_to(ROOT))]))
    if session.posargs:
        # Extra arguments select tests themselves: one pytest process runs them, then mypy.
        steps = [("tests", functools.partial(_run_pytest, session, *tests))]
        steps += [(label, functools.partial(_run_mypy, session, t, cache)) for label, t in targets]
        failed = _run_each(steps)
    else:
        mypy = str(Path(session.bin) / "mypy")
        checks = [
            (label, [mypy, "--config-file", str(PYPROJECT), "--cache-dir", str(cache), *t])
            for label, t in targets
        ]
        failed = _run_beside(session, tests, checks)
    if failed:
        session.error(f"failed: {', '.join(failed)}")


#: The main job: 4 local CPU ranks, FSDP (dp_shard 2) x TP (2), Muon + AdamW, 60 steps on
#: the documentation topics CPython ships (pydoc_data), tokenized by a byte-level BPE that the
#: session trains first (DEMO_TOKENIZER_ARGS), with the held-out loss every 10 steps.
DEMO_ARGS: tuple[str, ...] = (
    "--model", "small", "--tp", "2", "--steps", "60", "--seq-len", "64", "--global-batch", "8",
    "--checkpoint-every", "30", "--data", "pydoc", "--eval-fraction", "0.1", "--eval-every", "10",
)  # fmt: skip
DEMO_VOCAB = "2048"


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The main job: a BPE tokenizer trained on CPython's documentation topics, then a short
    training run on 4 local CPU ranks (torchrun, gloo) with FSDP x TP and Muon; writes
    ``hp_train_out/`` (tokenizer, metrics, loss plot, checkpoints) at the repository root.

    Extra arguments go to ``hp_train`` (e.g. ``nox -s demo -- --steps 100 --resume``).
    """
    # hp-train's plot and tensorboard extras: the loss plot, and `-- --tensorboard` works.
    install_closure(
        session, "hp-train", test_extra=False, extra_requirements=["matplotlib", "tensorboard"]
    )
    out = ROOT / "hp_train_out"
    tokenizer = out / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        session.run(
            "python", "-m", "hp_train.data.tokenizer", "train", "--data", "pydoc",
            "--vocab-size", DEMO_VOCAB, "--eval-fraction", "0.1", "--out", str(tokenizer),
            env=TEST_ENV,
        )  # fmt: skip
    session.run(
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "hp_train", *DEMO_ARGS, "--tokenizer", str(tokenizer), "--out", str(out),
        *session.posargs, env=TEST_ENV,
    )  # fmt: skip


#: GRPO's example (``nox -s grpo``): the supervised warm-up hp-train runs on the arithmetic
#: corpus (2 local CPU ranks, FSDP), then GRPO on 4 (FSDP 2 x TP 2 training, TP 2 x 2 rollout
#: replicas on the same ranks), held-out greedy accuracy every 20 steps.
GRPO_WARMUP_ARGS: tuple[str, ...] = (
    "--dim", "128", "--n-layers", "4", "--n-heads", "4", "--n-kv-heads", "4", "--ffn-dim", "384",
    "--seq-len", "64", "--global-batch", "32", "--steps", "1500", "--lr", "3e-3",
    "--muon-lr", "0.02", "--warmup-steps", "30", "--checkpoint-every", "500",
)  # fmt: skip
GRPO_ARGS: tuple[str, ...] = (
    "--tp", "2", "--rollout-tp", "2", "--steps", "120", "--prompts-per-step", "32",
    "--group-size", "8", "--max-new-tokens", "5", "--muon-lr", "0.0005", "--lr", "3e-5",
    "--eval-every", "20", "--eval-prompts", "512", "--log-every", "10",
)  # fmt: skip


@nox.session(default=False)
def grpo(session: nox.Session) -> None:
    """GRPO on the arithmetic task, nothing downloaded: the corpus and its tokenizer
    (``python -m hp_rl prepare``), a supervised warm-up with hp-train, its Hugging Face
    export, then ``python -m hp_rl``; writes ``hp_rl_out/`` at the repository root. The
    warm-up is skipped when its export exists. Extra arguments go to ``hp_rl``.
    """
    install_closure(session, "hp-rl", test_extra=False, extra_requirements=["matplotlib"])
    out = ROOT / "hp_rl_out"
    data, warm, exported = out / "data", out / "warmup", out / "warmup_hf"
    if not (data / "tokenizer" / "tokenizer.json").is_file():
        session.run("python", "-m", "hp_rl", "prepare", "--out", str(data), env=TEST_ENV)
    if not (exported / "config.json").is_file():
        session.run(
            "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "hp_train", *GRPO_WARMUP_ARGS, "--data", str(data / "corpus.jsonl"),
            "--tokenizer", str(data / "tokenizer"), "--out", str(warm), env=TEST_ENV,
        )  # fmt: skip
        session.run(
            "python", "-m", "hp_train.checkpoint.export", "--checkpoint",
            str(warm / "checkpoints"), "--out", str(exported), env=TEST_ENV,
        )  # fmt: skip
    session.run(
        "python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "hp_rl", *GRPO_ARGS, "--init-from", str(exported), "--tokenizer",
        str(data / "tokenizer"), "--out", str(out / "grpo"), *session.posargs, env=TEST_ENV,
    )  # fmt: skip


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Every benchmark in benchmarks/ (ratios side by side; one JSON line each).

    Pass file names to run only some: ``nox -s bench -- layout_planning.py``.
    """
    for dist in _dag_order():
        install_closure(session, dist, test_extra=False)
    # train_vs_torchtitan.py runs torchtitan 0.3.0 beside hp-train: installed as hp-fsdp's
    # tests install it (pinned, without its deps), with the tokenizers transformers brings.
    session.install(*PIP_ARGS, "transformers", env=PIP_ENV)
    install_no_deps_test_tools(session, ["hp-fsdp"])
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    chosen = [s for s in scripts if not session.posargs or s.name in session.posargs]
    if not chosen:
        session.error(f"no benchmark matches {session.posargs}; have {[s.name for s in scripts]}")
    session.chdir(session.create_tmp())
    for script in chosen:
        session.run("python", str(script), env=TEST_ENV)


@nox.session(default=False)
def mutants(session: nox.Session) -> None:
    """Planted faults (tools/mutants/mutants.toml): each applied in a scratch copy of the working
    tree and its tests run there; fails if one survives. Slow, so not tagged ci.

    The copy is made first and every package is installed editable from it (test extras,
    constraints as everywhere), so the tests import the copy's code. Extra arguments go to
    tools/mutants/run.py (e.g. ``nox -s mutants -- --only muon-weight-decay-dropped``).
    """
    runner = ROOT / "tools" / "mutants" / "run.py"
    tree = Path(session.create_tmp()) / "tree"
    shutil.rmtree(tree, ignore_errors=True)  # a copy left by an earlier run is stale
    session.run("python", str(runner), "--copy-to", str(tree), *session.posargs)
    install_editable(session, tree)
    session.run("python", str(runner), "--tree", str(tree), *session.posargs, env=TEST_ENV)


def _install_order() -> list[str]:
    """Every package after the packages its tests need as well (hp-testing first): pip (23.2)
    does not match a requirement to a local package named later in the same call."""
    names: list[str] = []

    def visit(name: str, chain: tuple[str, ...] = ()) -> None:
        if name in names or name in chain or name not in PACKAGES:
            return  # done, a cycle, or unknown: reported by `dag` and the package sessions
        for dep in (*PACKAGES[name].deps, *PACKAGES[name].test_deps):
            visit(dep, (*chain, name))
        names.append(name)

    for name in _dag_order():
        visit(name)
    return names


def install_editable(session: nox.Session, tree: Path) -> None:
    """Every package of ``tree`` (a copy of this repository, or the repository itself) installed
    editable with its test extra, in one pip call, constrained as everywhere."""
    names = _install_order()
    specs: list[str] = []
    for name in names:
        extra = f"[{TEST_EXTRA}]" if TEST_EXTRA in PACKAGES[name].extras else ""
        specs += ["-e", f"{tree / 'packages' / name}{extra}"]
    # hatchling builds editable wheels with `editables`, which pip installs only into isolated
    # build environments; these builds are not isolated (hp-kernels), so it comes first (pinned
    # in constraints/ci.txt).
    session.install(*PIP_ARGS, "editables", env=PIP_ENV)
    install_local(session, names, specs, ["mypy", "ruff"])


@nox.session(default=False)
def dev(session: nox.Session) -> None:
    """The fast loop: every package installed editable (test extras, mypy, ruff) into
    ``.nox/dev``; activate it and run one package's tests or mypy directly, e.g.
    ``pytest -c pyproject.toml packages/hp-fsdp/tests/test_fsdp_basic.py``. Edits to ``src/``
    take effect without reinstalling (but hp-kernels' C++ extension: rerun the session)."""
    install_editable(session, ROOT)
    session.log(f"activate with: . {Path(session.virtualenv.location) / 'bin' / 'activate'}")


def _dag_order() -> list[str]:
    """Package names, dependencies before dependents (ties by name); unknown deps ignored."""
    order: list[str] = []
    for dist in sorted(PACKAGES):
        try:
            names = closure(dist, with_test=False)
        except ValueError:  # reported by the package's sessions and by `dag`
            names = [dist]
        order += [n for n in names if n not in order]
    return order


for _dist in _dag_order():
    _register(PACKAGES[_dist])
CI_SESSIONS: list[str] = ["lint", "dag", "tests-all", "build-all"]


@nox.session(venv_backend="none", default=False)
def ci(session: nox.Session) -> None:
    """Queue every session tagged `ci` (same as `nox -t ci`); nox exits 1 if any fails."""
    for name in CI_SESSIONS:
        session.notify(name)

"""Tests for tools/check_dag.py on small fake repositories built in tmp_path."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

import check_dag

CHECKER = Path(check_dag.__file__).resolve()


def write_package(
    root: Path,
    dist: str,
    *,
    deps: Sequence[str] = (),
    test_deps: Sequence[str] = (),
    files: Mapping[str, str] | None = None,
    tests: Mapping[str, str] | None = None,
    readme: bool = True,
    extras: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """A minimal well-formed package ``packages/<dist>/`` with the given modules."""
    imp = dist.replace("-", "_")
    pkg = root / "packages" / dist
    src = pkg / "src" / imp
    src.mkdir(parents=True)
    (pkg / "tests").mkdir()
    dep_list = ", ".join(f'"{d}>=0.1,<0.2"' for d in deps)
    test_list = ", ".join(['"pytest>=8"', *(f'"{d}>=0.1,<0.2"' for d in test_deps)])
    extra_lines = "".join(
        f"{name} = [{', '.join(repr(r) for r in reqs)}]\n" for name, reqs in (extras or {}).items()
    )
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [project]
            name = "{dist}"
            version = "0.1.0"
            dependencies = [{dep_list}]

            [project.optional-dependencies]
            test = [{test_list}]
            """
        )
        + extra_lines,
        encoding="utf-8",
    )
    if readme:
        (pkg / "README.md").write_text(f"# {dist}\n", encoding="utf-8")
    (pkg / "CHANGELOG.md").write_text("# Changelog\n", encoding="utf-8")
    (src / "py.typed").write_text("", encoding="utf-8")
    all_files = {"__init__.py": '"""Package."""\n', **(files or {})}
    for name, text in all_files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    for name, text in (tests or {}).items():
        (pkg / "tests" / name).write_text(textwrap.dedent(text), encoding="utf-8")
    return pkg


def good_repo(root: Path) -> Path:
    write_package(
        root,
        "hp-layout",
        files={
            "mesh.py": "import math\n",
            "reference.py": "import numpy as np\n",
        },
        tests={"test_mesh.py": "import numpy\nimport hp_layout.mesh\n"},
    )
    write_package(root, "hp-kernels")
    write_package(
        root,
        "hp-dtensor",
        deps=["hp-layout", "hp-kernels"],
        files={"api.py": "from hp_layout import mesh\nimport hp_kernels\n"},
    )
    write_package(
        root,
        "hp-fsdp",
        deps=["hp-dtensor", "hp-layout"],
        files={"shard.py": "def f() -> None:\n    import hp_dtensor.api\n"},
    )
    return root


def check(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = check_dag.main(["--root", str(root)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_good_repo_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = check(good_repo(tmp_path), capsys)
    assert code == 0, out
    assert "check_dag: OK" in out
    assert "4 package(s)" in out


def test_sibling_dependency_declared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    write_package(tmp_path, "hp-muon", deps=["hp-fsdp"])
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "hp-muon declares 'hp-fsdp>=0.1,<0.2', which the DAG forbids" in out


def test_sibling_in_test_extra_is_forbidden(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good_repo(tmp_path)
    write_package(tmp_path, "hp-muon", deps=["hp-dtensor"], test_deps=["hp-fsdp"])
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "which the DAG forbids" in out


def test_upward_dependency_declared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_package(tmp_path, "hp-layout", deps=["hp-dtensor"])
    write_package(tmp_path, "hp-kernels")
    write_package(tmp_path, "hp-dtensor", deps=["hp-layout", "hp-kernels"])
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "hp-layout may depend only on nothing" in out


def test_undeclared_nested_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    write_package(
        tmp_path,
        "hp-offload",
        deps=["hp-dtensor"],
        files={
            "swap.py": "class A:\n    def f(self) -> None:\n        from hp_layout import mesh\n"
        },
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "packages/hp-offload/src/hp_offload/swap.py:3" in out
    assert "hp-layout is not in hp-offload's [project].dependencies: declare it" in out


def test_sibling_import_in_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    write_package(
        tmp_path,
        "hp-muon",
        deps=["hp-dtensor"],
        files={"opt.py": "import importlib\nX = importlib.import_module('hp_fsdp.shard')\n"},
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "the DAG forbids hp_muon -> hp_fsdp" in out


def test_unknown_hp_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    (tmp_path / "packages/hp-layout/src/hp_layout/bad.py").write_text("import hp_magic\n")
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "hp_magic is not a known package" in out


def test_layout_imports_torch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    (tmp_path / "packages/hp-layout/src/hp_layout/mesh.py").write_text(
        "def f() -> None:\n    import torch.distributed\n"
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "hp_layout.mesh imports torch.distributed; hp_layout may import torch nowhere" in out


def test_layout_numpy_outside_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    (tmp_path / "packages/hp-layout/src/hp_layout/mesh.py").write_text(
        "from numpy import ndarray\n"
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "hp_layout may import numpy only in {hp_layout.reference}" in out


def test_layout_requires_numpy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    pyproject = tmp_path / "packages/hp-layout/pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace("dependencies = []", 'dependencies = ["numpy>=1.26"]')
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "hp-layout must not require numpy" in out


def test_runtime_import_of_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Statically fine (relative import of the one module allowed to use numpy), but importing
    # hp_layout now pulls numpy in at import time.
    good_repo(tmp_path)
    (tmp_path / "packages/hp-layout/src/hp_layout/__init__.py").write_text(
        "from . import reference\n"
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "(d) importing hp_layout tries to import numpy" in out


def test_runtime_hidden_torch_import(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Invisible to the static check; caught (even if torch is absent) by the import probe.
    good_repo(tmp_path)
    (tmp_path / "packages/hp-layout/src/hp_layout/accel.py").write_text(
        "import importlib\n"
        "try:\n"
        "    importlib.import_module('tor' + 'ch')\n"
        "except ImportError:\n"
        "    pass\n"
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "(d) importing hp_layout.accel tries to import torch" in out


def test_runtime_broken_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    (tmp_path / "packages/hp-layout/src/hp_layout/broken.py").write_text("raise ValueError('x')\n")
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "(d) importing hp_layout.broken failed: ValueError: x" in out


def test_unknown_package_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    write_package(tmp_path, "hp-serve", deps=["hp-dtensor"])
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "unknown package 'hp-serve'" in out
    assert "add a row for it to ALLOWED_DEPS in tools/check_dag.py" in out


def test_missing_dependency_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_package(tmp_path, "hp-layout")
    write_package(tmp_path, "hp-muon", deps=["hp-dtensor"])
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "but there is no packages/hp-dtensor/" in out


def test_layout_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good_repo(tmp_path)
    write_package(tmp_path, "hp-mpmd", deps=["hp-dtensor"], readme=False)
    (tmp_path / "packages/hp-mpmd/src/hp_mpmd/py.typed").unlink()
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "packages/hp-mpmd/README.md: missing" in out
    assert "packages/hp-mpmd/src/hp_mpmd/py.typed: missing" in out


# --- (g) the test-only package hp-testing -------------------------------------------------


def repo_with_hp_testing(root: Path) -> Path:
    """good_repo plus hp-testing, used by hp-dtensor's tests (the allowed way)."""
    good_repo(root)
    write_package(
        root,
        "hp-testing",
        deps=["torch", "pytest"],
        files={
            "pool.py": "import multiprocessing\nimport torch.distributed as dist\n",
            "plugin.py": "import pytest\nfrom hp_testing import pool\n",
        },
        tests={"test_pool.py": "import numpy\nimport hp_testing.pool\n"},
    )
    pyproject = root / "packages/hp-dtensor/pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace('test = ["pytest>=8"]', 'test = ["pytest>=8", "hp-testing"]')
    )
    (root / "packages/hp-dtensor/tests/conftest.py").write_text(
        "from hp_testing import run_on_ranks\n"
    )
    return root


def test_testing_package_used_from_tests_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = check(repo_with_hp_testing(tmp_path), capsys)
    assert code == 0, out
    assert "hp-dtensor -> {hp_kernels, hp_layout, hp_testing}" in out
    assert "(g) test-only {hp_testing}" in out


def test_testing_package_as_runtime_dependency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo_with_hp_testing(tmp_path)
    write_package(tmp_path, "hp-muon", deps=["hp-dtensor", "hp-testing"])
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert (
        "hp-muon declares 'hp-testing>=0.1,<0.2' in [project].dependencies; hp-testing is "
        "test-only: list it only in [project.optional-dependencies] test"
    ) in out


def test_testing_package_in_another_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo_with_hp_testing(tmp_path)
    write_package(
        tmp_path, "hp-offload", deps=["hp-dtensor"], extras={"dev": ["hp-testing", "ruff"]}
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "hp-offload declares 'hp-testing' in the 'dev' extra; hp-testing is test-only" in out


def test_testing_package_imported_from_src(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo_with_hp_testing(tmp_path)
    write_package(
        tmp_path,
        "hp-mpmd",
        deps=["hp-dtensor"],
        test_deps=["hp-testing"],
        files={"stage.py": "def f() -> None:\n    from hp_testing.pool import RankPool\n"},
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert (
        "packages/hp-mpmd/src/hp_mpmd/stage.py:2: hp_mpmd.stage imports hp_testing.pool; "
        "hp_testing is test-only: import it only from tests/, never from src/"
    ) in out


def test_layout_may_not_use_testing_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo_with_hp_testing(tmp_path)
    pyproject = tmp_path / "packages/hp-layout/pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace('test = ["pytest>=8"]', 'test = ["pytest>=8", "hp-testing"]')
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "hp-layout declares 'hp-testing', which the DAG forbids" in out


def test_testing_package_imports_hp_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo_with_hp_testing(tmp_path)
    (tmp_path / "packages/hp-testing/src/hp_testing/mesh.py").write_text("import hp_layout.mesh\n")
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "the DAG forbids hp_testing -> hp_layout" in out


def test_testing_package_third_party(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo_with_hp_testing(tmp_path)
    (tmp_path / "packages/hp-testing/src/hp_testing/data.py").write_text(
        "import json\nimport numpy as np\nfrom hypothesis import given\n"
    )
    pyproject = tmp_path / "packages/hp-testing/pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"torch>=0.1,<0.2"', '"numpy>=1.26"'))
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert (
        "hp_testing.data imports numpy; hp_testing may import only the standard library and "
        "{pytest, torch}"
    ) in out
    assert "hp_testing.data imports hypothesis" in out
    assert "hp_testing.data imports json" not in out
    assert "hp-testing requires 'numpy>=1.26'; its only third-party dependencies" in out


def test_transformers_only_in_tests_and_the_testing_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo_with_hp_testing(tmp_path)
    (tmp_path / "packages/hp-testing/src/hp_testing/hf.py").write_text(
        "def build() -> None:\n    import transformers\n"
    )
    (tmp_path / "packages/hp-fsdp/tests/test_hf.py").write_text("import transformers\n")
    code, out = check(tmp_path, capsys)
    assert code == 0, out
    (tmp_path / "packages/hp-fsdp/src/hp_fsdp/hf.py").write_text(
        "def load() -> None:\n    from transformers import AutoModel\n"
    )
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert "hp_fsdp.hf imports transformers; hp_fsdp may import transformers nowhere" in out


@pytest.mark.parametrize(
    ("requirement", "name"),
    [
        ("hp-layout>=0.1,<0.2", "hp-layout"),
        ("hp_layout [reference] >=0.1", "hp-layout"),
        ("Hp.Layout==0.1; python_version>'3'", "hp-layout"),
        ("numpy", "numpy"),
    ],
)
def test_requirement_name(requirement: str, name: str) -> None:
    assert check_dag.requirement_name(requirement) == name


def test_cli_exit_code(tmp_path: Path) -> None:
    good_repo(tmp_path)
    ok = subprocess.run(
        [sys.executable, str(CHECKER), "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (tmp_path / "packages/hp-layout/src/hp_layout/mesh.py").write_text("import torch\n")
    bad = subprocess.run(
        [sys.executable, str(CHECKER), "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1
    assert "check_dag: FAILED" in bad.stderr


# --- (h) the cross-package contract -------------------------------------------------------


def repo_with_private_parts(root: Path) -> Path:
    """good_repo where hp-dtensor has private modules, a private name and private state."""
    good_repo(root)
    dtensor = root / "packages/hp-dtensor/src/hp_dtensor"
    (dtensor / "_comm.py").write_text("def axis() -> None: ...\n")
    (dtensor / "parallel/_structure").mkdir(parents=True)
    (dtensor / "parallel/__init__.py").write_text("")
    (dtensor / "parallel/_structure/__init__.py").write_text("def map_tensors() -> None: ...\n")
    (dtensor / "api.py").write_text(
        "from hp_layout import mesh\n"
        "import hp_kernels\n"
        "__version__ = '0.1'\n"
        "_STATE = '_hp_dtensor_grad_reduction'\n"
    )
    return root


def test_contract_clean_repo_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    repo_with_private_parts(tmp_path)
    # Its own private modules, names and state are a package's to use, from src/ and tests/.
    (tmp_path / "packages/hp-dtensor/src/hp_dtensor/grads.py").write_text(
        "from hp_dtensor import _comm\n"
        "from hp_dtensor.api import _STATE\n"
        "import hp_dtensor.parallel._structure\n"
        "def f(p: object) -> object:\n"
        "    p._hp_dtensor_grad_layout = 1\n"
        "    return getattr(p, '_hp_dtensor_grad_reduction', None)\n"
    )
    (tmp_path / "packages/hp-dtensor/tests/test_comm.py").write_text(
        "import importlib\nimportlib.import_module('hp_dtensor._comm')\n"
    )
    # Dunders are public; prose, f-string fragments and function names are not attribute names.
    (tmp_path / "packages/hp-fsdp/src/hp_fsdp/api.py").write_text(
        '"""Reads ``_hp_dtensor_grad_reduction`` through hp_dtensor\'s contract."""\n'
        "from hp_dtensor.api import __version__\n"
        "def _hp_model(m: object, k: str) -> object:\n"
        "    m._hp_fsdp_state = 1\n"
        "    return getattr(m, '_hp_fsdp_state', None), f'_hp_{k}_x'\n"
    )
    code, out = check(tmp_path, capsys)
    assert code == 0, out
    assert "(h) contract: 4 import(s) of another hp package name no private module" in out
    assert "5 _hp_... string(s)/attribute(s) carry their own package's _hp_<short>_ prefix" in out
    assert "({dtensor, fsdp, kernels, layout})" in out


@pytest.mark.parametrize(
    ("where", "text", "message"),
    [
        (
            "src/hp_fsdp/shard.py",
            "import hp_dtensor._comm as comm\n",
            "packages/hp-fsdp/src/hp_fsdp/shard.py:1: hp_fsdp.shard imports hp_dtensor._comm, "
            "a private module of hp_dtensor; use hp_dtensor's public API instead",
        ),
        (
            "src/hp_fsdp/shard.py",
            "def f() -> None:\n    from hp_dtensor.parallel._structure import map_tensors\n",
            "packages/hp-fsdp/src/hp_fsdp/shard.py:2: hp_fsdp.shard imports "
            "hp_dtensor.parallel._structure, a private module of hp_dtensor",
        ),
        (
            "src/hp_fsdp/shard.py",
            "from hp_dtensor import api, _comm\n",
            "packages/hp-fsdp/src/hp_fsdp/shard.py:1: hp_fsdp.shard imports hp_dtensor._comm "
            "(from hp_dtensor import _comm), a private module of hp_dtensor",
        ),
        (
            "src/hp_fsdp/shard.py",
            "from hp_dtensor.parallel import _structure\n",
            "hp_fsdp.shard imports hp_dtensor.parallel._structure (from hp_dtensor.parallel "
            "import _structure), a private module of hp_dtensor",
        ),
        (
            "src/hp_fsdp/shard.py",
            "import importlib\nC = importlib.import_module('hp_dtensor._comm')\n",
            "packages/hp-fsdp/src/hp_fsdp/shard.py:2: hp_fsdp.shard imports hp_dtensor._comm, "
            "a private module of hp_dtensor",
        ),
        (
            "src/hp_fsdp/shard.py",
            "from hp_dtensor.api import _STATE\n",
            "packages/hp-fsdp/src/hp_fsdp/shard.py:1: hp_fsdp.shard imports the private name "
            "_STATE from hp_dtensor.api; use hp_dtensor's public API instead",
        ),
        (
            "tests/test_shard.py",
            "def test_x() -> None:\n    from hp_dtensor._comm import axis\n",
            "packages/hp-fsdp/tests/test_shard.py:2: test_shard imports hp_dtensor._comm, "
            "a private module of hp_dtensor",
        ),
    ],
)
def test_private_import_of_another_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, text: str, message: str
) -> None:
    repo_with_private_parts(tmp_path)
    (tmp_path / "packages/hp-fsdp" / where).write_text(text)
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert message in out
    assert "FAILED, 1 problem(s)" in out  # only (h): the imports themselves are declared


@pytest.mark.parametrize(
    ("where", "text", "message"),
    [
        (
            "src/hp_fsdp/_group.py",
            "def f(p: object) -> object:\n"
            "    return getattr(p, '_hp_dtensor_grad_reduction', None)\n",
            "packages/hp-fsdp/src/hp_fsdp/_group.py:2: hp_fsdp._group uses the string "
            "'_hp_dtensor_grad_reduction', private state of hp_dtensor (_hp_dtensor_ prefix); "
            "use hp_dtensor's public contract instead",
        ),
        (
            "src/hp_fsdp/_group.py",
            "def f(x: object, y: object) -> None:\n    x._hp_dtensor_grad_layout = y\n",
            "packages/hp-fsdp/src/hp_fsdp/_group.py:2: hp_fsdp._group uses the attribute "
            "._hp_dtensor_grad_layout, private state of hp_dtensor",
        ),
        (
            "tests/test_group.py",
            "_ATTR = '_hp_layout_cache'\n",
            "packages/hp-fsdp/tests/test_group.py:1: test_group uses the string "
            "'_hp_layout_cache', private state of hp_layout",
        ),
        (
            "src/hp_fsdp/_group.py",
            "KEYS = {'_hp_foo': 1}\n",
            "packages/hp-fsdp/src/hp_fsdp/_group.py:1: hp_fsdp._group uses the string "
            "'_hp_foo', a _hp_ name with no package's _hp_<short>_ prefix (its owner cannot be "
            "told): rename it _hp_fsdp_foo if it is hp_fsdp's own state, otherwise use its "
            "owner's public contract",
        ),
        (
            # `layout` is a short, but with nothing after it the name follows no convention.
            "src/hp_fsdp/_group.py",
            "def f(p: object) -> bool:\n    return hasattr(p, '_hp_layout')\n",
            "hp_fsdp._group uses the string '_hp_layout', a _hp_ name with no package's "
            "_hp_<short>_ prefix (its owner cannot be told): rename it _hp_fsdp_layout",
        ),
        (
            "src/hp_fsdp/_group.py",
            "def f(p: object) -> object:\n    return p._hp_fsdp\n",
            "hp_fsdp._group uses the attribute ._hp_fsdp, a _hp_ name with no package's "
            "_hp_<short>_ prefix (its owner cannot be told): rename it _hp_fsdp_<what>",
        ),
    ],
)
def test_private_state_of_another_package(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, text: str, message: str
) -> None:
    repo_with_private_parts(tmp_path)
    (tmp_path / "packages/hp-fsdp" / where).write_text(text)
    code, out = check(tmp_path, capsys)
    assert code == 1
    assert message in out
    assert "FAILED, 1 problem(s)" in out


@pytest.mark.parametrize(
    ("name", "owner"),
    [
        ("_hp_fsdp_state", "hp_fsdp"),
        ("_hp_fsdp_lite_state", "hp_fsdp_lite"),  # the longest matching short owns it
        ("_hp_fsdp_lite", "hp_fsdp"),  # ... only when a rest follows it
        ("_hp_fsdp", None),
        ("_hp_fsdp_", None),
        ("_hp_grad_reduction", None),
    ],
)
def test_state_owner(name: str, owner: str | None) -> None:
    shorts = {"fsdp": "hp_fsdp", "fsdp_lite": "hp_fsdp_lite", "dtensor": "hp_dtensor"}
    assert check_dag.state_owner(name, shorts) == owner


@pytest.mark.parametrize(
    ("component", "private"),
    [("_comm", True), ("_", True), ("__version__", False), ("__main__", False), ("api", False)],
)
def test_is_private(component: str, private: bool) -> None:
    assert check_dag.is_private(component) is private

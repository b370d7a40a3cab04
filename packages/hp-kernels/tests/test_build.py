"""The build hook (setup.py): when the extension is attempted, and that an install has it."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

import hp_kernels
from hp_kernels._extension import extension_path, load_cpu_extension

SETUP_PY = Path(__file__).resolve().parents[1] / "setup.py"


def _setup_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hp_kernels_setup", SETUP_PY)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only; setup() runs under __main__
    return module


def test_skip_env_builds_pure_python() -> None:
    exts, reason = _setup_module().extension_plan({"HP_KERNELS_NO_EXTENSION": "1"})
    assert exts == []
    assert "HP_KERNELS_NO_EXTENSION is set" in reason


def test_no_torch_in_build_env_builds_pure_python(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = _setup_module()
    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)  # import fails
    exts, reason = setup.extension_plan({})
    assert exts == []
    assert "torch is not importable in the build environment" in reason


def test_extension_planned_with_openmp_on_linux() -> None:
    setup = _setup_module()
    exts, reason = setup.extension_plan({})
    assert reason == ""
    (ext,) = exts
    assert ext.name == "hp_kernels._cpu_ops"
    assert setup.openmp_flags("linux") == ["-fopenmp"]
    assert setup.openmp_flags("darwin") == []


def test_installed_copy_has_the_extension() -> None:
    # Where hp_kernels is an installed copy (nox, CI) built on a machine with a compiler, the
    # extension must have been compiled and must load; a source checkout may lack it.
    here = Path(hp_kernels.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    if not here.is_relative_to(site) or shutil.which("c++") is None:
        pytest.skip("not an installed copy built with a C++ compiler")
    assert extension_path() is not None, "the installed hp_kernels has no compiled extension"
    assert load_cpu_extension() is None

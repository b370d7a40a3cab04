"""PEP 517 backend for the repository root that refuses to build.

The root ``pyproject.toml`` only holds shared tool configuration; the real distributions are
``packages/<dist>/``. Pointing the root's ``[build-system]`` here makes ``pip install .`` (or
``python -m build``) at the root fail loudly instead of producing an empty package.
"""

from __future__ import annotations

_MESSAGE = (
    "The hyper-parallel repository root is not an installable package. "
    "Install a package directory instead, e.g. `pip install ./packages/hp-layout`, "
    "or run the checks with `python3 -m nox -l`."
)


def _refuse(*_args: object, **_kwargs: object) -> str:
    raise RuntimeError(_MESSAGE)


get_requires_for_build_wheel = _refuse
get_requires_for_build_sdist = _refuse
get_requires_for_build_editable = _refuse
prepare_metadata_for_build_wheel = _refuse
build_wheel = _refuse
build_sdist = _refuse
build_editable = _refuse

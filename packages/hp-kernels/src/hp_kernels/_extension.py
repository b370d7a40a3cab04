"""Loading the compiled CPU extension (``_cpu_ops*.so`` next to this file), once per process.

The extension registers its kernels with the dispatcher as ``hp_kernels_cpu::*``; it has no
Python module to import, so it is loaded with ``torch.ops.load_library``. Whether it loaded,
and if not why, is remembered: the CPU backend's probe asks this module and gets the same
answer on every call without touching the file system again.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

__all__ = ["extension_path", "load_cpu_extension"]

_STEM = "_cpu_ops"


def extension_path() -> Path | None:
    """The built extension beside this package (installed wheel or in-place build), if any."""
    here = Path(__file__).resolve().parent
    found = sorted(here.glob(f"{_STEM}*.so")) + sorted(here.glob(f"{_STEM}*.pyd"))
    return found[0] if found else None


@functools.cache
def load_cpu_extension() -> str | None:
    """Load the CPU extension; ``None`` when loaded, else why it is not available."""
    path = extension_path()
    if path is None:
        return (
            "the CPU extension was not built with this install (no compiler or torch at build "
            "time, or HP_KERNELS_NO_EXTENSION=1): reinstall with a C++ compiler and pip "
            "--no-build-isolation, or in a source checkout run `python setup.py build_ext "
            "--inplace` in packages/hp-kernels"
        )
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:  # e.g. built against another torch: undefined symbols
        return f"the CPU extension {path.name} failed to load ({exc})"
    return None

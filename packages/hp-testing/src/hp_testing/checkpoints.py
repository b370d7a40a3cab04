"""Comparing checkpoints and launching jobs the way a user does, for tests of whole runs.

* :func:`checkpoint_state`: a ``torch.distributed.checkpoint`` folder's whole state as one
  process sees it (every tensor gathered), through torch's own conversion;
* :func:`assert_identical`: two nested states equal, every tensor bit for bit (dtype, shape,
  values), the first difference named by its path;
* :func:`job_env`: the environment for a ``torchrun`` subprocess that imports the packages this
  test process imports, one thread per rank.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

__all__ = ["assert_identical", "checkpoint_state", "job_env"]


def checkpoint_state(path: Path, scratch: Path) -> dict[str, object]:
    """The state saved in the DCP folder ``path`` (converted into ``scratch``, a file)."""
    dcp_to_torch_save(path, scratch)
    state: dict[str, object] = torch.load(scratch, weights_only=True)
    return state


def assert_identical(got: object, want: object, where: str = "") -> None:
    """Nested mappings with the same keys, tensors bit for bit, anything else equal."""
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping), where
        assert sorted(got) == sorted(want), where
        for key in want:
            assert_identical(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    else:
        assert got == want, where


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` set to its import path, one OpenMP
    thread, and ``extra``."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra)
    return env

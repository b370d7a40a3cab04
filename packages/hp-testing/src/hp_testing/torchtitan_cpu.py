"""Run-time patches for training with torchtitan 0.3.0's ``Trainer`` on local CPU gloo ranks.

Shared by hp-fsdp's torchtitan acceptance harness (``packages/hp-fsdp/tests/
torchtitan_harness.py``) and the benchmarks (``benchmarks/_torchtitan_cpu.py``). torchtitan is
written for accelerators; nothing of it is edited on disk. Inside each rank process these
functions change it at run time, and only where a CPU-only, offline, deterministic run needs
it (one function each, which says why):

* imports (:func:`torchtitan_imports`): ``triton`` (a GPU compiler; torchtitan imports it at
  module level for MoE expert-parallel kernels) and Hugging Face ``datasets`` (its pins --
  ``fsspec<=2026.2``, ``huggingface-hub<2`` -- conflict with ``constraints/ci.txt``) are not
  installed; stand-ins (modules whose functions raise when called) are put in
  ``sys.modules`` for the import of torchtitan only, and are never called on this path;
* device (:func:`patch_device`): ``torchtitan.tools.utils`` picks ``"cuda"`` when no
  accelerator is present, and several modules copy ``device_type`` / ``device_module`` /
  ``get_local_device`` into their globals; every copy is pointed at the CPU
  (``device_module`` at :class:`CpuDeviceModule`, a ``torch.cpu`` shim with the ``torch.cuda``
  calls the Trainer makes);
* gloo (:func:`patch_sum_reduction`): torchtitan sets ``set_gradient_divide_factor(1.0)`` on
  every FSDP module, which makes torch FSDP2 reduce-scatter with ``ReduceOp.PREMUL_SUM`` --
  gloo refuses it; every FSDP module is also given ``set_force_sum_reduction_for_comms(True)``
  (plain SUM, same numbers);
* torch 2.13 (:func:`patch_pg_timeouts`): torchtitan calls ``torch.distributed.set_timeout``
  after the first step, which this torch lacks (the timeouts are set at
  ``init_process_group`` instead): the barrier around it is kept, the call skipped;
* speed only (:func:`patch_final_sleep`): the ``time.sleep(2)`` at the end of
  ``Trainer.train`` is skipped.

:func:`patch_for_cpu` applies the last four once per process (call it after importing
torchtitan inside :func:`torchtitan_imports`). Also here: :func:`unavailable_reason` (a cheap
check for a pytest skip, importing nothing of torchtitan) and :func:`synthetic_components`, a
synthetic tokenizer and dataloader (the wheel ships no tokenizer assets): a fixed cycle of
random token batches, so the loss goes down; and :func:`use_sdpa`, a config override (not a
patch) both callers make: SDPA instead of compiled FlexAttention (inductor on a CPU takes
minutes to compile).

torchtitan is imported only inside these functions, never when this module is imported:
hp-testing does not depend on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "REQUIRED_MODULES",
    "TORCHTITAN_VERSION",
    "CpuDeviceModule",
    "import_any",
    "patch_device",
    "patch_final_sleep",
    "patch_for_cpu",
    "patch_pg_timeouts",
    "patch_sum_reduction",
    "stand_in_module",
    "synthetic_components",
    "torchtitan_imports",
    "torchtitan_modules",
    "unavailable_reason",
    "use_sdpa",
]

TORCHTITAN_VERSION = "0.3.0"

#: What torchtitan 0.3.0's training path imports (module level) beyond torch and the repository's
#: constraints (tokenizers, safetensors, numpy, jinja2, fsspec come with transformers / torch):
#: module name -> distribution name.
REQUIRED_MODULES = {
    "torchtitan": "torchtitan",
    "spmd_types": "spmd-types",
    "tyro": "tyro",
    "docstring_parser": "docstring-parser",
    "torchdata": "torchdata",
    "tensorboard": "tensorboard",
    "google.protobuf": "protobuf",
    "absl": "absl-py",
    "tokenizers": "tokenizers",
}

_TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_FSDP_MODULE = "torchtitan.distributed.fsdp"


def unavailable_reason() -> str | None:
    """None when torchtitan (the pinned version) and what it imports are installed; else why
    not. Cheap (no import of torchtitan): meant for a pytest skip at collection."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchtitan")
    except PackageNotFoundError:
        return "torchtitan is not installed"
    if found != TORCHTITAN_VERSION:
        return f"torchtitan {found} is installed; the CPU patches target {TORCHTITAN_VERSION}"
    missing = []
    for module, dist_name in REQUIRED_MODULES.items():
        try:
            present = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            present = False
        if not present:
            missing.append(dist_name)
    if missing:
        return f"torchtitan {TORCHTITAN_VERSION} needs {', '.join(missing)} (not installed)"
    return None


def import_any(name: str) -> Any:
    """A module, typed ``Any``: torchtitan ships no type information."""
    return importlib.import_module(name)


# ---------------------------------------------------------------------------------------------
# Import-time stand-ins
# ---------------------------------------------------------------------------------------------


def stand_in_module(name: str, *, package: bool = False) -> types.ModuleType:
    """A module whose every public attribute is a function that raises when called."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []

    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: object, **kwargs: object) -> Any:
            raise RuntimeError(
                f"{name}.{attr} is not installed (a hp_testing.torchtitan_cpu stand-in)"
            )

        return unavailable

    vars(module)["__getattr__"] = missing  # module-level __getattr__ (PEP 562)
    return module


@contextlib.contextmanager
def torchtitan_imports() -> Iterator[None]:
    """Let torchtitan import without ``triton`` and ``datasets`` (see the module docstring).

    ``datasets`` stands in only while this context is open (torch and transformers probe for
    it, and must keep seeing it absent); torchtitan's own triton-kernel module stays replaced,
    so no ``triton`` is ever visible to torch.
    """
    added: list[str] = []
    if importlib.util.find_spec("triton") is None and _TRITON_KERNELS not in sys.modules:
        sys.modules[_TRITON_KERNELS] = stand_in_module(_TRITON_KERNELS)
    if importlib.util.find_spec("datasets") is None:
        datasets: Any = stand_in_module("datasets", package=True)
        datasets.Dataset = type("Dataset", (), {})
        datasets.IterableDataset = type("IterableDataset", (), {})
        distributed = stand_in_module("datasets.distributed")
        datasets.distributed = distributed
        sys.modules["datasets"] = datasets
        sys.modules["datasets.distributed"] = distributed
        added += ["datasets", "datasets.distributed"]
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


# ---------------------------------------------------------------------------------------------
# Run-time patches (rank process only)
# ---------------------------------------------------------------------------------------------


class CpuDeviceModule:
    """What torchtitan calls on its ``device_module`` (``torch.cuda`` API), for the CPU;
    anything else is ``torch.cpu``'s."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def set_device(self, device: object) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: object = None) -> None:
        pass

    def get_device_name(self, device: object = None) -> str:
        return "cpu"

    def get_device_properties(self, device: object = None) -> types.SimpleNamespace:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return types.SimpleNamespace(name="cpu", total_memory=pages)

    def memory_stats(self, device: object = None) -> dict[str, int]:
        return {}  # torchtitan reads .get(key, -1)

    def reset_peak_memory_stats(self, device: object = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def torchtitan_modules() -> list[Any]:
    """torchtitan's loaded modules (not the stand-ins, which have no ``__file__``)."""
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("torchtitan") and getattr(module, "__file__", None)
    ]


def patch_device() -> list[str]:
    """torchtitan.tools.utils sets ``device_type = ... or "cuda"`` at import time, and several
    modules copy it (and ``device_module``, ``torch.cuda``) into their own globals: re-point
    every copy at the CPU. ``get_local_device`` would return ``cpu:0``; plain ``cpu`` is what
    the meshes and tensors use. Returns the patched names."""
    shim = CpuDeviceModule()
    patched: list[str] = []
    for module in torchtitan_modules():
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
            patched.append(f"{module.__name__}.device_type")
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = shim
            patched.append(f"{module.__name__}.device_module")
        if callable(getattr(module, "get_local_device", None)):
            module.get_local_device = lambda: torch.device("cpu")
            patched.append(f"{module.__name__}.get_local_device")
    return patched


def patch_sum_reduction() -> list[str]:
    """Gloo has no ``PREMUL_SUM``: after torchtitan's ``disable_fsdp_gradient_division`` (its
    ``set_gradient_divide_factor(1.0)``), ask every module that offers it for SUM-only
    reductions. Divide factor 1: the gradients are the same sums either way."""
    fsdp = import_any(_FSDP_MODULE)
    original: Callable[[torch.nn.Module], None] = fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            setter = getattr(module, "set_force_sum_reduction_for_comms", None)
            if callable(setter):
                setter(True)

    fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division
    return [f"{_FSDP_MODULE}.disable_fsdp_gradient_division"]


def patch_pg_timeouts() -> list[str]:
    """After the first step torchtitan calls ``torch.distributed.set_timeout``, which torch
    2.13 does not have (torchtitan 0.3.0 targets a newer torch). Every collective has its
    timeout from ``init_process_group`` already (``comm`` timeouts set equal): keep the
    barrier, skip the missing call."""
    utils = import_any("torchtitan.distributed.utils")
    original = utils.set_pg_timeouts

    def set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
        if hasattr(dist, "set_timeout"):
            original(timeout, parallel_dims)
        else:
            dist.barrier()

    utils.set_pg_timeouts = set_pg_timeouts
    return ["torchtitan.distributed.utils.set_pg_timeouts"]


def patch_final_sleep() -> list[str]:
    """``Trainer.train`` ends with ``time.sleep(2)`` on rank 0 ("for other ranks to
    complete"); the callers synchronize with a barrier (or the next collective) instead, so
    skip the two seconds."""
    trainer = import_any("torchtitan.trainer")
    trainer.time = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=lambda s: None)
    return ["torchtitan.trainer.time.sleep"]


_PATCHED: list[str] = []


def patch_for_cpu() -> list[str]:
    """Apply the four run-time patches of the module docstring, once per process (later calls
    change nothing); returns what was patched."""
    if not _PATCHED:
        _PATCHED.extend(patch_device())
        _PATCHED.extend(patch_sum_reduction())
        _PATCHED.extend(patch_pg_timeouts())
        _PATCHED.extend(patch_final_sleep())
    return list(_PATCHED)


# ---------------------------------------------------------------------------------------------
# Config overrides
# ---------------------------------------------------------------------------------------------


def use_sdpa(model_config: Any) -> None:
    """Replace every ``FlexAttention.Config`` in a torchtitan model config with a (causal)
    ``ScaledDotProductAttention.Config``: compiled FlexAttention needs inductor (minutes on a
    CPU) and document masks."""
    attention = import_any("torchtitan.models.common.attention")
    for _, _, parent, attr in list(model_config.traverse(attention.FlexAttention.Config)):
        sdpa = attention.ScaledDotProductAttention.Config()
        if isinstance(parent, list):
            parent[attr] = sdpa
        else:
            setattr(parent, attr, sdpa)


# ---------------------------------------------------------------------------------------------
# Synthetic data and tokenizer (torchtitan Configurables, built by the Trainer)
# ---------------------------------------------------------------------------------------------


def synthetic_components(
    vocab: int, *, seed: int = 0, distinct_batches: int = 4, seed_stride: int = 100_003
) -> tuple[Any, Any]:
    """A tokenizer stand-in and a deterministic dataloader, as torchtitan components (the
    Trainer builds them from their configs; ``seed`` / ``distinct_batches`` are the dataloader
    config's defaults).

    The dataloader yields ``({"input": ids}, labels)`` for this data-parallel rank's slice of
    global batch ``i % distinct_batches`` (``i`` counts batches served, and is its checkpoint
    state), drawn from a generator seeded with ``seed * seed_stride + i % distinct_batches``:
    the same numbers whatever the FSDP implementation, and after a resume. No ``positions``:
    SDPA is causal.
    """
    return _synthetic_tokenizer(vocab), _synthetic_dataloader(seed, distinct_batches, seed_stride)


def _synthetic_tokenizer(vocab: int) -> Any:
    """The tokenizer stand-in of :func:`synthetic_components` (bytes modulo ``vocab``)."""
    base_tokenizer = import_any("torchtitan.components.tokenizer").BaseTokenizer

    class SyntheticTokenizer(base_tokenizer):  # type: ignore[misc, valid-type]
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(base_tokenizer.Config):  # type: ignore[misc, name-defined]
            vocab_size: int = vocab

        def __init__(self, config: Any, **kwargs: Any) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size
            self.bos_id, self.eos_id = 0, 1

        def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
            return [b % self.vocab_size for b in text.encode()]

        def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
            return " ".join(str(i) for i in ids)

        def get_vocab_size(self) -> int:
            return int(self.vocab_size)

    return SyntheticTokenizer


def _synthetic_dataloader(seed: int, distinct_batches: int, seed_stride: int) -> Any:
    """The deterministic dataloader of :func:`synthetic_components`."""
    base_dataloader = import_any("torchtitan.components.dataloader").BaseDataLoader
    default_seed, default_distinct = seed, distinct_batches

    class SyntheticDataLoader(base_dataloader):  # type: ignore[misc, valid-type]
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(base_dataloader.Config):  # type: ignore[misc, name-defined]
            seed: int = default_seed
            distinct_batches: int = default_distinct

        def __init__(
            self,
            config: Any,
            *,
            dp_world_size: int,
            dp_rank: int,
            tokenizer: Any,
            seq_len: int,
            local_batch_size: int,
            **kwargs: Any,
        ) -> None:
            self.config = config
            self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
            self.vocab_size = tokenizer.get_vocab_size()
            self.seq_len, self.local_batch_size = seq_len, local_batch_size
            self.served = 0

        def _batch(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
            which = index % self.config.distinct_batches
            generator = torch.Generator().manual_seed(self.config.seed * seed_stride + which)
            shape = (self.local_batch_size * self.dp_world_size, self.seq_len + 1)
            tokens = torch.randint(0, self.vocab_size, shape, generator=generator)
            mine = tokens.chunk(self.dp_world_size)[self.dp_rank]
            return {"input": mine[:, :-1].contiguous()}, mine[:, 1:].contiguous()

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                batch = self._batch(self.served)
                self.served += 1
                yield batch

        # One key per rank: DCP keeps one copy of equal non-tensor keys across ranks.
        def state_dict(self) -> dict[str, Any]:
            return {f"served_rank_{self.dp_rank}": self.served, "world": self.dp_world_size}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            if state_dict:
                assert state_dict["world"] == self.dp_world_size
                self.served = int(state_dict[f"served_rank_{self.dp_rank}"])

    return SyntheticDataLoader

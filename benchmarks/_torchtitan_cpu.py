"""torchtitan 0.3.0's Trainer on local CPU gloo ranks, for the benchmarks.

torchtitan is written for accelerators; nothing of it is edited on disk. Inside each rank
process this module changes it at run time, where a CPU-only, offline run needs it:

* imports: ``triton`` (its MoE expert-parallel kernels import it at module level) and Hugging
  Face ``datasets`` (its pins conflict with ``constraints/ci.txt``) are not installed: modules
  that raise when used stand in for them, for the import of torchtitan only;
* device: ``torchtitan.tools.utils`` picks ``"cuda"`` when no accelerator exists, and several
  modules copy ``device_type`` / ``device_module`` / ``get_local_device``; every copy is
  pointed at the CPU (``device_module`` at a ``torch.cpu`` wrapper with the ``torch.cuda``
  calls the Trainer makes);
* gloo has no ``ReduceOp.PREMUL_SUM``: torchtitan sets every FSDP module's gradient divide
  factor to 1, which makes FSDP2 reduce-scatter with it; the modules are then also told
  ``set_force_sum_reduction_for_comms(True)`` (plain SUM: the same sums);
* ``torch.distributed.set_timeout`` (called after the first step) is missing in torch 2.13:
  the barrier around it is kept, the call skipped;
* the ``time.sleep(2)`` at the end of ``Trainer.train`` is skipped.

Config overrides of the registry's ``llama3_debugmodel`` (not patches), see
:func:`build_config`: SDPA instead of compiled FlexAttention (inductor on a CPU takes
minutes), fp32, no CUDA graphs, no activation checkpointing (a speed comparison with a
trainer that does not recompute), no validation (its data is HF datasets), no checkpoints,
metrics logged once (step 1), ``spmd_backend="partial_dtensor"`` (the default
``"spmd_types"`` needs a newer torch's FSDP2), and a synthetic tokenizer and dataloader (the
wheel ships no tokenizer assets): fixed random token batches.

Use: inside a rank whose gloo process group is initialized, ``with torchtitan_imports():``
import what is needed, then :func:`run_trainer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TORCHTITAN_VERSION",
    "TorchtitanShape",
    "build_config",
    "run_trainer",
    "torchtitan_imports",
    "unavailable_reason",
]

TORCHTITAN_VERSION = "0.3.0"

#: Modules torchtitan's training path imports besides torch (distribution names).
_NEEDED = {
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


def unavailable_reason() -> str | None:
    """Why torchtitan cannot run here (None when the pinned version and its imports are
    installed). Imports nothing of torchtitan."""
    try:
        found = version("torchtitan")
    except PackageNotFoundError:
        return "torchtitan is not installed"
    if found != TORCHTITAN_VERSION:
        return f"torchtitan {found} is installed, this benchmark targets {TORCHTITAN_VERSION}"
    missing = []
    for module, dist_name in _NEEDED.items():
        try:
            if importlib.util.find_spec(module) is None:
                missing.append(dist_name)
        except (ImportError, ValueError):
            missing.append(dist_name)
    return f"torchtitan needs {', '.join(missing)} (not installed)" if missing else None


def _mod(name: str) -> Any:
    """A module typed ``Any`` (torchtitan has no type information)."""
    return importlib.import_module(name)


def _raising_module(name: str, *, package: bool = False) -> types.ModuleType:
    """A module whose public attributes are functions raising when called."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []

    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: object, **kwargs: object) -> Any:
            raise RuntimeError(f"{name}.{attr} is not installed (benchmark stand-in)")

        return unavailable

    vars(module)["__getattr__"] = missing  # a module-level __getattr__ (PEP 562)
    return module


@contextlib.contextmanager
def torchtitan_imports() -> Iterator[None]:
    """Import torchtitan inside this context (see the module docstring). The ``datasets``
    stand-in is removed on exit (torch and transformers probe for it); the triton kernel
    module of torchtitan stays replaced."""
    added: list[str] = []
    if importlib.util.find_spec("triton") is None and _TRITON_KERNELS not in sys.modules:
        sys.modules[_TRITON_KERNELS] = _raising_module(_TRITON_KERNELS)
    if importlib.util.find_spec("datasets") is None:
        datasets: Any = _raising_module("datasets", package=True)
        datasets.Dataset = type("Dataset", (), {})
        datasets.IterableDataset = type("IterableDataset", (), {})
        datasets.distributed = _raising_module("datasets.distributed")
        sys.modules["datasets"] = datasets
        sys.modules["datasets.distributed"] = datasets.distributed
        added += ["datasets", "datasets.distributed"]
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


class _CpuAsCuda:
    """The ``torch.cuda`` calls torchtitan's Trainer makes, answered for the CPU; anything
    else is ``torch.cpu``'s."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def set_device(self, device: object) -> None:
        return None

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: object = None) -> None:
        return None

    def get_device_name(self, device: object = None) -> str:
        return "cpu"

    def get_device_properties(self, device: object = None) -> types.SimpleNamespace:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return types.SimpleNamespace(name="cpu", total_memory=total)

    def memory_stats(self, device: object = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: object = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None


_PATCHED: list[str] = []


def _patch_for_cpu() -> list[str]:
    """Apply the run-time patches of the module docstring (once per process); returns what
    was patched."""
    if _PATCHED:
        return list(_PATCHED)
    patched = _PATCHED
    shim = _CpuAsCuda()
    for name, loaded in list(sys.modules.items()):
        if not name.startswith("torchtitan") or not getattr(loaded, "__file__", None):
            continue
        module: Any = loaded
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
            patched.append(f"{name}.device_type")
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = shim
            patched.append(f"{name}.device_module")
        if callable(getattr(module, "get_local_device", None)):
            module.get_local_device = lambda: torch.device("cpu")
            patched.append(f"{name}.get_local_device")

    fsdp = _mod("torchtitan.distributed.fsdp")
    divide_once: Callable[[torch.nn.Module], None] = fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        divide_once(model)
        for sub in model.modules():
            force_sum = getattr(sub, "set_force_sum_reduction_for_comms", None)
            if callable(force_sum):
                force_sum(True)

    fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division
    patched.append("torchtitan.distributed.fsdp.disable_fsdp_gradient_division")

    utils = _mod("torchtitan.distributed.utils")
    set_timeouts = utils.set_pg_timeouts

    def set_pg_timeouts(timeout: timedelta, parallel_dims: Any) -> None:
        if hasattr(dist, "set_timeout"):
            set_timeouts(timeout, parallel_dims)
        else:
            dist.barrier()

    utils.set_pg_timeouts = set_pg_timeouts
    patched.append("torchtitan.distributed.utils.set_pg_timeouts")

    trainer = _mod("torchtitan.trainer")
    trainer.time = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=lambda s: None)
    patched.append("torchtitan.trainer.time.sleep")
    return list(patched)


@dataclasses.dataclass(frozen=True)
class TorchtitanShape:
    """What to train: the debugmodel's sizes are checked against these, the rest is set.

    Attributes:
        dim, n_layers, n_heads, ffn_dim, vocab_size: the model (checked, not changed).
        seq_len, local_batch: tokens per sequence; sequences per data-parallel rank.
        dp_shard, tp: FSDP and tensor-parallel degrees (their product is the world size).
        lr, weight_decay, warmup_steps: AdamW and its linear warm-up (then linear decay).
        steps: optimizer steps of the run.
        seed: parameter init and data.
    """

    dim: int
    n_layers: int
    n_heads: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    local_batch: int
    dp_shard: int
    tp: int
    lr: float
    weight_decay: float
    warmup_steps: int
    steps: int
    seed: int = 0


def _synthetic(vocab: int, default_seed: int) -> tuple[Any, Any]:
    """A tokenizer stand-in and a dataloader of fixed random batches (torchtitan components:
    the Trainer builds them from their configs)."""
    tokenizer_base = _mod("torchtitan.components.tokenizer").BaseTokenizer
    loader_base = _mod("torchtitan.components.dataloader").BaseDataLoader

    class BenchTokenizer(tokenizer_base):  # type: ignore[misc, valid-type]
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(tokenizer_base.Config):  # type: ignore[misc, name-defined]
            vocab_size: int = vocab

        def __init__(self, config: Any, **kwargs: Any) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size
            self.bos_id, self.eos_id = 0, 1

        def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
            return [b % self.vocab_size for b in text.encode()]

        def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str:
            return ",".join(map(str, ids))

        def get_vocab_size(self) -> int:
            return int(self.vocab_size)

    class BenchDataLoader(loader_base):  # type: ignore[misc, valid-type]
        """Batch ``i`` is this rank's slice of a global batch drawn from ``(seed, i % 4)``."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(loader_base.Config):  # type: ignore[misc, name-defined]
            seed: int = default_seed

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
            self.seed = config.seed
            self.world, self.rank = dp_world_size, dp_rank
            self.vocab = tokenizer.get_vocab_size()
            self.shape = (local_batch_size * dp_world_size, seq_len + 1)
            self.served = 0

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                g = torch.Generator().manual_seed(self.seed * 7919 + self.served % 4)
                tokens = torch.randint(0, self.vocab, self.shape, generator=g)
                mine = tokens.chunk(self.world)[self.rank]
                self.served += 1
                yield {"input": mine[:, :-1].contiguous()}, mine[:, 1:].contiguous()

        def state_dict(self) -> dict[str, Any]:
            return {f"served_{self.rank}": self.served}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.served = int(state_dict.get(f"served_{self.rank}", 0))

    return BenchTokenizer, BenchDataLoader


def build_config(shape: TorchtitanShape, dump_folder: str) -> Any:
    """The registry's ``llama3_debugmodel`` with the overrides of the module docstring.

    Raises:
        ValueError: the registry's model is not the size ``shape`` names.
    """
    registry = _mod("torchtitan.models.llama3.config_registry")
    attention = _mod("torchtitan.models.common.attention")
    checkpointer = _mod("torchtitan.components.checkpointer")

    config = registry.llama3_debugmodel()
    model = config.model_spec.model
    layer = model.layers[0]
    found = {
        "dim": model.dim,
        "n_layers": len(model.layers),
        "n_heads": layer.attention.n_heads,
        "ffn_dim": layer.feed_forward.w1.out_features,
        "vocab_size": model.vocab_size,
    }
    wanted = {k: getattr(shape, k) for k in found}
    if found != wanted:
        raise ValueError(f"torchtitan's debugmodel is {found}, the benchmark wants {wanted}")
    for _, _, parent, attr in list(model.traverse(attention.FlexAttention.Config)):
        sdpa = attention.ScaledDotProductAttention.Config()
        if isinstance(parent, list):
            parent[attr] = sdpa
        else:
            setattr(parent, attr, sdpa)

    tokenizer_cls, loader_cls = _synthetic(shape.vocab_size, shape.seed)
    config.dump_folder = dump_folder
    config.hf_assets_path = dump_folder
    config.tokenizer = tokenizer_cls.Config()
    config.dataloader = loader_cls.Config(seed=shape.seed)
    config.validator.enable = False
    config.activation_checkpoint = None  # parallelize_llama applies none when it is None
    config.checkpoint = checkpointer.CheckpointManager.Config(enable=False)
    config.metrics.log_freq = 10**9  # logs step 1 only (a warm-up step)
    (group,) = config.optimizer.param_groups  # default_adamw: one AdamW group for all
    if group.optimizer_name != "AdamW":
        raise ValueError(f"the registry's optimizer is {group.optimizer_name}, not AdamW")
    group.optimizer_kwargs.update(lr=shape.lr, weight_decay=shape.weight_decay)
    config.lr_scheduler.warmup_steps = shape.warmup_steps

    training = config.training
    training.steps = shape.steps
    training.seq_len = shape.seq_len
    training.local_batch_size = shape.local_batch
    training.dtype = "float32"
    training.mixed_precision_param = "float32"
    training.mixed_precision_reduce = "float32"
    training.disable_cuda_graphs = True

    parallelism = config.parallelism
    parallelism.spmd_backend = "partial_dtensor"
    parallelism.data_parallel_shard_degree = shape.dp_shard
    parallelism.tensor_parallel_degree = shape.tp

    config.debug.seed = shape.seed
    config.comm.trace_buf_size = 0
    return config


def run_trainer(shape: TorchtitanShape, dump_folder: str) -> dict[str, Any]:
    """Build torchtitan's Trainer for ``shape`` on this rank and run ``Trainer.train()``
    (collective: every rank of the initialized gloo group calls it).

    Can run again in the same process (a new Trainer each time). torchtitan's Trainer turns
    Python's automatic garbage collection off (it collects every ``gc_freq`` steps itself);
    the state it found is restored on return, so that what runs next in the process is not
    affected.

    Returns ``step_s`` (wall time of each ``Trainer.train_step``, by step: what the loop
    does for one step besides checkpointing and profiling, which are off), ``params`` (the
    model's global parameter count), ``torchtitan_params`` (torchtitan's own count),
    ``optimizer`` (the AdamW implementation it built), ``first_loss`` (step 1's global loss)
    and ``patched``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    with torchtitan_imports():
        _mod("torchtitan.trainer")
        _mod("torchtitan.models.llama3.config_registry")
        config = build_config(shape, dump_folder)
    patched = _patch_for_cpu()

    gc_was_enabled = gc.isenabled()
    trainer = config.build()
    step_s: dict[int, float] = {}
    losses: dict[int, float] = {}
    try:
        step_once = trainer.train_step

        def timed_step(data_iterator: Any) -> Any:
            began = time.perf_counter()
            out = step_once(data_iterator)
            step_s[trainer.step] = time.perf_counter() - began
            return out

        trainer.train_step = timed_step
        log = trainer.metrics_processor.log

        def record_loss(step: int, loss: float, *args: Any, **kwargs: Any) -> Any:
            losses[step] = float(loss)
            return log(step, loss, *args, **kwargs)

        trainer.metrics_processor.log = record_loss
        params = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
        own_count, _ = trainer.model_config.get_nparams_and_flops(
            trainer.model_parts[0], shape.seq_len
        )
        opt = trainer.optimizers.optimizers[0]
        flags = opt.param_groups[0]  # torchtitan passes fused/foreach in the groups
        implementation = next((k for k in ("fused", "foreach") if flags.get(k)), "for-loop")
        trainer.train()
    finally:
        trainer.close()
        if gc_was_enabled:
            gc.enable()
    return {
        "step_s": step_s,
        "params": int(params),
        "torchtitan_params": int(own_count),
        "optimizer": f"{type(opt).__name__} ({implementation})",
        "first_loss": losses.get(1),
        "patched": patched,
    }


if __name__ == "__main__":  # a helper of the benchmarks: nothing to run on its own
    print(unavailable_reason() or f"torchtitan {TORCHTITAN_VERSION} is available")

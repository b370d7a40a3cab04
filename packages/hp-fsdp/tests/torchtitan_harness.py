"""Acceptance harness: torchtitan 0.3.0's llama3 ``debugmodel`` trained by torchtitan's own loop.

What runs is torchtitan's: its ``llama3_debugmodel`` config (from
``torchtitan.models.llama3.config_registry``), built into ``torchtitan.trainer.Trainer`` and
trained with ``Trainer.train()`` -- its meta-device model build, ``parallelize_llama`` (which
calls ``fully_shard`` from ``torchtitan.distributed.fsdp``), ``to_empty`` + ``init_weights``,
its chunked loss (which drives ``lm_head``'s FSDP state by hand), gradient clipping, AdamW, LR
schedule and DCP checkpointer. Nothing of torchtitan is edited on disk; this module changes it
only at run time, inside each rank process, and only where a CPU-only, offline, deterministic
run needs it, with the patches of :mod:`hp_testing.torchtitan_cpu` (shared with the benchmarks;
each function there says why, one patch each):

stand-ins for the uninstalled ``triton`` and ``datasets`` while torchtitan imports, the CPU for
its ``"cuda"`` device names, SUM instead of gloo's missing ``PREMUL_SUM`` reduce-scatter, no
call to torch 2.13's missing ``torch.distributed.set_timeout``, no final ``time.sleep(2)``.

And config overrides of the registry's config (not patches): ``spmd_backend="partial_dtensor"``
(the default ``"spmd_types"`` needs a newer torch's FSDP2 at world size > 1), SDPA instead of
compiled FlexAttention (inductor on CPU would take minutes to compile), fp32 throughout (no
mixed precision), CUDA graphs off, validation off (its data is HF datasets), fewer layers,
short sequences and small batches, a fixed seed with ``debug.deterministic``, a synthetic
dataloader and tokenizer (the wheel ships no ``tests/assets``): a fixed cycle of random token
batches, so the loss goes down.

``fully_shard_impl="module:attr"`` replaces ``fully_shard`` in every torchtitan module that
imported torch's (for llama3: ``torchtitan.distributed.fsdp.fully_shard``), so another FSDP
implementation trains under the same loop. Every call is recorded (the modules' FQNs and the
keywords), in the output JSON.

Comparing implementations: torchtitan initializes the *sharded* parameters in place
(``model.to_empty(device="cpu")``, then ``init_weights`` -> ``nn.init.trunc_normal_`` /
``normal_`` / ``ones_`` on each DTensor). On a CPU mesh DTensor keeps no offset RNG tracker, so
each rank draws its own shard from its own (equally seeded) generator: the shards are not
slices of one global draw. An implementation whose shards are drawn any other way starts from
other weights; ``save_initial_checkpoint`` / ``load_checkpoint_dir`` + ``load_model_only``
start both from the same ones.

Entry points: :func:`run_worker` (one rank; from a launcher of one's own or torchrun) and
:func:`launch` (spawns the ranks, returns rank 0's JSON).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hp_testing import torchtitan_cpu as tt_cpu

TORCHTITAN_VERSION = tt_cpu.TORCHTITAN_VERSION

#: The registry's debugmodel is dim 256, 16 heads, vocab 2048, 6 layers, 8 x 2048 tokens a rank
#: and step; these defaults (2 layers, 2 x 64 tokens) take ~0.3 s a step on a 2-core CPU.
DEFAULT_N_LAYERS = 2
DEFAULT_SEQ_LEN = 64  # a multiple of the chunked loss's 8 chunks
DEFAULT_LOCAL_BATCH = 2
DEFAULT_STEPS = 20
DEFAULT_SEED = 0
#: Distinct global batches, cycled: the model can fit them, so the loss falls.
DEFAULT_DISTINCT_BATCHES = 4

# Where torchtitan 0.3.0's llama3 path binds torch's ``fully_shard``: ``parallelize_llama``
# calls ``apply_fsdp_to_decoder`` from this module, which calls the name from its globals.
FSDP_MODULE = "torchtitan.distributed.fsdp"


#: Why torchtitan cannot run here, or None (cheap: meant for a pytest skip at collection).
torchtitan_unavailable_reason = tt_cpu.unavailable_reason


def _module(name: str) -> Any:
    """A module, typed ``Any``: torchtitan ships no type information."""
    return tt_cpu.import_any(name)


# ---------------------------------------------------------------------------------------------
# fully_shard / FSDPModule replacement (worker process only)
# ---------------------------------------------------------------------------------------------


def _resolve(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:attr', got {spec!r}")
    value: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        value = getattr(value, part)
    return value


def _describe(value: object) -> object:
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _describe(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"type": type(value).__name__, **fields}
    if callable(value):
        return f"<callable {getattr(value, '__qualname__', type(value).__name__)}>"
    mesh = getattr(value, "mesh_dim_names", None)
    if mesh is not None or type(value).__name__ == "DeviceMesh":
        return {"type": type(value).__name__, "repr": repr(value)}
    return repr(value)


def _patch_fully_shard(
    impl_spec: str | None, root: list[torch.nn.Module], calls: list[dict[str, Any]]
) -> list[str]:
    """Bind ``fully_shard`` (torch's, or ``impl_spec``'s) in every torchtitan module that
    imported torch's, wrapped to record each call."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    impl: Callable[..., Any] = torch_fully_shard if impl_spec is None else _resolve(impl_spec)
    if not callable(impl):
        raise TypeError(f"{impl_spec} is not callable")

    def fully_shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        names = {id(m): n or "<root>" for r in root for n, m in r.named_modules()}
        targets = module if isinstance(module, (list, tuple)) else [module]
        calls.append(
            {
                "modules": [names.get(id(m), type(m).__name__) for m in targets],
                "list": isinstance(module, (list, tuple)),
                "args": [_describe(a) for a in args],
                "kwargs": {k: _describe(v) for k, v in kwargs.items()},
            }
        )
        return impl(module, *args, **kwargs)

    patched: list[str] = []
    for mod in tt_cpu.torchtitan_modules():
        if getattr(mod, "fully_shard", None) is torch_fully_shard:
            mod.fully_shard = fully_shard
            patched.append(f"{mod.__name__}.fully_shard")
    if f"{FSDP_MODULE}.fully_shard" not in patched:
        raise RuntimeError(f"{FSDP_MODULE}.fully_shard not found: torchtitan's layout changed")
    return patched


def _patch_fsdp_module(spec: str | None) -> list[str]:
    """Optionally replace the class torchtitan's ``isinstance(m, FSDPModule)`` checks use
    (``torchtitan.distributed.fsdp.FSDPModule``: gradient-division and symm-mem setters;
    ``torch.distributed._composable.fsdp.FSDPModule``, imported inside the chunked loss'
    ``__call__``: lm_head's reshard / gradient-sync toggles)."""
    if spec is None:
        return []
    cls = _resolve(spec)
    fsdp = _module(FSDP_MODULE)
    composable = _module("torch.distributed._composable.fsdp")
    fsdp.FSDPModule = cls
    composable.FSDPModule = cls
    return [f"{FSDP_MODULE}.FSDPModule", "torch.distributed._composable.fsdp.FSDPModule"]


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def _build_config(
    *,
    steps: int,
    n_layers: int,
    seq_len: int,
    local_batch_size: int,
    seed: int,
    dump_folder: str,
    save_checkpoint_dir: str | None,
    checkpoint_interval: int | None,
    load_checkpoint_dir: str | None,
    load_model_only: bool,
    timeout_s: int,
) -> Any:
    registry = _module("torchtitan.models.llama3.config_registry")
    checkpoint = _module("torchtitan.components.checkpointer")

    config = registry.llama3_debugmodel()
    model = config.model_spec.model
    tokenizer_cls, dataloader_cls = tt_cpu.synthetic_components(
        model.vocab_size, seed=DEFAULT_SEED, distinct_batches=DEFAULT_DISTINCT_BATCHES
    )

    # Model: fewer layers (each keeps its depth-scaled init); SDPA (causal) for the compiled
    # FlexAttention, which needs inductor (minutes on CPU) and document masks.
    if not 1 <= n_layers <= len(model.layers):
        raise ValueError(f"n_layers must be in [1, {len(model.layers)}], got {n_layers}")
    del model.layers[n_layers:]
    tt_cpu.use_sdpa(model)

    config.dump_folder = dump_folder
    config.hf_assets_path = dump_folder  # no tokenizer files: the synthetic one ignores it
    config.tokenizer = tokenizer_cls.Config()
    config.dataloader = dataloader_cls.Config(seed=seed)
    config.validator.enable = False  # its dataloader is HF datasets (c4_test)

    training = config.training
    training.steps = steps
    training.seq_len = seq_len
    training.local_batch_size = local_batch_size
    training.dtype = "float32"
    training.mixed_precision_param = "float32"
    training.mixed_precision_reduce = "float32"
    training.disable_cuda_graphs = True

    # The registry's default "spmd_types" backend keeps parameters plain tensors and passes
    # fully_shard a DataParallelMeshDims; torch 2.13's FSDP2 then requires DTensor parameters
    # ("When dp_mesh_dims is provided, all parameters must be DTensors"). "partial_dtensor":
    # the classic path, fully_shard(module, mesh=<the 1-d "fsdp" mesh>, ...).
    config.parallelism.spmd_backend = "partial_dtensor"

    config.debug.seed = seed
    config.debug.deterministic = True
    config.comm.init_timeout_seconds = timeout_s
    config.comm.train_timeout_seconds = timeout_s
    config.comm.trace_buf_size = 0  # no NCCL flight recorder

    # Checkpoints: torchtitan's DCP manager. Save: full checkpoints (model, optimizer, LR
    # schedule, dataloader, train state) in <save_checkpoint_dir>/step-<N>, at the last step
    # and every checkpoint_interval steps. Load: initial_load_path (a step-<N> folder), before
    # the first step.
    enable = save_checkpoint_dir is not None or load_checkpoint_dir is not None
    if save_checkpoint_dir is not None and not os.path.isabs(save_checkpoint_dir):
        raise ValueError("save_checkpoint_dir must be absolute")
    config.checkpoint = checkpoint.CheckpointManager.Config(
        enable=enable,
        folder=save_checkpoint_dir or os.path.join(dump_folder, "checkpoint"),
        interval=checkpoint_interval or max(steps, 1),
        last_save_model_only=False,
        keep_latest_k=0,
        initial_load_path=load_checkpoint_dir,
        initial_load_model_only=load_model_only,
        load_only=save_checkpoint_dir is None,
    )
    return config


# ---------------------------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------------------------


def run_worker(
    rank: int,
    world_size: int,
    *,
    out_json: str,
    init_file: str | None = None,
    master_port: int | None = None,
    steps: int = DEFAULT_STEPS,
    fully_shard_impl: str | None = None,
    fsdp_module_impl: str | None = None,
    save_checkpoint_dir: str | None = None,
    checkpoint_interval: int | None = None,
    save_initial_checkpoint: bool = False,
    load_checkpoint_dir: str | None = None,
    load_model_only: bool = False,
    n_layers: int = DEFAULT_N_LAYERS,
    seq_len: int = DEFAULT_SEQ_LEN,
    local_batch_size: int = DEFAULT_LOCAL_BATCH,
    seed: int = DEFAULT_SEED,
    dump_folder: str | None = None,
    timeout_s: int = 300,
    num_threads: int = 1,
    verbose: bool = False,
) -> dict[str, Any]:
    """Train on this rank with torchtitan's Trainer; rank 0 writes ``out_json``.

    Rendezvous: ``init_file`` (a gloo file store; the process group is created here, and
    torchtitan's ``init_distributed`` keeps it) or ``master_port`` (torchtitan creates it from
    ``env://`` on 127.0.0.1). ``fully_shard_impl`` / ``fsdp_module_impl``: ``"module:attr"``
    replacing torch's ``fully_shard`` / ``FSDPModule`` in torchtitan (None: torch's FSDP2).
    ``save_checkpoint_dir``: absolute; a full checkpoint lands in ``<dir>/step-<steps>`` (and
    in ``<dir>/step-<k>`` for every multiple ``k`` of ``checkpoint_interval``).
    ``save_initial_checkpoint``: also save the initialized model, model only, in
    ``<dir>/step-0`` before the first step (torchtitan's seed-checkpoint call,
    ``checkpointer.save(curr_step=0, last_step=True)`` with ``last_save_model_only``): start
    another implementation from it (``load_model_only=True``) to compare runs from equal
    weights however each initializes its shards.
    ``load_checkpoint_dir``: a ``step-<N>`` folder loaded before training (all state unless
    ``load_model_only``; a full load restores the step, so training runs steps N+1..steps).

    The JSON (and the return value) holds per step: ``loss`` (torchtitan's global average
    loss), ``max_loss`` and ``grad_norm`` (the norm before clipping, as torchtitan logs it),
    plus the recorded ``fully_shard`` calls and the patched names.
    """
    if (init_file is None) == (master_port is None):
        raise ValueError("pass exactly one of init_file and master_port")
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size)})
    os.environ.update({"LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1"})
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    torch.set_num_threads(num_threads)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if dump_folder is None:
            dump_folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="tt_dump_"))
        result = _train(
            rank,
            world_size,
            init_file=init_file,
            steps=steps,
            fully_shard_impl=fully_shard_impl,
            fsdp_module_impl=fsdp_module_impl,
            save_checkpoint_dir=save_checkpoint_dir,
            checkpoint_interval=checkpoint_interval,
            save_initial_checkpoint=save_initial_checkpoint,
            load_checkpoint_dir=load_checkpoint_dir,
            load_model_only=load_model_only,
            n_layers=n_layers,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            seed=seed,
            dump_folder=dump_folder,
            timeout_s=timeout_s,
            verbose=verbose,
        )
    result["worker_s"] = time.perf_counter() - start
    if rank == 0:
        Path(out_json).write_text(json.dumps(result, indent=1))
    return result


def _train(
    rank: int,
    world_size: int,
    *,
    init_file: str | None,
    steps: int,
    fully_shard_impl: str | None,
    fsdp_module_impl: str | None,
    save_checkpoint_dir: str | None,
    checkpoint_interval: int | None,
    save_initial_checkpoint: bool,
    load_checkpoint_dir: str | None,
    load_model_only: bool,
    n_layers: int,
    seq_len: int,
    local_batch_size: int,
    seed: int,
    dump_folder: str,
    timeout_s: int,
    verbose: bool,
) -> dict[str, Any]:
    with tt_cpu.torchtitan_imports():
        _module("torchtitan.trainer")
        _module("torchtitan.models.llama3.config_registry")
        if verbose:
            _module("torchtitan.tools.logging").init_logger()
        config = _build_config(
            steps=steps,
            n_layers=n_layers,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            seed=seed,
            dump_folder=dump_folder,
            save_checkpoint_dir=save_checkpoint_dir,
            checkpoint_interval=checkpoint_interval,
            load_checkpoint_dir=load_checkpoint_dir,
            load_model_only=load_model_only,
            timeout_s=timeout_s,
        )
    patched = tt_cpu.patch_device()
    tt_cpu.patch_sum_reduction()
    tt_cpu.patch_pg_timeouts()
    tt_cpu.patch_final_sleep()
    root: list[torch.nn.Module] = []
    calls: list[dict[str, Any]] = []
    patched += _patch_fully_shard(fully_shard_impl, root, calls)
    patched += _patch_fsdp_module(fsdp_module_impl)

    # The root model, for module names in the record of fully_shard calls: torchtitan builds
    # it inside Trainer.__init__, so capture it when parallelize_llama receives it.
    llama3 = _module("torchtitan.models.llama3")
    parallelize = config.model_spec.parallelize_fn

    def parallelize_fn(model: torch.nn.Module, **kwargs: Any) -> Any:
        root.append(model)
        return parallelize(model, **kwargs)

    config.model_spec.parallelize_fn = parallelize_fn
    assert parallelize is llama3.parallelize_llama

    if init_file is not None:
        # What torchtitan's init_distributed would do, with a file store instead of env://.
        torch.autograd.set_multithreading_enabled(False)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    records: dict[int, dict[str, float]] = {}
    trainer = config.build()
    try:
        metrics = trainer.metrics_processor
        log = metrics.log

        def record(
            step: int,
            global_avg_loss: float,
            global_max_loss: float,
            grad_norm: float,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            records[step] = {
                "loss": float(global_avg_loss),
                "max_loss": float(global_max_loss),
                "grad_norm": float(grad_norm),
            }
            return log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

        metrics.log = record
        if save_initial_checkpoint:
            if save_checkpoint_dir is None:
                raise ValueError("save_initial_checkpoint needs save_checkpoint_dir")
            checkpointer = trainer.checkpointer
            full = checkpointer.last_save_model_only
            checkpointer.last_save_model_only = True  # no optimizer state yet: model only
            checkpointer.save(curr_step=0, last_step=True)
            checkpointer.last_save_model_only = full
        train_start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - train_start
    finally:
        trainer.close()
    dist.barrier()
    dist.destroy_process_group()

    ordered = sorted(records)
    result: dict[str, Any] = {
        "torchtitan_version": TORCHTITAN_VERSION,
        "torch_version": torch.__version__,
        "world_size": world_size,
        "fully_shard_impl": fully_shard_impl,
        "fsdp_module_impl": fsdp_module_impl,
        "steps": ordered,
        "loss": [records[s]["loss"] for s in ordered],
        "max_loss": [records[s]["max_loss"] for s in ordered],
        "grad_norm": [records[s]["grad_norm"] for s in ordered],
        "fully_shard_calls": calls,
        "patched": patched,
        "checkpoints_saved": (
            sorted(str(p) for p in Path(save_checkpoint_dir).glob("step-*"))
            if save_checkpoint_dir
            else []
        ),
        "checkpoint_loaded": load_checkpoint_dir,
        "train_s": train_s,
    }
    return result


def hp_fully_shard(module: Any, **kwargs: Any) -> Any:
    """``hp_fsdp.fully_shard`` in the per-parameter layout: the drop-in for torch's FSDP2 in
    code that treats parameters as DTensors (torchtitan's initializers, clipping and
    checkpointer do). Pass ``"torchtitan_harness:hp_fully_shard"`` as ``fully_shard_impl``."""
    from hp_fsdp import fully_shard

    return fully_shard(module, param_layout="per_param", **kwargs)


def _spawned(rank: int, world_size: int, kwargs: dict[str, Any]) -> None:
    run_worker(rank, world_size, **kwargs)


def launch(world_size: int = 2, *, timeout_s: float = 600, **kwargs: Any) -> dict[str, Any]:
    """Run :func:`run_worker` on ``world_size`` spawned ranks (gloo, file rendezvous); return
    rank 0's JSON. ``kwargs`` go to :func:`run_worker` (``out_json`` defaults to a temp file).
    Ranks still running after ``timeout_s`` are killed and ``TimeoutError`` raised."""
    from torch.multiprocessing.spawn import start_processes

    with tempfile.TemporaryDirectory(prefix="tt_launch_") as tmp:
        kwargs.setdefault("out_json", os.path.join(tmp, "result.json"))
        kwargs.setdefault("init_file", os.path.join(tmp, "rendezvous"))
        kwargs.setdefault("dump_folder", os.path.join(tmp, "dump"))
        kwargs.setdefault("timeout_s", int(timeout_s))
        context = start_processes(
            _spawned,
            args=(world_size, kwargs),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise TimeoutError(f"torchtitan ranks still running after {timeout_s} s")
        result: dict[str, Any] = json.loads(Path(kwargs["out_json"]).read_text())
        return result


if __name__ == "__main__":  # one run with torch's FSDP2, printed: python torchtitan_harness.py
    print(json.dumps(launch(2, verbose=True), indent=1))

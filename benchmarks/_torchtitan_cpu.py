"""torchtitan 0.3.0's Trainer on local CPU gloo ranks, for the benchmarks.

torchtitan is written for accelerators; nothing of it is edited on disk. Inside each rank
process it is changed at run time by :mod:`hp_testing.torchtitan_cpu` (shared with hp-fsdp's
torchtitan acceptance harness; its docstring says what each patch does and why): stand-ins
for the uninstalled ``triton`` and ``datasets`` while torchtitan imports, the CPU for its
``"cuda"`` device names, SUM instead of gloo's missing ``PREMUL_SUM`` reduce-scatter, no call
to torch 2.13's missing ``torch.distributed.set_timeout``, no final ``time.sleep(2)``.

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

import dataclasses
import gc
import os
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from hp_testing.torchtitan_cpu import (
    TORCHTITAN_VERSION,
    import_any,
    patch_for_cpu,
    synthetic_components,
    torchtitan_imports,
    unavailable_reason,
    use_sdpa,
)

__all__ = [
    "DIM",
    "FFN_DIM",
    "LOCAL_BATCH",
    "N_HEADS",
    "N_LAYERS",
    "SEQ",
    "TORCHTITAN_VERSION",
    "VOCAB",
    "TorchtitanShape",
    "build_config",
    "debug_shape",
    "run_trainer",
    "torchtitan_imports",
    "unavailable_reason",
]

#: torchtitan's llama3 ``debugmodel`` shape, as both trainer benchmarks train it: dim, layers,
#: heads, SwiGLU hidden, vocabulary; tokens per sequence and sequences per data-parallel rank.
DIM, N_LAYERS, N_HEADS, FFN_DIM, VOCAB = 256, 6, 16, 768, 2048
SEQ, LOCAL_BATCH = 256, 4


def debug_shape() -> dict[str, int]:
    """The shape above, as the benchmarks' JSON lines record it."""
    return {
        "dim": DIM,
        "n_layers": N_LAYERS,
        "n_heads": N_HEADS,
        "ffn_dim": FFN_DIM,
        "vocab_size": VOCAB,
        "seq_len": SEQ,
        "local_batch": LOCAL_BATCH,
    }


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


def build_config(shape: TorchtitanShape, dump_folder: str) -> Any:
    """The registry's ``llama3_debugmodel`` with the overrides of the module docstring.

    Raises:
        ValueError: the registry's model is not the size ``shape`` names.
    """
    registry = import_any("torchtitan.models.llama3.config_registry")
    checkpointer = import_any("torchtitan.components.checkpointer")

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
    use_sdpa(model)

    # Batch i is this rank's slice of a global batch drawn from (seed, i % 4).
    tokenizer_cls, loader_cls = synthetic_components(
        shape.vocab_size, seed=shape.seed, distinct_batches=4, seed_stride=7919
    )
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


def run_trainer(
    shape: TorchtitanShape, dump_folder: str, configure: Callable[[Any], None] | None = None
) -> dict[str, Any]:
    """Build torchtitan's Trainer for ``shape`` on this rank and run ``Trainer.train()``
    (collective: every rank of the initialized gloo group calls it).

    ``configure``, when given, is called with the config :func:`build_config` made (inside
    :func:`torchtitan_imports`, before the Trainer is built) and may change it in place, e.g.
    put in other data components or log every step.

    Can run again in the same process (a new Trainer each time). torchtitan's Trainer turns
    Python's automatic garbage collection off (it collects every ``gc_freq`` steps itself);
    the state it found is restored on return, so that what runs next in the process is not
    affected.

    Returns ``step_s`` (wall time of each ``Trainer.train_step``, by step: what the loop
    does for one step besides checkpointing and profiling, which are off), ``params`` (the
    model's global parameter count), ``torchtitan_params`` (torchtitan's own count),
    ``optimizer`` (the AdamW implementation it built), ``first_loss`` (step 1's global loss),
    ``losses`` and ``lrs`` (the global loss and the learning rate of every logged step, by
    step: as torchtitan's metrics logger receives them; ``lrs`` only where it logs one learning
    rate, i.e. one optimizer group) and ``patched``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    with torchtitan_imports():
        import_any("torchtitan.trainer")
        import_any("torchtitan.models.llama3.config_registry")
        config = build_config(shape, dump_folder)
        if configure is not None:
            configure(config)
    patched = patch_for_cpu()

    gc_was_enabled = gc.isenabled()
    trainer = config.build()
    step_s: dict[int, float] = {}
    losses: dict[int, float] = {}
    lrs: dict[int, float] = {}
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
            # One AdamW group: torchtitan names its learning rate "lr/AdamW".
            lr = [v for k, v in (kwargs.get("extra_metrics") or {}).items() if k.startswith("lr/")]
            if len(lr) == 1:
                lrs[step] = float(lr[0])
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
        "losses": losses,
        "lrs": lrs,
        "patched": patched,
    }


if __name__ == "__main__":  # a helper of the benchmarks: nothing to run on its own
    print(unavailable_reason() or f"torchtitan {TORCHTITAN_VERSION} is available")

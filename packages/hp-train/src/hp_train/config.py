"""What a training run is: the model, the parallel layout and the schedule, as frozen data.

Every field is checked when the object is built, so a bad command line fails before any
process group exists, with the field named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "PIPELINE_SCHEDULE_NAMES",
    "ConfigError",
    "MoEConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainConfig",
]

#: The pipeline schedules the entry point runs (``hp_train.pipeline.PIPELINE_SCHEDULES``).
PIPELINE_SCHEDULE_NAMES = ("1f1b", "gpipe")


class ConfigError(ValueError):
    """A configuration value that cannot work (the message names the field and the fix)."""


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward layers (token choice, top-k).

    Attributes:
        n_experts: routed experts per MoE layer.
        top_k: experts each token is sent to.
        expert_ffn_dim: hidden width of one expert's SwiGLU.
        every: every ``every``-th block (1-based: blocks ``every - 1``, ``2 * every - 1``, ...)
            has an MoE feed-forward; the others are dense.
        n_shared_experts: always-on experts added to the routed output (0 for none).
        aux_loss_weight: weight of the load-balancing loss added to the language-model loss.
    """

    n_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: int = 64
    every: int = 2
    n_shared_experts: int = 0
    aux_loss_weight: float = 0.01

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "expert_ffn_dim", "every"):
            _positive(f"moe.{name}", getattr(self, name))
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"moe.top_k={self.top_k} exceeds moe.n_experts={self.n_experts}; a token "
                "cannot go to more experts than exist"
            )
        if self.n_shared_experts < 0:
            raise ConfigError(f"moe.n_shared_experts must be >= 0, got {self.n_shared_experts}")

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE feed-forward."""
        return (index + 1) % self.every == 0


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder.

    Attributes:
        vocab_size: tokens (256 for the byte-level corpus).
        dim: model width.
        n_layers: transformer blocks.
        n_heads: attention heads (``dim`` divisible by it, head dim even for rotary).
        n_kv_heads: key/value heads (grouped-query attention; divides ``n_heads``).
        ffn_dim: hidden width of the dense SwiGLU.
        max_seq_len: longest sequence (rotary tables).
        norm_eps: RMSNorm epsilon.
        rope_theta: rotary base.
        moe: mixture-of-experts layers, or ``None`` for a dense model.
    """

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_dim: int = 128
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            _positive(name, getattr(self, name))
        _positive("max_seq_len", self.max_seq_len)
        if self.dim % self.n_heads:
            raise ConfigError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(
                f"head dim {self.dim // self.n_heads} (dim / n_heads) must be even for rotary "
                "embeddings"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                "(grouped-query attention)"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads


@dataclass(frozen=True)
class ParallelConfig:
    """How ranks are arranged: ``dp_replicate x dp_shard x tp x pp`` ranks.

    Attributes:
        dp_replicate: data-parallel replicas (HSDP's replicate axis, the slow tier).
        dp_shard: FSDP shards (the fast tier).
        tp: tensor-parallel ranks (innermost: neighbouring ranks).
        pp: pipeline stages (hp-mpmd's runtime; the outermost axis).
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp"):
            _positive(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        """Ranks the configuration needs."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas x shards): how many ways the batch is split."""
        return self.dp_replicate * self.dp_shard

    @staticmethod
    def fill(world_size: int, *, dp_replicate: int, tp: int, pp: int) -> ParallelConfig:
        """The configuration whose ``dp_shard`` takes every rank the other axes leave."""
        rest = dp_replicate * tp * pp
        if world_size % rest:
            raise ConfigError(
                f"world size {world_size} is not divisible by dp_replicate x tp x pp = {rest}"
            )
        return ParallelConfig(dp_replicate, world_size // rest, tp, pp)


@dataclass(frozen=True)
class TrainConfig:
    """The schedule and everything else of a run.

    Attributes:
        steps: optimizer steps to run (in total, counting those before a resume).
        global_batch: sequences per step over all data-parallel ranks.
        seq_len: tokens per sequence.
        optimizer: ``"muon"`` (Muon on matrices, AdamW on the rest) or ``"adamw"``.
        lr: AdamW learning rate (peak).
        muon_lr: Muon learning rate (peak).
        weight_decay: decoupled weight decay for both.
        warmup_steps: linear warm-up from 0 to the peak; then cosine decay to
            ``min_lr_ratio`` x peak at ``steps``.
        min_lr_ratio: the floor of the cosine decay.
        data: ``"corpus"`` (byte-level text of the installed hp-* packages) or ``"synthetic"``.
        seed: parameter init, data order and dropout.
        deterministic: deterministic kernels and one fixed reduction order.
        checkpoint_every: save every N steps (0: never).
        log_every: precision monitoring every N steps.
        divergence_threshold: warn when a rank's local loss differs from the mean over ranks by
            more than this fraction.
        microbatches: microbatches per step and data-parallel rank under pipeline parallelism
            (must divide the per-rank batch; 1 without pipelining).
        pp_schedule: the pipeline schedule, ``"1f1b"`` or ``"gpipe"``.
    """

    steps: int = 20
    global_batch: int = 8
    seq_len: int = 32
    optimizer: str = "muon"
    lr: float = 3e-3
    muon_lr: float = 0.02
    weight_decay: float = 0.01
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1
    data: str = "corpus"
    seed: int = 0
    deterministic: bool = False
    checkpoint_every: int = 0
    log_every: int = 5
    divergence_threshold: float = 0.5
    microbatches: int = 1
    pp_schedule: str = "1f1b"

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "seq_len", "log_every", "microbatches"):
            _positive(name, getattr(self, name))
        if self.optimizer not in ("muon", "adamw"):
            raise ConfigError(f"optimizer must be 'muon' or 'adamw', got {self.optimizer!r}")
        if self.pp_schedule == "zbh1":
            raise ConfigError(
                "pp_schedule='zbh1' splits each backward into input and weight passes, which "
                "hp-fsdp's gradient hooks do not follow yet (they reduce after the input pass); "
                "use '1f1b' or 'gpipe' (hp_mpmd.PipelineSchedule runs zbh1 without FSDP)"
            )
        if self.pp_schedule not in PIPELINE_SCHEDULE_NAMES:
            raise ConfigError(
                f"pp_schedule must be one of {PIPELINE_SCHEDULE_NAMES}, got {self.pp_schedule!r}"
            )
        if self.data not in ("corpus", "synthetic"):
            raise ConfigError(f"data must be 'corpus' or 'synthetic', got {self.data!r}")
        if self.warmup_steps < 0 or self.checkpoint_every < 0:
            raise ConfigError("warmup_steps and checkpoint_every must be >= 0")
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("lr", "muon_lr", "weight_decay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")

    def check_batch(self, parallel: ParallelConfig) -> int:
        """Sequences per data-parallel rank (the global batch split evenly)."""
        if self.global_batch % parallel.dp:
            raise ConfigError(
                f"global_batch={self.global_batch} must be divisible by the data-parallel "
                f"degree dp_replicate x dp_shard = {parallel.dp}"
            )
        local = self.global_batch // parallel.dp
        if parallel.pp == 1 and self.microbatches != 1:
            raise ConfigError(
                f"microbatches={self.microbatches} needs pipeline parallelism (pp > 1); "
                "use microbatches=1 with pp=1"
            )
        if local % self.microbatches:
            raise ConfigError(
                f"microbatches={self.microbatches} must divide the per-rank batch "
                f"global_batch / (dp_replicate x dp_shard) = {local}"
            )
        return local

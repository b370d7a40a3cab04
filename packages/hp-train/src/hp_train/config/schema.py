"""What a training run is: the model, the parallel layout and the schedule, as frozen data.

Every field is checked when the object is built, so a bad command line fails before any
process group exists, with the field named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from types import UnionType
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from hp_planner import JobDims, PlanInputError
from hp_planner.inputs import expert_carving_problem
from hp_planner.recipe import (
    AC_MODES,
    CP_VARIANTS,
    DEFAULT_VIRTUAL_STAGES,
    FP8_RECIPES,
    OFFLOAD_TARGETS,
    SCHEDULES,
    ac_budget_bytes,
    check_virtual_stages,
)
from hp_train.config.options import option

__all__ = [
    "AC_MODES",
    "CP_VARIANTS",
    "FP8_RECIPES",
    "MIXED_PRECISIONS",
    "OFFLOAD_TARGETS",
    "PIPELINE_SCHEDULE_NAMES",
    "ROPE_SCALING_TYPES",
    "ConfigError",
    "MoEConfig",
    "ModelConfig",
    "ParallelConfig",
    "RopeScaling",
    "TrainConfig",
    "check_positive",
]

#: The pipeline schedules the entry point runs (``hp_train.parallel.pipeline.PIPELINE_SCHEDULES``).
PIPELINE_SCHEDULE_NAMES = SCHEDULES
#: Compute precisions of ``mixed_precision``.
MIXED_PRECISIONS = ("fp32", "bf16")


#: What a model option is when not given: the ``--model`` preset's value.
_PRESET = "the preset's"
_TRAINING = "training"


class ConfigError(ValueError):
    """A configuration value that cannot work (the message names the field and the fix)."""


_D = TypeVar("_D")


def check_positive(name: str, value: object) -> None:
    """Raise :class:`ConfigError` unless ``value`` is an int >= 1 (``name`` in the message)."""
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
        normalize_topk: divide each token's k routing weights by their sum (Mixtral's router,
            Qwen3-MoE's ``norm_topk_prob``); otherwise they are the chosen experts' softmax
            probabilities as they are.
    """

    n_experts: int = option(
        4, "routed experts (makes it MoE)", table="model", flag="experts", unset="the preset's"
    )
    top_k: int = option(2, "experts each token is sent to", table="model")
    expert_ffn_dim: int = option(
        64, "hidden width of one expert's SwiGLU", table="model", unset="half the preset's ffn_dim"
    )
    every: int = option(
        2, "every N-th block has an MoE feed-forward", table="model", flag="moe-every"
    )
    n_shared_experts: int = option(
        0, "always-on experts added to the routed output", table="model", flag="shared-experts"
    )
    aux_loss_weight: float = option(0.01, "weight of the load-balancing loss", table="model")
    normalize_topk: bool = option(
        False, "divide each token's k routing weights by their sum", table="model"
    )

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "expert_ffn_dim", "every"):
            check_positive(f"moe.{name}", getattr(self, name))
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"moe.top_k={self.top_k} exceeds moe.n_experts={self.n_experts}; a token "
                "cannot go to more experts than exist"
            )
        if not isinstance(self.normalize_topk, bool):
            raise ConfigError(
                f"moe.normalize_topk must be true or false, got {self.normalize_topk!r}"
            )
        if self.n_shared_experts < 0:
            raise ConfigError(f"moe.n_shared_experts must be >= 0, got {self.n_shared_experts}")

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (0-based) has an MoE feed-forward."""
        return (index + 1) % self.every == 0


#: Rotary scalings hp-train computes (unscaled rotary embeddings are ``rope_scaling=None``).
ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequencies scaled for a longer context, as Hugging Face configs give them.

    Attributes:
        rope_type: ``"linear"`` (every frequency divided by ``factor``) or ``"llama3"``
            (Llama 3.1's: frequencies of wavelength above ``original_max_position_embeddings /
            low_freq_factor`` divided by ``factor``, those below ``original_max_position_embeddings
            / high_freq_factor`` kept, a linear blend in between).
        factor: how much longer the context is than the one the model was pre-trained with.
        low_freq_factor: ``"llama3"`` only (``None`` for ``"linear"``).
        high_freq_factor: ``"llama3"`` only, above ``low_freq_factor``.
        original_max_position_embeddings: ``"llama3"`` only: the pre-training context.
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ConfigError(
                f"rope_scaling.rope_type {self.rope_type!r} is not supported; hp-train computes "
                f"{', '.join(repr(t) for t in ROPE_SCALING_TYPES)} (unscaled rotary embeddings, "
                "Hugging Face's 'default', are rope_scaling=None)"
            )
        _finite_positive("rope_scaling.factor", self.factor)
        llama3 = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if self.rope_type == "linear":
            given = [name for name in llama3 if getattr(self, name) is not None]
            if given:
                raise ConfigError(
                    f"rope_scaling.{given[0]} belongs to rope_type 'llama3'; linear scaling "
                    "takes only factor"
                )
            return
        for name in llama3:
            if getattr(self, name) is None:
                raise ConfigError(f"rope_scaling.{name} is required by rope_type 'llama3'")
        assert self.low_freq_factor is not None
        assert self.high_freq_factor is not None
        _finite_positive("rope_scaling.low_freq_factor", self.low_freq_factor)
        _finite_positive("rope_scaling.high_freq_factor", self.high_freq_factor)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        check_positive(
            "rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings
        )


def _finite_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{name} must be a number > 0, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder (Llama, Qwen2 and Qwen3 dense models among them).

    Attributes:
        vocab_size: tokens (256 for the byte-level corpus).
        dim: model width.
        n_layers: transformer blocks.
        n_heads: attention heads (``dim`` divisible by it unless ``explicit_head_dim`` is given).
        n_kv_heads: key/value heads (grouped-query attention; divides ``n_heads``).
        ffn_dim: hidden width of the dense SwiGLU.
        max_seq_len: longest sequence (rotary tables).
        norm_eps: RMSNorm epsilon (of every norm, the per-head q/k norms included).
        rope_theta: rotary base.
        moe: mixture-of-experts layers, or ``None`` for a dense model.
        explicit_head_dim: width of one attention head when it is not ``dim / n_heads`` (Qwen3);
            ``None``: ``dim // n_heads``. Even (rotary pairs).
        qkv_bias: the q, k and v projections have biases (Qwen2).
        o_bias: the attention output projection has a bias (Llama's ``attention_bias``).
        qk_norm: an RMSNorm over each head of q and of k before the rotary embedding (Qwen3's
            ``q_norm``/``k_norm``, weights of ``head_dim``).
        tie_embeddings: the output head multiplies by the token embedding's weight (one
            parameter, ``tok_embeddings.weight``; no ``output.weight``).
        rope_scaling: scaled rotary frequencies, or ``None`` for plain ones.
    """

    vocab_size: int = option(256, "tokens of the vocabulary", table="model", unset=_PRESET)
    dim: int = option(64, "model width", table="model", unset=_PRESET)
    n_layers: int = option(2, "transformer blocks", table="model", unset=_PRESET)
    n_heads: int = option(4, "attention heads", table="model", unset=_PRESET)
    n_kv_heads: int = option(
        4,
        "key/value heads (grouped-query attention)",
        table="model",
        unset="--n-heads if given, else the preset's",
    )
    ffn_dim: int = option(128, "hidden width of the dense SwiGLU", table="model", unset=_PRESET)
    max_seq_len: int = option(
        64,
        "longest sequence (rotary tables)",
        table="model",
        unset="the preset's, raised to --seq-len",
    )
    norm_eps: float = option(1e-5, "RMSNorm epsilon", table="model", unset=_PRESET)
    rope_theta: float = option(10000.0, "rotary base", table="model", unset=_PRESET)
    moe: MoEConfig | None = None
    explicit_head_dim: int | None = option(
        None, "width of one attention head when not dim / n_heads", table="model", unset=_PRESET
    )
    qkv_bias: bool = option(False, "biases on q, k and v", table="model", unset=_PRESET)
    o_bias: bool = option(False, "a bias on the attention output", table="model", unset=_PRESET)
    qk_norm: bool = option(False, "RMSNorm on each head of q and k", table="model", unset=_PRESET)
    tie_embeddings: bool = option(
        False, "the output head uses the token embedding's weight", table="model", unset=_PRESET
    )
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            check_positive(name, getattr(self, name))
        check_positive("max_seq_len", self.max_seq_len)
        _finite_positive("norm_eps", self.norm_eps)
        _finite_positive("rope_theta", self.rope_theta)
        for name in ("qkv_bias", "o_bias", "qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.explicit_head_dim is not None:
            check_positive("explicit_head_dim", self.explicit_head_dim)
        elif self.dim % self.n_heads:
            raise ConfigError(
                f"dim={self.dim} must be divisible by n_heads={self.n_heads} (or give "
                "explicit_head_dim)"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head dim {self.head_dim} must be even for rotary embeddings (it is "
                f"{'explicit_head_dim' if self.explicit_head_dim else 'dim / n_heads'})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                "(grouped-query attention)"
            )
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ConfigError(f"moe must be a MoEConfig or None, got {self.moe!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        if self.explicit_head_dim is not None:
            return self.explicit_head_dim
        return self.dim // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """Every field by name, ``moe`` and ``rope_scaling`` as nested dicts (or ``None``):
        plain JSON values, and ``ModelConfig.from_dict(c.to_dict()) == c``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """The config a :meth:`to_dict` gave (fields it lacks take their defaults, so configs
        written before a field existed still read).

        Raises:
            ConfigError: a key that is no field (the unknown keys and the known ones are
                named), a value of the wrong type, or values the config refuses.
        """
        return _dataclass_from_dict(cls, data, "model")


def _dataclass_from_dict(cls: type[_D], data: Mapping[str, Any], where: str) -> _D:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}")
    hints = get_type_hints(cls)
    known = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; the known ones are {', '.join(known)}")
    values = {
        name: _field_value(hints[name], value, f"{where}.{name}") for name, value in data.items()
    }
    return cls(**values)


def _field_value(hint: Any, value: Any, where: str) -> Any:
    options = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{where} must not be null")
    for kind in options:
        if kind in (MoEConfig, RopeScaling):
            return _dataclass_from_dict(kind, value, where)
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    names = " or ".join(
        "null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options
    )
    raise ConfigError(f"{where} must be {names}, got {value!r}")


@dataclass(frozen=True)
class ParallelConfig(JobDims):
    """How ranks are arranged: ``dp_replicate x dp_shard x cp x tp x pp`` ranks, as the
    trainer's options state them (an :class:`hp_planner.JobDims`: the plan reads it as it is).

    Attributes:
        dp_replicate: data-parallel replicas (HSDP's replicate axis, the slow tier).
        dp_shard: FSDP shards (the fast tier).
        tp: tensor-parallel ranks (innermost: neighbouring ranks).
        pp: pipeline stages (hp-mpmd's runtime; the outermost axis).
        cp: context-parallel ranks: each sequence is split ``cp`` ways (between ``dp_shard``
            and ``tp``); the ``cp`` ranks of a data-parallel rank read the same sequences and
            FSDP shards over ``dp_shard x cp``.
        cp_variant: ``"ring"`` (key/value blocks passed around the ring) or ``"ulysses"``
            (all-to-all between sequence and heads); both with zigzag load balancing.
        ep: expert-parallel ranks of the MoE layers, carved from the FSDP shard axis
            ``dp_shard x cp`` (it divides it, and with ``cp > 1`` is a multiple of ``cp``; no
            ranks of its own): each of ``ep`` neighbouring ranks holds ``n_experts / ep`` whole
            experts, and tokens travel to them by all-to-all. FSDP shards the experts over the
            ``dp_shard x cp / ep`` ranks holding the same ones.
            With ``tp > 1`` the ``tp`` ranks of a data-parallel rank route the same tokens:
            each keeps its experts whole (computed ``tp`` times) unless ``ep_tp``.
        ep_tp: expert-tensor parallelism (with ``ep > 1`` and ``tp > 1``): each expert's hidden
            dim is split over the ``tp`` axis as well (``hp_dtensor.parallel
            .ExpertTensorParallel``), so the ``tp`` ranks share its matmuls instead of
            repeating them.
    """

    dp_replicate: int = option(1, "data-parallel replicas (HSDP)", table="parallel")
    dp_shard: int = option(1, "FSDP shards", table="parallel", unset="what is left")
    tp: int = option(1, "tensor-parallel ranks", table="parallel")
    pp: int = option(1, "pipeline stages", table="parallel")
    cp: int = option(1, "context parallel: split each sequence", table="parallel")
    cp_variant: str = option(
        "ring", "context-parallel attention", table="parallel", choices=CP_VARIANTS
    )
    ep: int = option(1, "expert parallel (MoE), carved from --dp-shard x --cp", table="parallel")
    ep_tp: bool = option(
        False, "with --ep and --tp: split each expert's hidden dim over tp too", table="parallel"
    )

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep"):
            check_positive(name, getattr(self, name))
        if self.cp_variant not in CP_VARIANTS:
            raise ConfigError(f"cp_variant must be one of {CP_VARIANTS}, got {self.cp_variant!r}")
        problem = expert_carving_problem(self.dp_shard, self.cp, self.ep)
        if problem is not None:
            raise ConfigError(f"{problem} (raise --dp-shard or change --ep)")

    @staticmethod
    def fill(
        world_size: int,
        *,
        dp_replicate: int,
        tp: int,
        pp: int,
        cp: int = 1,
        cp_variant: str = "ring",
        ep: int = 1,
        ep_tp: bool = False,
    ) -> ParallelConfig:
        """The configuration whose ``dp_shard`` takes every rank the other axes leave."""
        rest = dp_replicate * tp * pp * cp
        if world_size % rest:
            raise ConfigError(
                f"world size {world_size} is not divisible by dp_replicate x cp x tp x pp = {rest}"
            )
        return ParallelConfig(dp_replicate, world_size // rest, tp, pp, cp, cp_variant, ep, ep_tp)


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
        data: a built-in source (``"corpus"``: the text of the installed hp-* packages;
            ``"synthetic"``: arithmetic progressions; ``"pydoc"``: the documentation topics
            CPython ships) or a local text file, folder, JSON Lines or Parquet path
            (:class:`hp_train.data.loader.DataSpec`).
        tokenizer: a ``tokenizer.json`` (or a folder holding one); None for byte-level tokens.
        text_field: the text column of JSON Lines / Parquet data.
        eval_fraction: share of the documents held out for evaluation (never trained on;
            0: none).
        eval_data: a separate local path to evaluate on instead of a held-out share.
        eval_every: evaluate the held-out loss every N steps and after the last (0: never).
        eval_batches: global batches per evaluation.
        streaming: read the data as a stream (None: decided by its size).
        seed: parameter init, data order and dropout.
        dropout: the probability of zeroing each element of the attention's and the
            feed-forward's output before it is added to the residual stream (residual dropout;
            survivors scaled by ``1 / (1 - dropout)``), in training only; 0: none.
        deterministic: deterministic kernels and one fixed reduction order.
        checkpoint_every: save every N steps (0: never).
        snapshot_every: an in-memory snapshot every N steps (0: never), replicated to a rank
            on another host; a restart with ``--resume`` or ``--resume-if-present`` continues
            from the newest one (:mod:`hp_train.recovery`).
        log_every: precision monitoring every N steps.
        divergence_threshold: warn when a rank's loss on the shared probe batch differs from
            the median of the ranks that evaluated the same tokens by more than this fraction
            (healthy ranks agree to rounding; :mod:`hp_train.observe.monitor`).
        microbatches: microbatches per step and data-parallel rank under pipeline parallelism
            (must divide the per-rank batch; 1 without pipelining).
        pp_schedule: the pipeline schedule: ``"1f1b"``, ``"gpipe"``, ``"zbh1"`` (zero bubble,
            split backward), ``"interleaved"`` (interleaved 1F1B over virtual stages) or
            ``"dualpipev"`` (two stages per rank in a V, split backward in warm-up and drain).
        pp_virtual_stages: pipeline stages per pipeline rank (the model is cut into
            ``pp x pp_virtual_stages`` stages); None: the schedule's (2 for ``interleaved``
            and ``dualpipev``, 1 for the others, the only count those run).
        grad_accum: micro-steps per optimizer step: each rank's batch is split into this many
            slices, run forward and backward one after the other, their gradients summed
            (under HSDP the replicas' all-reduce runs once, after the last).
        clip_grad_norm: clip the global gradient norm to this value before each optimizer
            step (0: no clipping).
        skip_nonfinite: how many steps with a non-finite global loss or gradient the run may
            skip (their gradients dropped, no optimizer step, as ``torch.amp.GradScaler``
            skips an overflowing step; counted over the whole run) before it stops with
            ``hp_train.observe.nonfinite.NonFiniteError``; 0: stop at the first.
        ac: activation checkpointing of every block: ``"none"``, ``"full"`` (keep only the
            block's input, recompute the rest in backward), ``"selective"`` (keep the outputs of
            matmuls and attention, recompute the cheap ops) or ``"budget:<MiB>"`` (keep the
            outputs worth most recompute per byte, up to that many MiB per block call).
        swap: swap the activations a block keeps to host memory, and back for its backward
            (with ``ac="selective"``: the matmul and attention outputs it keeps).
        offload: ``"optimizer"`` (optimizer state in host memory between steps, updated on the
            device), ``"params"`` (FSDP's sharded parameters, their gradients and so the
            optimizer step in host memory), ``"both"``, or ``"none"``.
        mixed_precision: ``"bf16"``: parameters all-gathered and computed in bf16, gradients
            reduced in fp32 onto fp32 sharded masters; ``"fp32"``: everything in fp32.
        fp8: FP8 linears in the blocks (``"tensorwise"`` or ``"blockwise"`` scaling; emulated in
            fp32 where the device has no FP8 matmul); ``"none"``.
        fp8_all_gather: FSDP all-gathers the parameters in FP8 (e4m3, one scale per 128
            elements) and dequantizes them after the gather.
        grad_reduce_dtype: the dtype FSDP's gradient reduce-scatter and all-reduce put on the
            wire (``"bf16"``: half the bytes; accumulated in fp32): ``"fp32"`` or ``"bf16"``.
        compile: ``torch.compile`` each block's attention and feed-forward (production mode).
    """

    steps: int = option(
        20, "optimizer steps to run (in all, counting those before a resume)", table=_TRAINING
    )
    global_batch: int = option(
        8, "sequences per step over all data-parallel ranks", table=_TRAINING
    )
    seq_len: int = option(32, "tokens per sequence", table=_TRAINING)
    optimizer: str = option(
        "muon", "Muon on matrices and AdamW on the rest, or AdamW alone", table=_TRAINING,
        choices=("muon", "adamw"),
    )  # fmt: skip
    lr: float = option(3e-3, "AdamW peak lr", table=_TRAINING)
    muon_lr: float = option(0.02, "Muon peak lr", table=_TRAINING)
    weight_decay: float = option(0.01, "decoupled weight decay", table=_TRAINING)
    warmup_steps: int = option(2, "linear warm-up steps before the cosine decay", table=_TRAINING)
    min_lr_ratio: float = option(0.1, "the cosine decay's floor (x peak lr)", table=_TRAINING)
    data: str = option(
        "corpus",
        "corpus (the hp-* packages' text), synthetic, pydoc (CPython's documentation topics), "
        "or a local .txt/.md file, folder, JSON Lines or Parquet path",
        table="data",
    )
    tokenizer: str | None = option(
        None,
        "a tokenizer.json or a folder holding one (python -m hp_train.data.tokenizer train "
        "makes one); default: bytes",
        table="data",
    )
    text_field: str = option("text", "the text column of JSON Lines/Parquet", table="data")
    eval_fraction: float = option(0.0, "share of documents held out (0: none)", table="data")
    eval_data: str | None = option(None, "a separate local path to evaluate on", table="data")
    eval_every: int = option(0, "evaluate every N steps (0: never)", table="data")
    eval_batches: int = option(4, "global batches per evaluation", table="data")
    streaming: bool | None = option(
        None, "read the data as a stream (auto: by its size)", table="data",
        words=(("auto", None), ("on", True), ("off", False)),
    )  # fmt: skip
    seed: int = option(0, "parameter init, data order and dropout", table=_TRAINING)
    dropout: float = option(
        0.0, "residual dropout: probability of zeroing each element of the attention's and the "
        "feed-forward's output (0: none)", table=_TRAINING,
    )  # fmt: skip
    deterministic: bool = option(
        False, "deterministic kernels and one fixed reduction order", table=_TRAINING
    )
    checkpoint_every: int = option(0, "save a checkpoint every N steps (0: never)", table="run")
    snapshot_every: int = option(
        0,
        "an in-memory snapshot every N steps, replicated to another host (0: never)",
        table="run",
    )
    log_every: int = option(5, "precision monitoring interval", table=_TRAINING)
    divergence_threshold: float = option(
        1e-3,
        "warn when a rank's loss on the shared probe batch is off the median of the ranks "
        "that evaluated it by this fraction",
        table=_TRAINING,
    )
    microbatches: int = option(
        1, "pipeline microbatches per step", table="parallel", unset="pp; 1 without pipelining"
    )
    pp_schedule: str = option(
        "1f1b", "the pipeline schedule", table="parallel", choices=PIPELINE_SCHEDULE_NAMES
    )
    pp_virtual_stages: int | None = option(
        None,
        "pipeline stages per pipeline rank (interleaved: any, dualpipev: 2, others: 1)",
        table="parallel",
        unset="the schedule's: 2 for interleaved and dualpipev, 1 for the others",
    )
    grad_accum: int = option(1, "micro-steps per optimizer step", table=_TRAINING)
    clip_grad_norm: float = option(0.0, "max global norm (0: off)", table=_TRAINING)
    skip_nonfinite: int = option(
        0,
        "skip up to N steps whose loss or gradients are NaN/inf (no optimizer step), then "
        "stop; 0: stop at the first (exit code 3)",
        table=_TRAINING,
    )
    ac: str = option(
        "none", "activation checkpointing: none, full, selective, budget:<MiB>", table=_TRAINING
    )
    swap: bool = option(False, "swap kept activations to host memory", table=_TRAINING)
    offload: str = option(
        "none", "what lives in host memory", table=_TRAINING, choices=OFFLOAD_TARGETS
    )
    mixed_precision: str = option(
        "fp32", "bf16: bf16 all-gather and compute over fp32 masters; fp32: everything fp32",
        table=_TRAINING, choices=MIXED_PRECISIONS,
    )  # fmt: skip
    fp8: str = option("none", "FP8 linears", table=_TRAINING, choices=FP8_RECIPES)
    fp8_all_gather: bool = option(False, "FSDP all-gathers in FP8", table=_TRAINING)
    grad_reduce_dtype: str = option(
        "fp32", "gradient wire dtype", table=_TRAINING, choices=MIXED_PRECISIONS
    )
    compile: bool = option(False, "torch.compile every block", table=_TRAINING)

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "seq_len", "log_every", "microbatches"):
            check_positive(name, getattr(self, name))
        check_positive("grad_accum", self.grad_accum)
        if not (math.isfinite(self.clip_grad_norm) and self.clip_grad_norm >= 0):
            raise ConfigError(
                f"clip_grad_norm must be a finite number >= 0 (0: off), got {self.clip_grad_norm}"
            )
        if (
            isinstance(self.skip_nonfinite, bool)
            or not isinstance(self.skip_nonfinite, int)
            or self.skip_nonfinite < 0
        ):
            raise ConfigError(
                f"skip_nonfinite must be an integer >= 0 (0: stop at the first non-finite "
                f"step), got {self.skip_nonfinite!r}"
            )
        self.ac_budget_bytes  # noqa: B018 - parses ``ac``, raising ConfigError
        for name, value, allowed in (
            ("offload", self.offload, OFFLOAD_TARGETS),
            ("mixed_precision", self.mixed_precision, MIXED_PRECISIONS),
            ("fp8", self.fp8, FP8_RECIPES),
            ("grad_reduce_dtype", self.grad_reduce_dtype, MIXED_PRECISIONS),
        ):
            if value not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("swap", "fp8_all_gather", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.optimizer not in ("muon", "adamw"):
            raise ConfigError(f"optimizer must be 'muon' or 'adamw', got {self.optimizer!r}")
        if self.pp_schedule not in PIPELINE_SCHEDULE_NAMES:
            raise ConfigError(
                f"pp_schedule must be one of {PIPELINE_SCHEDULE_NAMES}, got {self.pp_schedule!r}"
            )
        try:
            check_virtual_stages(self.pp_schedule, self.virtual_stages)
        except PlanInputError as exc:
            raise ConfigError(f"pp_virtual_stages: {exc}") from None
        if min(self.warmup_steps, self.checkpoint_every, self.eval_every, self.snapshot_every) < 0:
            raise ConfigError(
                "warmup_steps, checkpoint_every, snapshot_every and eval_every must be >= 0"
            )
        check_positive("eval_batches", self.eval_batches)
        if self.eval_every and not (self.eval_fraction > 0 or self.eval_data is not None):
            raise ConfigError(
                f"eval_every={self.eval_every} needs held-out data: pass eval_fraction (e.g. "
                "0.1, the share of documents held out) or eval_data (a local path)"
            )
        if not (0.0 <= self.min_lr_ratio <= 1.0):
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("lr", "muon_lr", "weight_decay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be a finite number >= 0, got {value}")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, int | float)
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ConfigError(
                f"dropout must be a probability in [0, 1) (0: no dropout; 1 would zero every "
                f"output), got {self.dropout!r}"
            )

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per pipeline rank: ``pp_virtual_stages``, or the schedule's."""
        if self.pp_virtual_stages is None:
            return DEFAULT_VIRTUAL_STAGES.get(self.pp_schedule, 1)
        return self.pp_virtual_stages

    @property
    def ac_budget_bytes(self) -> int | None:
        """The byte budget of ``ac="budget:<MiB>"``, None for the other modes
        (:func:`hp_planner.recipe.ac_budget_bytes`).

        Raises:
            ConfigError: ``ac`` is none of the modes, or its budget is not a number > 0.
        """
        try:
            return ac_budget_bytes(self.ac)
        except PlanInputError as exc:
            raise ConfigError(str(exc)) from None

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
        if local % self.grad_accum:
            raise ConfigError(
                f"grad_accum={self.grad_accum} must divide the per-rank batch global_batch / "
                f"(dp_replicate x dp_shard) = {local} (each micro-step takes an equal slice)"
            )
        if (local // self.grad_accum) % self.microbatches:
            raise ConfigError(
                f"microbatches={self.microbatches} must divide the per-rank batch of a "
                f"micro-step global_batch / (dp_replicate x dp_shard x grad_accum) = "
                f"{local // self.grad_accum}"
            )
        return local

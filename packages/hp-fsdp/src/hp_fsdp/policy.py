"""Policies of fully_shard: mixed precision, low-precision communication, offload and prefetch
(frozen, documented, FSDP2 names where FSDP2 has the feature)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FLOAT8_WIRE_DTYPES",
    "CPUOffloadPolicy",
    "LowPrecisionCommPolicy",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "PrefetchPolicy",
    "as_mixed_precision",
    "as_offload",
    "default_prefetch",
]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; the main parameters and gradients stay in their
    own (typically fp32) dtype.

    Attributes:
        param_dtype: dtype of the unsharded parameters used in forward and backward (the
            all-gather runs in it); None keeps the parameters' dtype.
        reduce_dtype: dtype of the gradient reduction (reduce-scatter and all-reduce); None
            uses ``param_dtype`` (or the parameters' dtype).
        output_dtype: dtype the module's floating-point outputs are cast to; None leaves them.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


FLOAT8_WIRE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
"""Wire dtypes sent as block-scaled FP8 (data bytes plus one fp32 scale per block)."""

_REDUCE_WIRE_DTYPES = frozenset({torch.float32, torch.bfloat16}) | FLOAT8_WIRE_DTYPES


@dataclass(frozen=True)
class LowPrecisionCommPolicy:
    """What the collectives of a fully_shard group put on the wire, separately for the parameter
    all-gather and for the gradient reduction of each tier (a :class:`MixedPrecisionPolicy` still
    sets the compute dtype of the unsharded parameters and the dtype of the reduced gradients).

    Block-scaled FP8: a rank's contribution is cut into blocks of ``block_size`` elements (the
    blocks of one rank's chunk never straddle into another rank's chunk), each block sent as FP8
    data plus one fp32 scale, ``x ~ data * scale``; data and scales travel in one byte buffer
    per rank (gloo has no FP8 collectives; bytes are bytes).

    Attributes:
        param_all_gather_dtype: None: all-gather the parameters in the compute dtype (the
            default, FSDP2's behaviour); ``torch.float8_e4m3fn`` (or ``float8_e5m2``): quantize
            this rank's shard once per optimizer step (cached on the shard's version counter and
            the count of ``torch.optim.Optimizer`` steps, so the re-gather in backward reuses
            it), all-gather FP8 bytes and scales, and dequantize into the unsharded parameter
            buffer (compute dtype). Needs floating-point parameters. Updates must go through a
            torch optimizer or the parameters (``load_state_dict``, ``param.copy_``): a write
            through ``param.data`` outside an optimizer step moves neither and would leave the
            cached FP8 shard stale.
        shard_reduce_dtype: wire dtype of the gradient reduce-scatter over the shard (fast)
            axis. None or ``torch.float32``: the backend's own reduce-scatter in the reduce
            dtype. ``torch.bfloat16`` or an FP8 dtype: each rank casts (quantizes) the chunk
            destined to each peer, one all-to-all moves them, and each rank dequantizes what it
            received and sums it in fp32 in rank order (deterministic, identical on every run).
        replicate_reduce_dtype: wire dtype of the gradient all-reduce over the replicate (slow)
            axis of HSDP, same values. Low precision: the same reduce-scatter as above over the
            replicate axis, then an all-gather of each rank's reduced chunk re-cast
            (re-quantized) for the wire; every replica decodes the same bytes, so replicas stay
            bit-identical. Only valid on a 2-d (replicate, shard) mesh.
        block_size: elements per FP8 scale (positive; 128 by default: one fp32 scale per 128
            one-byte elements adds 1/32 to the bytes of the data).
    """

    param_all_gather_dtype: torch.dtype | None = None
    shard_reduce_dtype: torch.dtype | None = None
    replicate_reduce_dtype: torch.dtype | None = None
    block_size: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"block_size must be an int, got {self.block_size!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        gather = self.param_all_gather_dtype
        if gather is not None and gather not in FLOAT8_WIRE_DTYPES:
            raise ValueError(
                f"param_all_gather_dtype must be None or an FP8 dtype (torch.float8_e4m3fn, "
                f"torch.float8_e5m2), got {gather}; for a bf16 all-gather set "
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
            )
        for name in ("shard_reduce_dtype", "replicate_reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and dtype not in _REDUCE_WIRE_DTYPES:
                raise ValueError(
                    f"{name} must be None, torch.float32, torch.bfloat16, torch.float8_e4m3fn or "
                    f"torch.float8_e5m2, got {dtype}"
                )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default): sharded parameters and gradients stay on the device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in host memory (so the optimizer state and its
    step are there too); copy the shard to the mesh's device for the all-gather and the
    reduced gradient back. On a CPU mesh both copies still run (host to host), so the path is
    the one an accelerator takes.

    Attributes:
        pin_memory: pin the host buffers for asynchronous copies (needs an accelerator mesh;
            fully_shard refuses ``True`` on a CPU mesh).
    """

    pin_memory: bool = True


@dataclass(frozen=True)
class PrefetchPolicy:
    """Which all-gathers fully_shard issues one group ahead, in the order of the first forward
    (implicit prefetch; explicit ``set_modules_to_*_prefetch`` lists replace it per module).
    Each candidate is decided by :func:`hp_fsdp.prefetch_plan.decide_prefetch`: a group whose
    shard axis has one rank is never prefetched (nothing to hide).

    Attributes:
        forward: when a group's forward starts, issue the next group's all-gather. Free at the
            step's peak for a model whose activations outgrow its blocks: the peak comes at the
            end of forward, where there is no next group.
        backward: when a group's backward starts, issue the all-gather of the group before it.
            Adds that group's unsharded parameters to the step's peak (the start of backward).
        max_bytes: backward prefetch only for groups whose unsharded parameters take at most
            this many bytes (what it may add to the peak); None: no limit.
    """

    forward: bool
    backward: bool
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"PrefetchPolicy.max_bytes must be >= 0 or None, got {self.max_bytes}")


def default_prefetch(device: torch.device) -> PrefetchPolicy:
    """The implicit prefetch fully_shard uses for groups on ``device``: both directions, on
    every device, as torch FSDP2 does (``hp_fsdp.prefetch_plan`` states the cost model).

    * Accelerators (NCCL, HCCL): collectives run on their own streams beside compute, so a
      group fetched early is communication taken off the critical path.
    * CPU (gloo): the all-gather runs on gloo's thread beside compute. ``benchmarks/
      fsdp_step.py``'s model at world 2 (2-core EPYC, one thread per rank, 15 interleaved
      rounds): backward prefetch 0.95x the step time of forward-only (128.3 against 134.6 ms;
      torch FSDP2 163.0 ms); its cost at the peak, one block's unsharded parameters, keeps the
      step's live tensors below torch FSDP2's since gradients are flattened only when a group
      is reduced (``tests/test_memory.py``).
    """
    del device  # the same everywhere; kept so that a device-specific measurement can differ
    return PrefetchPolicy(forward=True, backward=True)


def as_mixed_precision(policy: object) -> MixedPrecisionPolicy:
    """``policy`` as this package's MixedPrecisionPolicy: None is the default, and torch's
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` (same attributes) is converted.

    Raises:
        TypeError: anything else.
    """
    if policy is None:
        return MixedPrecisionPolicy()
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    if isinstance(policy, TorchPolicy):
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=policy.cast_forward_inputs,
        )
    raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(policy).__name__}")


def as_offload(policy: object) -> CPUOffloadPolicy | None:
    """The CPU offload ``policy`` asks for, None for no offload (None or ``OffloadPolicy()``,
    this package's or torch's).

    Raises:
        TypeError: anything else.
    """
    from torch.distributed import fsdp as torch_fsdp

    if isinstance(policy, CPUOffloadPolicy):
        return policy
    if isinstance(policy, torch_fsdp.CPUOffloadPolicy):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if policy is None or type(policy) in (OffloadPolicy, torch_fsdp.OffloadPolicy):
        return None
    raise TypeError(
        f"offload_policy must be OffloadPolicy() or CPUOffloadPolicy(...), got "
        f"{type(policy).__name__}"
    )

"""The policies' documented decisions and conversions, each written out here: the implicit
prefetch (both directions on every device) and its decision rule, torch FSDP2's
policy objects taken over attribute by attribute (every attribute given a distinct value, so
a swapped or dropped one shows), and the refusals. No processes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import fsdp as torch_fsdp

from hp_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, PrefetchPolicy
from hp_fsdp.policy import as_mixed_precision, as_offload, default_prefetch
from hp_fsdp.prefetch_plan import Direction, decide_prefetch


def test_default_prefetch_per_device() -> None:
    for device in ("cpu", "cuda", "xpu", "hpu"):
        # Not allocated on: the decision reads only the device type.
        got = default_prefetch(torch.device(device))
        assert got == PrefetchPolicy(forward=True, backward=True, max_bytes=None), device


def test_prefetch_decision_rule() -> None:
    """Every combination against the rule written out here: prefetch exactly when the policy
    enables the direction, the shard axis has more than one rank, and (backward only) the
    group's unsharded bytes fit ``max_bytes``."""
    for direction in Direction:
        for enabled in (False, True):
            for shard_size in (1, 2, 8):
                for size in (0, 100, 101):
                    for cap in (None, 0, 100):
                        got = decide_prefetch(direction, enabled, shard_size, size, cap)
                        fits = cap is None or size <= cap or direction is Direction.FORWARD
                        want = enabled and shard_size > 1 and fits
                        assert got.prefetch == want, (direction, enabled, shard_size, size, cap)
                        assert got.reason
    with pytest.raises(ValueError, match="shard_size must be at least 1"):
        decide_prefetch(Direction.FORWARD, True, 0, 1, None)
    with pytest.raises(ValueError, match="non-negative"):
        decide_prefetch(Direction.BACKWARD, True, 2, 1, -1)
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        PrefetchPolicy(True, True, max_bytes=-1)


def test_torch_mixed_precision_policy_is_taken_over_attribute_by_attribute() -> None:
    theirs = torch_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        output_dtype=torch.float16,
        cast_forward_inputs=False,
    )
    assert as_mixed_precision(theirs) == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        output_dtype=torch.float16,
        cast_forward_inputs=False,
    )
    ours = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert as_mixed_precision(ours) is ours
    assert as_mixed_precision(None) == MixedPrecisionPolicy()
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy, got dict"):
        as_mixed_precision({"param_dtype": torch.bfloat16})


def test_offload_policies_of_both_libraries() -> None:
    assert as_offload(None) is None
    assert as_offload(OffloadPolicy()) is None
    assert as_offload(torch_fsdp.OffloadPolicy()) is None
    assert as_offload(torch_fsdp.CPUOffloadPolicy(pin_memory=False)) == CPUOffloadPolicy(
        pin_memory=False
    )
    assert as_offload(torch_fsdp.CPUOffloadPolicy()) == CPUOffloadPolicy(pin_memory=True)
    ours = CPUOffloadPolicy(pin_memory=False)
    assert as_offload(ours) is ours
    with pytest.raises(TypeError, match="offload_policy must be OffloadPolicy"):
        as_offload("cpu")

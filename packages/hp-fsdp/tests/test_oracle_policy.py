"""The policies' documented decisions and conversions, each written out here: the implicit
prefetch per device (forward only on CPU, both directions on accelerators), torch FSDP2's
policy objects taken over attribute by attribute (every attribute given a distinct value, so
a swapped or dropped one shows), and the refusals. No processes."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import fsdp as torch_fsdp

from hp_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, PrefetchPolicy
from hp_fsdp.policy import as_mixed_precision, as_offload, default_prefetch


def test_default_prefetch_per_device() -> None:
    assert default_prefetch(torch.device("cpu")) == PrefetchPolicy(forward=True, backward=False)
    for accelerator in ("cuda", "xpu", "hpu"):
        # Not allocated on: the decision reads only the device type.
        got = default_prefetch(torch.device(accelerator))
        assert got == PrefetchPolicy(forward=True, backward=True), accelerator


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

"""Bad input to fully_shard: each a clear error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hp_dtensor import DeviceMesh
from hp_fsdp import fully_shard
from hp_layout import Mesh, Topology
from hp_testing import run_on_ranks


def _errors() -> list[str]:
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", Mesh((2,), ("shard",)))
    messages: list[str] = []

    def attempt(action: object) -> None:
        try:
            assert callable(action)
            action()
            messages.append("no error")
        except (ValueError, NotImplementedError, RuntimeError) as exc:
            messages.append(str(exc))

    twice = nn.Linear(3, 3)
    fully_shard(twice, mesh=mesh)
    attempt(lambda: fully_shard(twice, mesh=mesh))

    grid = DeviceMesh("cpu", Mesh((2, 2), ("replicate", "shard"), (0, 2, 1, 3)))
    hosts = Topology.two_tier_cluster(hosts=2, ranks_per_host=2)
    # Shard axis {0, 2} crosses hosts while the replicate axis {0, 1} stays inside one.
    attempt(lambda: fully_shard(nn.Linear(3, 3), mesh=grid, topology=hosts))

    mixed = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).double())
    attempt(lambda: fully_shard(mixed, mesh=mesh))

    shared = nn.Parameter(torch.ones(3, 3))
    pair = nn.ModuleList([nn.Module(), nn.Module()])
    pair[0].register_parameter("w", shared)
    pair[1].register_parameter("w", shared)
    fully_shard(pair[0], mesh=mesh)
    attempt(lambda: fully_shard(pair[1], mesh=mesh))

    meta = fully_shard(nn.Linear(3, 3, device="meta"), mesh=mesh)
    attempt(lambda: meta(torch.ones(2, 3)))
    half_meta = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    attempt(lambda: fully_shard(half_meta, mesh=mesh))

    outer = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    attempt(lambda: fully_shard([outer, outer[0]], mesh=mesh))
    attempt(lambda: fully_shard([], mesh=mesh))

    from hp_fsdp import CPUOffloadPolicy

    pinned = CPUOffloadPolicy(pin_memory=True)
    attempt(lambda: fully_shard(nn.Linear(3, 3), mesh=mesh, offload_policy=pinned))

    cast = fully_shard(nn.Linear(3, 3), mesh=mesh)
    attempt(lambda: cast.double())

    loaded = fully_shard(nn.Linear(3, 3, device="meta"), mesh=mesh)
    whole = {"weight": torch.ones(3, 3), "bias": torch.ones(3)}
    attempt(lambda: loaded.load_state_dict(whole, assign=True))
    return messages


@pytest.mark.multiprocess
def test_bad_input_is_named() -> None:
    messages = run_on_ranks(2, _errors)[0]
    twice, topology, mixed, shared, meta, half_meta, nested, empty, pinned, cast, loaded = messages
    assert "already fully_shard'ed" in twice
    assert "does not match topology" in topology
    assert "several dtypes" in mixed
    assert "already sharded by the fully_shard group" in shared
    assert "still on meta" in meta
    assert "to_empty" in meta
    assert "are on meta but" in half_meta
    assert "inside module 0" in nested
    assert "empty list" in empty
    assert "pin_memory=False" in pinned
    assert "from torch.float32 to torch.float64 is not supported" in cast
    # torch FSDP2's sentence leads, so a test matching torch's message matches hp's.
    assert meta.startswith("FSDP parameters should be materialized from meta device")
    assert "still on meta" in loaded
    assert "materialize" in loaded


def _bf16_warning(slow: bool) -> list[str]:
    import warnings

    from hp_fsdp import MixedPrecisionPolicy
    from hp_kernels import precision

    precision.warn_if_bf16_is_slow.cache_clear()
    original = precision.bf16_matmul_is_slow
    precision.bf16_matmul_is_slow = lambda device_type="cpu": slow  # type: ignore[assignment]
    try:
        mesh = DeviceMesh("cpu", Mesh((2,), ("shard",)))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                fully_shard(nn.Linear(3, 3), mesh=mesh, mp_policy=policy)
        return [str(w.message) for w in caught]
    finally:
        precision.bf16_matmul_is_slow = original
        precision.warn_if_bf16_is_slow.cache_clear()


@pytest.mark.multiprocess
def test_bf16_mixed_precision_warns_once_on_a_cpu_without_fast_bf16() -> None:
    slow = run_on_ranks(2, _bf16_warning, True)[0]
    assert len(slow) == 1
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16) asks for bf16 compute" in slow[0]
    assert run_on_ranks(2, _bf16_warning, False)[0] == []

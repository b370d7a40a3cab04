"""The weight sync at world 4: the rollout engine's shards equal the trained weights bit for
bit, for dense and MoE models, FSDP's flat and per-parameter storage, colocated (FSDP 2 x TP 2
or HSDP 2 x 1 x TP 2 training, TP 2 x 2 replicas rolling out on the same ranks) and
disaggregated (2 training ranks, 2 rollout ranks), by both methods; a failure mid-sync changes
nothing.

The oracle is independent of the sync: the trained weights come whole from FSDP's own state
dict (``full_tensor``), and each rollout rank's shard must be ``torch.chunk`` of that along the
one dim where the shapes differ (Megatron's plan: column-parallel weights split their rows,
row-parallel ones their columns; the rest are whole).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_testing import run_on_ranks

WORLD = 4


def _model_config(moe: bool, vocab_size: int = 64) -> Any:
    """The tiny Llama of hp-rl's world-4 tests, dense or with 4 experts."""
    from hp_train.config.schema import ModelConfig, MoEConfig

    return ModelConfig(
        vocab_size=vocab_size,
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=32,
        moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=16) if moe else None,
    )


def _roles(placement: str) -> Any:
    from hp_rl.roles import plan_roles

    if placement == "colocated":
        return plan_roles(WORLD, placement="colocated", tp=2, rollout_tp=2)
    if placement == "hsdp_tp":  # HSDP (2 replicas of 1 shard) x TP 2, colocated
        return plan_roles(WORLD, dp_replicate=2, dp_shard=1, tp=2, rollout_tp=2)
    return plan_roles(WORLD, placement="disaggregated", rollout_tp=2, rollout_ranks=2)


def _train_one_step(policy: torch.nn.Module, seed: int) -> None:
    """One AdamW step on a loss of random tokens, so the synced weights are not the init."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 16), generator=gen)
    loss = policy(ids).float().logsumexp(-1).mean()
    loss.backward()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    opt.step()
    opt.zero_grad()


def _sync_case(placement: str, moe: bool, param_layout: str, method: str) -> dict[str, Any]:
    from hp_rl.models import build_policy, build_rollout_model, create_groups, local_layouts
    from hp_rl.weight_sync import connect_weight_sync
    from hp_train.config.schema import TrainConfig

    rank = dist.get_rank()
    roles = _roles(placement)
    create_groups(roles)
    config = _model_config(moe)
    device = torch.device("cpu")
    policy = rollout = None
    if roles.trains(rank):
        policy = build_policy(
            config, roles, rank, train=TrainConfig(seed=3), device=device, param_layout=param_layout
        )
        _train_one_step(policy, seed=11)
    if roles.rolls_out(rank):
        rollout = build_rollout_model(config, roles, device=device)
        with torch.no_grad():
            for p in rollout.parameters():
                p.fill_(float("nan"))  # any element the sync misses stays NaN
    sync = connect_weight_sync(
        None if policy is None else local_layouts(policy),
        None if rollout is None else local_layouts(rollout),
        method=method,
    )
    result = sync.run(version=7)
    return {**gathered_weights(policy, rollout, roles), "version": result.version}


def gathered_weights(policy: Any, rollout: Any, roles: Any) -> dict[str, Any]:
    """What :func:`_check_bitwise` compares, on rank 0 (collective): every rank's FSDP whole
    weights (``full_tensor`` of the policy's state dict) and rollout shards with their
    tensor-parallel index."""
    from hp_rl.models import local_layouts
    from hp_train.objects import gather_objects

    full = None
    if policy is not None:
        names = {n for n, _ in policy.named_parameters()}
        full = {n: v.full_tensor() for n, v in policy.state_dict().items() if n in names}
    local = tp_rank = None
    if rollout is not None:
        local = {n: t.clone() for n, (_, t) in local_layouts(rollout).items()}
        tp_rank = roles.rollout_tp_rank(dist.get_rank())
    gathered = gather_objects((full, local, tp_rank), "test gather weights")
    return {"gathered": gathered if dist.get_rank() == 0 else None, "tp": roles.rollout_tp}


def _check_bitwise(out: dict[str, Any]) -> int:
    gathered = out["gathered"]
    full = next(g[0] for g in gathered if g[0] is not None)
    compared = 0
    for _, local, tp_rank in gathered:
        if local is None:
            continue
        assert set(local) == set(full)
        for name, shard in local.items():
            whole = full[name]
            differing = [d for d in range(whole.dim()) if whole.shape[d] != shard.shape[d]]
            if differing:
                assert len(differing) == 1, name
                want = torch.chunk(whole, out["tp"], dim=differing[0])[tp_rank]
            else:
                want = whole
            assert not torch.isnan(shard).any(), f"{name}: elements the sync never wrote"
            assert torch.equal(shard, want), f"{name} on TP rank {tp_rank} differs"
            compared += 1
    return compared


CASES = [
    ("colocated", False, "flat", "direct"),
    ("colocated", True, "flat", "direct"),
    ("hsdp_tp", True, "flat", "direct"),
    ("colocated", False, "flat", "full_gather"),
    ("disaggregated", False, "per_param", "direct"),
    ("disaggregated", True, "per_param", "direct"),
    ("disaggregated", True, "flat", "full_gather"),
]


@pytest.mark.parametrize(("placement", "moe", "param_layout", "method"), CASES)
def test_synced_rollout_weights_equal_trained_bit_for_bit(
    placement: str, moe: bool, param_layout: str, method: str
) -> None:
    outs = run_on_ranks(WORLD, _sync_case, placement, moe, param_layout, method, timeout=240)
    compared = _check_bitwise(outs[0])
    assert compared >= 10
    assert all(o["version"] == 7 for o in outs)


def _failing_sync(stage: str, failing_rank: int) -> dict[str, Any]:
    """Sync once (version 1), train a step, then sync again with one rank failing at
    ``stage``: every rank must raise, and the rollout weights stay version 1's; a third sync
    then succeeds."""
    from hp_rl.models import build_policy, build_rollout_model, create_groups, local_layouts
    from hp_rl.weight_sync import SyncFailedError, connect_weight_sync
    from hp_rl.weight_sync.execute import WeightSync
    from hp_train.config.schema import TrainConfig

    rank = dist.get_rank()
    roles = _roles("colocated")
    create_groups(roles)
    config = _model_config(False)
    device = torch.device("cpu")
    policy = build_policy(config, roles, rank, train=TrainConfig(seed=3), device=device)
    rollout = build_rollout_model(config, roles, device=device)
    sync = connect_weight_sync(local_layouts(policy), local_layouts(rollout))
    sync.run(version=1)
    before = {n: t.clone() for n, (_, t) in local_layouts(rollout).items()}
    _train_one_step(policy, seed=5)
    original = getattr(WeightSync, stage)

    def broken(self: WeightSync, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if self.rank == failing_rank:
            raise OSError(f"injected failure in {stage}")
        return out

    setattr(WeightSync, stage, broken)
    try:
        with pytest.raises(SyncFailedError, match="keeps the previous weights") as caught:
            sync.run(version=2)
    finally:
        setattr(WeightSync, stage, original)
    after_failure = {n: t.clone() for n, (_, t) in local_layouts(rollout).items()}
    unchanged = all(torch.equal(before[n], after_failure[n]) for n in before)
    sync.run(version=3)
    after_retry = {n: t for n, (_, t) in local_layouts(rollout).items()}
    changed = any(not torch.equal(before[n], after_retry[n]) for n in before)
    return {"message": str(caught.value), "unchanged": unchanged, "changed": changed}


@pytest.mark.parametrize("stage", ["_pack", "_exchange"])
def test_failed_sync_leaves_previous_weights(stage: str) -> None:
    """A rank failing while it packs its messages (before any is sent), or after every message
    arrived (before the commit)."""
    outs = run_on_ranks(WORLD, _failing_sync, stage, 2, timeout=240)
    for rank, out in enumerate(outs):
        assert out["unchanged"], f"rank {rank}: a failed sync changed rollout weights"
        assert out["changed"], f"rank {rank}: the retry did not bring the new weights"
    assert "rank 2: OSError: injected failure" in outs[2]["message"]
    assert "another rank failed" in outs[0]["message"]

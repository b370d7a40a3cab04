"""GRPO steps at world 4, colocated (FSDP 2 x TP 2 training, TP 2 x 2 rollout replicas on the
same ranks) and disaggregated (2 training ranks, 2 rollout ranks): the reward of a learnable
toy task climbs, the synced rollout weights equal the trained ones bit for bit after the
updates, a stale rollout is refused, the consistency mode makes the trainer's and the
engine's log-probabilities bit-equal, and the data-parallel update equals one device's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_testing import run_on_ranks
from test_weight_sync import _check_bitwise, gathered_weights
from test_weight_sync import _model_config as weight_sync_model_config

WORLD = 4


def _ascii_task(base: Any) -> Any:
    """The arithmetic task's prompts, rewarded by the share of ASCII characters in the
    response: a random byte-level model starts near 1/2, and only learning raises it."""
    from hp_rl.tasks.arithmetic import ArithmeticTask

    class AsciiShare(ArithmeticTask):
        def reward(self, problem: Any, completion: str) -> float:
            text = completion.replace(self.end_marker, "")
            return sum(ch.isascii() for ch in text) / max(len(text), 1)

    return AsciiShare(base.max_operand, base.operations, end_marker=base.end_marker)


def _model_config(moe: bool = False) -> Any:
    return weight_sync_model_config(moe, vocab_size=256)  # byte-level tokens


BASE = {
    "prompts_per_step": 8,
    "group_size": 4,
    "max_new_tokens": 6,
    "max_operand": 9,
    "optimizer": "adamw",
    "lr": 2e-2,
}


def _trainer(overrides: dict[str, Any], moe: bool = False) -> Any:
    from hp_rl.config import RLConfig
    from hp_rl.trainer import GRPOTrainer
    from hp_train.data.tokenizer import ByteTokenizer

    config = RLConfig(**{**BASE, **overrides})
    trainer = GRPOTrainer(config, _model_config(moe), ByteTokenizer(), device=torch.device("cpu"))
    trainer.task = _ascii_task(trainer.task)
    return trainer


def _run(overrides: dict[str, Any], steps: int, moe: bool) -> dict[str, Any]:
    trainer = _trainer(overrides, moe)
    records = [trainer.step(s) for s in range(steps)]
    trainer.sync_weights(steps)
    policy = None if trainer.training is None else trainer.training.policy
    model = None if trainer.engine is None else trainer.engine.model
    weights = gathered_weights(policy, model, trainer.roles)
    return {"records": records, "weights": weights if dist.get_rank() == 0 else None}


LAYOUTS: dict[str, dict[str, Any]] = {
    "colocated": {"tp": 2, "rollout_tp": 2},
    "disaggregated": {
        "placement": "disaggregated",
        "rollout_ranks": 2,
        "rollout_tp": 2,
        "param_layout": "per_param",
    },
}


@pytest.mark.parametrize(("layout", "moe"), [("colocated", False), ("disaggregated", True)])
def test_grpo_steps_learn_and_sync_bit_for_bit(layout: str, moe: bool) -> None:
    steps = 8
    outs = run_on_ranks(WORLD, _run, LAYOUTS[layout], steps, moe, timeout=300)
    records = outs[0]["records"]
    assert all(r == o["records"][i] for o in outs for i, r in enumerate(records)), (
        "every rank reports the same metrics"
    )
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, f"the reward did not climb: {rewards}"
    assert all(r["grad_norm"] > 0 for r in records)
    assert [r["policy_version"] for r in records] == list(range(steps))
    assert _check_bitwise(outs[0]["weights"]) >= 10


def _stale(skip_at: int) -> str:
    from hp_rl.experience import StaleRolloutError
    from hp_rl.weight_sync import SyncResult

    trainer = _trainer(LAYOUTS["colocated"])
    trainer.step(0)
    original = trainer.sync_weights
    # A sync that reports success but never writes the weights nor the version.
    trainer.sync_weights = lambda version: SyncResult(version, 0.0, 0, 0)
    try:
        trainer.step(skip_at)
    except StaleRolloutError as exc:
        return str(exc)
    finally:
        trainer.sync_weights = original
    return "no error"


def test_stale_rollout_is_refused() -> None:
    messages = run_on_ranks(WORLD, _stale, 1, timeout=300)
    for message in messages:
        assert "sampled by policy version 0" in message, message
        assert "max_lag=0" in message, message


def _lagging(steps: int) -> list[Any]:
    trainer = _trainer({**LAYOUTS["colocated"], "sync_every": 2, "max_lag": 1})
    return [trainer.step(s)["policy_version"] for s in range(steps)]


def test_sync_every_two_trains_within_the_lag() -> None:
    versions = run_on_ranks(WORLD, _lagging, 4, timeout=300)[0]
    assert versions == [0, None, 2, None]


def _diffs(consistency: bool) -> list[tuple[float, float]]:
    trainer = _trainer({**LAYOUTS["colocated"], "consistency": consistency, "minibatches": 2})
    return [
        (r["logprob_diff_max"], r["logprob_diff_mean"]) for r in (trainer.step(s) for s in range(3))
    ]


def test_consistency_mode_makes_logprobs_bit_equal() -> None:
    exact = run_on_ranks(WORLD, _diffs, True, timeout=300)[0]
    assert all(d == (0.0, 0.0) for d in exact), exact


def _experience(rows: int, columns: int, seed: int) -> Any:
    """A fixed batch: random tokens, response masks of varied lengths, behaviour
    log-probabilities near the policy's and group-structured advantages."""
    from hp_rl.experience import Experience

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (rows, columns), generator=gen)
    starts = torch.randint(2, columns // 2, (rows,), generator=gen)
    ends = torch.randint(columns // 2 + 1, columns, (rows,), generator=gen)
    positions = torch.arange(columns - 1)
    mask = (positions[None] >= starts[:, None]) & (positions[None] < ends[:, None])
    old = torch.where(mask, -5.5 + 0.1 * torch.randn(rows, columns - 1, generator=gen), 0.0)
    return Experience(
        tokens=tokens,
        mask=mask,
        old_logprobs=old,
        advantages=torch.randn(rows, generator=gen),
        rewards=torch.zeros(rows),
        ref_logprobs=None,
        policy_version=0,
    )


def _sgd_update(distributed: bool, aggregation: str) -> dict[str, torch.Tensor] | None:
    """One SGD step of GRPO's loss on the fixed batch: FSDP 2 x TP 2 (each data-parallel rank
    its half of the rows), or one device with every row."""
    from hp_rl.grpo import GRPOLossConfig
    from hp_rl.models import build_policy, create_groups
    from hp_rl.update import grpo_update
    from hp_train.config.schema import TrainConfig
    from hp_train.model.llama import Transformer

    config = _model_config()
    batch = _experience(8, 12, seed=21)
    loss_config = GRPOLossConfig(loss_aggregation=aggregation)  # type: ignore[arg-type]
    if distributed:
        from hp_dtensor import DeviceMesh

        roles = _roles_colocated()
        create_groups(roles)
        rank = dist.get_rank()
        model = build_policy(
            config, roles, rank, train=TrainConfig(seed=4), device=torch.device("cpu")
        )
        rows = batch.split(roles.dp)[roles.training_dp_rank(rank)]
        dp_group = DeviceMesh("cpu", roles.training_grid())[
            ["dp_replicate", "dp_shard"]
        ].get_mesh_group()
        dp_size = roles.dp
    else:
        torch.manual_seed(4)
        model = Transformer(config)
        rows, dp_group, dp_size = batch, None, 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    grpo_update(
        model,
        optimizer,
        schedule,
        rows,
        loss_config=loss_config,
        minibatches=1,
        temperature=1.0,
        dp_group=dp_group,
        dp_size=dp_size,
        clip_norm=0.0,
    )
    if not distributed:
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {n for n, _ in model.named_parameters()}
    full = {n: v.full_tensor() for n, v in model.state_dict().items() if n in names}
    return full if dist.get_rank() == 0 else None


def _roles_colocated() -> Any:
    from hp_rl.roles import plan_roles

    return plan_roles(WORLD, tp=2, rollout_tp=2)


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_data_parallel_update_equals_one_device(aggregation: str) -> None:
    """The loss normalizer and FSDP's gradient average give one device's step: an SGD step
    (which, unlike Adam or Muon, keeps the gradient's scale) on FSDP 2 x TP 2 with half the
    rows per data-parallel rank equals the step on every row at once."""
    want = _sgd_update(False, aggregation)
    got = run_on_ranks(WORLD, _sgd_update, True, aggregation, timeout=300)[0]
    assert want is not None
    assert got is not None
    torch.manual_seed(4)
    moved = 0
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=2e-6, msg=name)
    from hp_train.model.llama import Transformer

    initial = dict(Transformer(_model_config()).named_parameters())
    moved = sum(int(not torch.equal(initial[n], v)) for n, v in want.items())
    assert moved > len(want) // 2, "the step must change the weights for the check to mean much"


def _with_reference(steps: int) -> dict[str, Any]:
    """GRPO with a KL penalty: the reference engine holds the starting policy all along."""
    from hp_rl.models import local_layouts

    trainer = _trainer({**LAYOUTS["colocated"], "kl_coef": 0.5, "minibatches": 1})
    assert trainer.reference is not None
    before = {n: t.clone() for n, (_, t) in local_layouts(trainer.reference.model).items()}
    trainer.sync_weights(0)
    engine_before = {n: t.clone() for n, (_, t) in local_layouts(trainer.engine.model).items()}
    records = [trainer.step(s) for s in range(steps)]
    after = {n: t for n, (_, t) in local_layouts(trainer.reference.model).items()}
    policy_now = {n: t for n, (_, t) in local_layouts(trainer.engine.model).items()}
    return {
        "kl": [r["kl"] for r in records],
        "reference_frozen": all(torch.equal(before[n], after[n]) for n in before),
        "reference_is_start": all(torch.equal(before[n], engine_before[n]) for n in before),
        "policy_moved": any(not torch.equal(before[n], policy_now[n]) for n in before),
    }


def test_kl_to_a_frozen_reference() -> None:
    """The reference is synced once from the starting policy and never again; the KL to it is
    0 while the policy is the reference and grows once the policy has moved."""
    for out in run_on_ranks(WORLD, _with_reference, 4, timeout=300):
        assert out["reference_frozen"]
        assert out["reference_is_start"]
        assert out["policy_moved"]
        assert out["kl"][0] < 1e-9, out["kl"]
        assert all(k > 0 for k in out["kl"][1:]), out["kl"]


_TIMING = ("rollout_s", "train_s", "sync_s", "rollout_tokens_per_s", "train_tokens_per_s")


def numbers(record: dict[str, Any]) -> dict[str, Any]:
    """A step's metrics without its timings (what two equal runs share exactly)."""
    return {k: v for k, v in record.items() if k not in _TIMING}


def _optimizer_offload(offload: bool) -> dict[str, Any]:
    from hp_offload import OffloadedOptimizer

    trainer = _trainer({**LAYOUTS["colocated"], "offload_optimizer": offload})
    records = [numbers(trainer.step(s)) for s in range(3)]
    side = trainer.training
    on_host = all(
        t.device.type == "cpu"
        for state in side.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    return {
        "records": records,
        "offloaded": isinstance(side.stepper, OffloadedOptimizer),
        "on_host": on_host,
    }


def test_offloaded_optimizer_state_trains_identically() -> None:
    """With the optimizer state kept in host memory between updates (what a colocated engine
    generates beside), the run is the same, bit for bit."""
    plain = run_on_ranks(WORLD, _optimizer_offload, False, timeout=300)[0]
    offloaded = run_on_ranks(WORLD, _optimizer_offload, True, timeout=300)[0]
    assert offloaded["offloaded"]
    assert not plain["offloaded"]
    assert offloaded["on_host"]
    assert offloaded["records"] == plain["records"]

"""Distributed Muon (and its AdamW group) with the optimizer state offloaded to host memory.

``--optimizer muon --offload optimizer|both``: hp-offload's ``OffloadedOptimizer`` steps the
chained optimizer bucket by bucket, with buckets that differ between ranks (here made to differ
on purpose: each rank gets another bucket size), while Muon, which declares ``steps_jointly``,
gets every one of its parameters in one bucket and is stepped once per step on every rank, so
its one cross-rank exchange is intact. The claim is today's for offload with AdamW: bit-equal
losses, gradient norms, parameters and optimizer state to the same layout without offload.
The oracle is that run (no offload wrapper at all), compared through the checkpoints both
write at the last step.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_layout import Topology
from hp_planner.price import StepShape, dry_run
from hp_testing import run_on_ranks
from hp_testing.checkpoints import assert_identical, checkpoint_state
from hp_train.config.combinations import check_combination
from hp_train.config.schema import ParallelConfig, TrainConfig
from hp_train.dryrun import TrainerModel
from hp_train.runtime import init_runtime
from hp_train.trainer import RunOptions, train
from test_compositions import DENSE
from test_compositions import _config as compositions_config

STEPS = 4


def _bucket_bytes(rank: int) -> int:
    """Even ranks: 1 byte (every parameter a bucket of its own); odd ranks: 8 kB (under one
    block's state). A step has several buckets on every rank, not the same on neighbours."""
    return 1 if rank % 2 == 0 else 8_000


def _config(**kwargs: Any) -> TrainConfig:
    """The composition tests' configuration with Muon, checkpointed every 2 steps."""
    base = {"steps": STEPS, "warmup_steps": 1, "optimizer": "muon", "checkpoint_every": 2}
    return compositions_config(**{**base, **kwargs})


def _offloaded_bytes(wrapper: Any) -> int:
    return sum(
        v.numel() * v.element_size()
        for state in wrapper.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _run(parallel: ParallelConfig, config: TrainConfig, out: str, resume_from: str | None) -> Any:
    """Train on this pool rank into ``out`` (shared by the ranks); the losses, rank 0's
    gradient norms, and what the offload wrapper and Muon did at each step."""
    from hp_muon import Muon
    from hp_offload import OffloadedOptimizer

    runtime = init_runtime("cpu", threads=1)
    seen: dict[str, Any] = {"muon_steps": 0, "steps": []}
    init, step, muon_step = OffloadedOptimizer.__init__, OffloadedOptimizer.step, Muon.step

    def small_buckets(self: Any, optimizer: Any, **kwargs: Any) -> None:
        kwargs.setdefault("bucket_bytes", _bucket_bytes(runtime.rank))
        init(self, optimizer, **kwargs)

    def observed_step(self: Any, closure: None = None) -> None:
        step(self, closure)
        stats = self.last_step_stats
        tensors = [
            v for s in self.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        seen["steps"].append(
            {
                "buckets": stats.buckets,
                "joint_steps": stats.joint_steps,
                "h2d_bytes": stats.h2d_bytes,
                "d2h_bytes": stats.d2h_bytes,
                "largest_bucket_bytes": stats.largest_bucket_bytes,
                "offloaded_bytes": _offloaded_bytes(self),
                "muon_state_bytes": sum(
                    v.numel() * v.element_size()
                    for o in self.optimizer.optimizers
                    if isinstance(o, Muon)
                    for s in o.state.values()
                    for v in s.values()
                ),
                "on_host": all(v.device == self.transfers.host for v in tensors if v.dim() > 0),
                "pinned": all(v.is_pinned() for v in tensors if v.dim() > 0)
                if self.transfers.pin
                else None,
            }
        )

    def counted_muon_step(self: Any, closure: Any = None) -> Any:
        seen["muon_steps"] += 1
        return muon_step(self, closure)

    OffloadedOptimizer.__init__ = small_buckets  # type: ignore[method-assign]
    OffloadedOptimizer.step = observed_step  # type: ignore[method-assign]
    Muon.step = counted_muon_step  # type: ignore[method-assign]
    try:
        options = RunOptions(
            Path(out), quiet=True, resume_from=None if resume_from is None else Path(resume_from)
        )
        summary = train(DENSE, parallel, config, options, runtime)
    finally:
        OffloadedOptimizer.__init__ = init  # type: ignore[method-assign]
        OffloadedOptimizer.step = step  # type: ignore[method-assign]
        Muon.step = muon_step  # type: ignore[method-assign]
    norms: dict[int, float] = {}
    if runtime.rank == 0:
        for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "grad_norm" in record:
                norms[record["step"]] = record["grad_norm"]
    return {"losses": summary.losses, "norms": norms, "first": summary.first_step, **seen}


def _launch(
    parallel: ParallelConfig, config: TrainConfig, out: Path, resume_from: Path | None = None
) -> list[dict[str, Any]]:
    where = None if resume_from is None else str(resume_from)
    return run_on_ranks(parallel.world_size, _run, parallel, config, str(out), where, timeout=300)


def _state(out: Path, step: int, scratch: Path) -> dict[str, object]:
    return checkpoint_state(out / "checkpoints" / f"step_{step:06d}", scratch)


#: world 2 and world 4; the parameters too in host memory with ``both`` (hp-fsdp's CPU
#: offload of the shards).
CASES: dict[str, tuple[ParallelConfig, str]] = {
    "fsdp2, optimizer": (ParallelConfig(dp_shard=2), "optimizer"),
    "fsdp2, both": (ParallelConfig(dp_shard=2), "both"),
    "fsdp2 x tp2, optimizer": (ParallelConfig(dp_shard=2, tp=2), "optimizer"),
    "fsdp4, both": (ParallelConfig(dp_shard=4), "both"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_muon_is_bit_equal(case: str, tmp_path: Path) -> None:
    """Losses, gradient norms, and the last checkpoint (parameters and the Muon and AdamW
    state) equal the same layout without offload bit for bit; on every rank and step the
    wrapper took several buckets but stepped Muon once, whole, and left its state on the
    host."""
    parallel, offload = CASES[case]
    plain = _launch(parallel, _config(), tmp_path / "plain")
    moved = _launch(parallel, _config(offload=offload), tmp_path / "moved")
    assert moved[0]["losses"] == plain[0]["losses"]
    assert moved[0]["norms"] == plain[0]["norms"]
    assert len(plain[0]["norms"]) == STEPS
    assert_identical(
        _state(tmp_path / "moved", STEPS, tmp_path / "moved.pt"),
        _state(tmp_path / "plain", STEPS, tmp_path / "plain.pt"),
    )
    for rank, result in enumerate(moved):
        assert result["muon_steps"] == STEPS, (rank, result["muon_steps"])
        assert len(result["steps"]) == STEPS
        for i, s in enumerate(result["steps"]):
            assert s["buckets"] > 1, (rank, s)
            assert s["joint_steps"] == 1, (rank, s)
            assert s["on_host"], (rank, s)
            assert s["pinned"] in (None, True), (rank, s)
            # Every byte of state went back to the host; from the second step on (the first
            # creates it on the device) it came from there, Muon's all in one bucket.
            assert s["d2h_bytes"] == s["offloaded_bytes"] > 0, (rank, s)
            if i > 0:
                assert s["h2d_bytes"] == s["offloaded_bytes"], (rank, s)
                assert s["largest_bucket_bytes"] >= s["muon_state_bytes"] > 0, (rank, s)
    # Ranks with other bucket sizes took other numbers of buckets (what used to break Muon).
    assert len({r["steps"][-1]["buckets"] for r in moved}) > 1, [r["steps"] for r in moved]
    last = moved[0]["steps"][-1]
    print(
        f"{case}: rank 0 keeps {last['offloaded_bytes']} bytes of optimizer state on the host "
        f"({last['muon_state_bytes']} of them Muon's); at most {last['largest_bucket_bytes']} "
        f"on the device at once, in {last['buckets']} buckets"
    )


@pytest.mark.multiprocess
def test_resume_with_offloaded_muon_state(tmp_path: Path) -> None:
    """The offloaded run's step-2 checkpoint holds the state of the run without offload, bit
    for bit; a run resumed from it with offload continues to the same step-4 checkpoint and
    losses as the uninterrupted one."""
    parallel = ParallelConfig(dp_shard=2)
    config = _config(offload="optimizer")
    whole = _launch(parallel, config, tmp_path / "whole")
    _launch(parallel, _config(), tmp_path / "plain")
    assert_identical(
        _state(tmp_path / "whole", 2, tmp_path / "a.pt"),
        _state(tmp_path / "plain", 2, tmp_path / "b.pt"),
    )
    saved = tmp_path / "whole" / "checkpoints" / f"step_{2:06d}"
    copy = tmp_path / "copy" / saved.name
    shutil.copytree(saved, copy)
    resumed = _launch(parallel, config, tmp_path / "resumed", resume_from=copy)
    assert resumed[0]["first"] == 2
    assert resumed[0]["losses"] == {s: whole[0]["losses"][s] for s in (2, 3)}
    assert all(s["on_host"] for r in resumed for s in r["steps"])
    assert_identical(
        _state(tmp_path / "resumed", STEPS, tmp_path / "c.pt"),
        _state(tmp_path / "whole", STEPS, tmp_path / "d.pt"),
    )


def test_muon_with_offload_is_accepted_and_priced() -> None:
    """The pair is no longer refused at start-up (``hp_train.config.combinations``), and the
    dry run, which refuses what the trainer refuses, prices it: the whole state (Muon's
    momentum included) in host memory, its transfers timed."""
    parallel = ParallelConfig(dp_shard=2)
    shape = StepShape(global_batch=8, seq_len=16, optimizer="muon")
    kept = dry_run(TrainerModel(DENSE), parallel, Topology.single_host(2), shape)
    assert kept.memory.muon_state > 0
    for offload in ("optimizer", "both"):
        check_combination(DENSE, parallel, _config(offload=offload))
        run = dry_run(
            TrainerModel(DENSE), parallel, Topology.single_host(2), replace(shape, offload=offload)
        )
        assert run.memory.optimizer == run.memory.muon_state == 0
        assert run.memory.host >= kept.memory.optimizer
        assert run.time.offload > 0

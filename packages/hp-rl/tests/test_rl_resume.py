"""A GRPO run resumed from its checkpoint continues exactly as the uninterrupted run (world 4,
FSDP 2 x TP 2 training, TP 2 x 2 rollout replicas on the same ranks): the policy, its
optimizer and the step are restored; the prompts and every sampling draw are functions of the
seed and the step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hp_testing import run_on_ranks
from test_grpo_trainer import LAYOUTS, WORLD, _trainer, numbers


def _uninterrupted(out: str, steps: int, save_at: int) -> list[dict[str, Any]]:
    trainer = _trainer({**LAYOUTS["colocated"], "out": out, "checkpoint_every": save_at})
    records = []
    for step in range(steps):
        records.append(numbers(trainer.step(step)))
        if step + 1 == save_at:
            trainer.save(step + 1)
    return records


def _resumed(out: str, steps: int) -> tuple[int, list[dict[str, Any]]]:
    trainer = _trainer({**LAYOUTS["colocated"], "out": out})
    start = trainer.resume()
    return start, [numbers(trainer.step(step)) for step in range(start, steps)]


def test_resume_continues_bit_for_bit(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    want = run_on_ranks(WORLD, _uninterrupted, out, 5, 3, timeout=300)[0]
    start, got = run_on_ranks(WORLD, _resumed, out, 5, timeout=300)[0]
    assert start == 3
    assert got == want[3:], "the resumed steps differ from the uninterrupted run's"
    assert want[3]["grad_norm"] > 0

"""One rollout batch on a rollout replica: prompts to an :class:`~hp_rl.experience.Experience`.

Every random draw is a function of the run's seed and the step (and the replica): the
prompts of step ``s`` are the task's problems drawn from ``Random(f"{seed}:{s}")`` on every
rank alike, each replica takes its consecutive share, and samples with a generator seeded by
``(seed, s, replica)`` (the same on every rank of the replica, so tensor parallelism draws the
same tokens). A resumed run therefore repeats exactly the draws an uninterrupted one makes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hp_rl.engine import RolloutEngine
from hp_rl.experience import Experience, behaviour_logprobs
from hp_rl.grpo import group_advantages
from hp_rl.sampling import SamplingParams
from hp_rl.scoring import join
from hp_rl.tasks.arithmetic import ArithmeticTask, Problem
from hp_train.data.tokenizer import TextTokenizer

__all__ = ["RolloutShare", "make_experience", "step_generator", "step_problems"]


@dataclass(frozen=True)
class RolloutShare:
    """Which prompts of a step a replica answers: ``replica`` of ``replicas``."""

    replica: int
    replicas: int

    def of(self, problems: Sequence[Problem]) -> list[Problem]:
        """This replica's consecutive share of ``problems`` (which must divide evenly)."""
        if len(problems) % self.replicas:
            raise ValueError(
                f"{len(problems)} prompts cannot be shared by {self.replicas} rollout replicas"
            )
        size = len(problems) // self.replicas
        return list(problems[self.replica * size : (self.replica + 1) * size])


def step_problems(
    task: ArithmeticTask, count: int, seed: int, step: int, split: str = "train"
) -> list[Problem]:
    """The ``count`` problems of step ``step`` (the same on every rank)."""
    return task.problems(count, random.Random(f"{seed}:{split}:{step}"), split)  # type: ignore[arg-type]


def step_generator(seed: int, step: int, replica: int) -> torch.Generator:
    """The sampling generator of ``replica`` at ``step``."""
    mixed = (seed * 1_000_003 + step) * 1_009 + replica
    return torch.Generator().manual_seed(mixed % (2**63))


def make_experience(
    engine: RolloutEngine,
    problems: Sequence[Problem],
    *,
    task: ArithmeticTask,
    tokenizer: TextTokenizer,
    params: SamplingParams,
    group_size: int,
    generator: torch.Generator,
    rescore_parts: int | None = None,
    reference: RolloutEngine | None = None,
    parts: int = 1,
) -> tuple[Experience, int]:
    """Sample ``group_size`` responses per problem, reward them, and compute advantages.

    The behaviour log-probabilities are the engine's sampling ones, or (``rescore_parts``:
    the consistency mode) those of :meth:`RolloutEngine.score` on the joined sequences cut
    into ``rescore_parts`` consecutive parts, as the trainer cuts its minibatches, so both
    compute on the same shapes. ``reference``: its log-probabilities for the KL term, cut in
    ``parts`` alike. Returns the experience and the number of response tokens generated.
    """
    prompts = [tokenizer.encode(p.prompt) for p in problems for _ in range(group_size)]
    generation = engine.generate(prompts, params, generator)
    lengths = generation.response_lengths.tolist()
    completions = [
        tokenizer.decode(generation.response[i, :n].tolist()) for i, n in enumerate(lengths)
    ]
    rewards = torch.tensor(
        [task.reward(problems[i // group_size], c) for i, c in enumerate(completions)],
        dtype=torch.float32,
    )
    pad_id = tokenizer.eos_id
    sequences = join(prompts, generation, pad_id)
    temperature = params.logprob_temperature
    if rescore_parts is None:
        old = behaviour_logprobs(generation, sequences)
    else:
        scored = torch.cat(
            [engine.score(t, temperature) for t in sequences.tokens.chunk(rescore_parts)]
        )
        old = torch.where(sequences.response_mask, scored, torch.zeros_like(scored))
    ref = None
    if reference is not None:
        ref = torch.cat([reference.score(t, temperature) for t in sequences.tokens.chunk(parts)])
    experience = Experience(
        tokens=sequences.tokens,
        mask=sequences.response_mask,
        old_logprobs=old,
        advantages=group_advantages(rewards, group_size),
        rewards=rewards,
        ref_logprobs=ref,
        policy_version=engine.policy_version,
    )
    return experience, int(sum(lengths))

"""The GRPO run: set up the job's models and the weight sync, then for each step sync, roll
out, update, report.

Reading top to bottom: :class:`GRPOTrainer` builds the roles (:mod:`hp_rl.roles`), the process
groups, the policy in the training layout with hp-train's optimizer and schedule, the rollout
engine (and the frozen reference) in the rollout layout, and one weight sync per engine,
planned once (:mod:`hp_rl.weight_sync`). :meth:`GRPOTrainer.step` then syncs the rollout
weights every ``sync_every`` steps (the engine's policy version becomes the step), samples the
step's batch on every rollout replica (:func:`hp_rl.rollout.make_experience`), hands each
data-parallel training rank its rows (its own replica's when the layouts line up, else
gathered), refuses a batch older than ``max_lag`` (:func:`hp_rl.experience.check_fresh`),
updates the policy (:func:`hp_rl.update.grpo_update`) and gathers the step's metrics.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from hp_dtensor import DeviceMesh
from hp_dtensor.watchdog import watch
from hp_layout import Topology
from hp_offload import OffloadedOptimizer
from hp_rl.config import RLConfig, RLConfigError
from hp_rl.engine import BuiltinEngine
from hp_rl.experience import Experience, check_fresh, concat
from hp_rl.models import build_policy, build_rollout_model, create_groups, local_layouts
from hp_rl.roles import JobRoles, plan_roles
from hp_rl.rollout import RolloutShare, make_experience, step_generator, step_problems
from hp_rl.sampling import SamplingParams
from hp_rl.tasks.arithmetic import ArithmeticTask
from hp_rl.update import UpdateStats, grpo_update
from hp_rl.weight_sync import SyncResult, connect_weight_sync
from hp_train.checkpoint.dcp import latest_checkpoint, load_checkpoint, save_checkpoint
from hp_train.config.schema import ModelConfig, TrainConfig
from hp_train.data.tokenizer import TextTokenizer
from hp_train.model.llama import Transformer
from hp_train.objects import gather_objects
from hp_train.optim import build_optimizer, build_schedule

__all__ = ["CONFIG_FILE", "GRPOTrainer", "TrainingSide"]

#: The file a checkpoint holds the run's configuration in.
CONFIG_FILE = "hp_rl_config.json"


@dataclass(frozen=True)
class TrainingSide:
    """What a training rank holds: the laid-out policy, its optimizer and schedule, the
    data-parallel group its loss units are summed over, and what steps the parameters (the
    optimizer, or an ``hp_offload.OffloadedOptimizer`` around it that keeps its state in host
    memory between updates, while the engine generates)."""

    policy: Transformer
    optimizer: torch.optim.Optimizer
    schedule: LRScheduler
    dp_group: dist.ProcessGroup
    stepper: torch.optim.Optimizer | OffloadedOptimizer


def _job_topology() -> Topology:
    """The job's hosts as torchrun describes them (``LOCAL_WORLD_SIZE`` ranks each), for the
    process group that exists (a job started without torchrun: one host)."""
    env = dict(os.environ)
    env["WORLD_SIZE"] = str(dist.get_world_size())
    env.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    return Topology.from_env(env)


class GRPOTrainer:
    """A GRPO run on the initialized default process group (see the module docstring).

    Args:
        config: the run.
        model_config: the policy's architecture.
        tokenizer: the task's tokenizer (its end-of-sequence token ends every response).
        device: this rank's device.
        init_weights: a Hugging Face folder to load the policy (and the reference) from;
            None: the seed's random initialization.
    """

    def __init__(
        self,
        config: RLConfig,
        model_config: ModelConfig,
        tokenizer: TextTokenizer,
        *,
        device: torch.device,
        init_weights: str | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.rank = dist.get_rank()
        self.roles = self._roles()
        self.task = ArithmeticTask(
            max_operand=config.max_operand,
            operations=config.operations,
            end_marker=tokenizer.decode([tokenizer.eos_id]),
        )
        self.params = SamplingParams(
            **{**asdict(config.sampling()), "stop_tokens": (tokenizer.eos_id,)}
        )
        create_groups(self.roles, device.type)
        self.training = (
            self._build_training(model_config, device, init_weights)
            if self.roles.trains(self.rank)
            else None
        )
        self.engine: BuiltinEngine | None = None
        self.reference: BuiltinEngine | None = None
        if self.roles.rolls_out(self.rank):
            self.engine = self._engine(model_config, device)
            if config.kl_coef > 0:
                self.reference = self._engine(model_config, device)
        topology = _job_topology()
        policy_tensors = None if self.training is None else local_layouts(self.training.policy)
        self.sync = connect_weight_sync(
            policy_tensors,
            None if self.engine is None else self.engine.tensors(),
            method=config.sync_method,
            topology=topology,
        )
        self.start_step = 0
        if config.kl_coef > 0:
            # The reference is the policy the run starts from: synced once, never again.
            reference_sync = connect_weight_sync(
                policy_tensors,
                None if self.reference is None else self.reference.tensors(),
                method=config.sync_method,
                topology=topology,
                what="reference",
            )
            reference_sync.run(0)
            if self.reference is not None:
                self.reference.policy_version = 0
        self.aligned = self._layouts_line_up()
        if config.consistency and not self.aligned:
            raise RLConfigError(
                "consistency needs each data-parallel training rank to train on exactly the rows "
                "its own rollout replica sampled (colocated, rollout_tp == tp): other layouts "
                "compute on other shapes"
            )

    # Set-up ----------------------------------------------------------------------------------

    def _roles(self) -> JobRoles:
        c = self.config
        roles = plan_roles(
            dist.get_world_size(),
            placement=c.placement,
            dp_replicate=c.dp_replicate,
            dp_shard=c.dp_shard,
            tp=c.tp,
            rollout_tp=c.rollout_tp,
            rollout_ranks=c.rollout_ranks,
        )
        rows = c.prompts_per_step * c.group_size
        if c.prompts_per_step % roles.rollout_groups:
            raise RLConfigError(
                f"prompts_per_step={c.prompts_per_step} must be a multiple of the "
                f"{roles.rollout_groups} rollout replicas"
            )
        if rows % (roles.dp * c.minibatches):
            raise RLConfigError(
                f"the {rows} responses of a step (prompts_per_step x group_size) must split "
                f"evenly over {roles.dp} data-parallel ranks x {c.minibatches} minibatches"
            )
        if c.eval_every and c.eval_prompts < roles.rollout_groups:
            raise RLConfigError(
                f"eval_prompts={c.eval_prompts} gives some of the {roles.rollout_groups} rollout "
                "replicas no held-out problem; ask for at least one per replica"
            )
        if c.checkpoint_every and roles.placement != "colocated":
            raise RLConfigError(
                "checkpoints are written by every rank of the job and a disaggregated job's "
                "rollout ranks hold no policy: checkpoint_every needs placement 'colocated' (not "
                "implemented for disaggregated jobs)"
            )
        return roles

    def _train_config(self) -> TrainConfig:
        c = self.config
        return TrainConfig(
            steps=c.steps * c.minibatches,
            optimizer=c.optimizer,
            lr=c.lr,
            muon_lr=c.muon_lr,
            weight_decay=c.weight_decay,
            warmup_steps=c.warmup_steps,
            seed=c.seed,
        )

    def _build_training(
        self, model_config: ModelConfig, device: torch.device, init_weights: str | None
    ) -> TrainingSide:
        train = self._train_config()
        policy = build_policy(
            model_config,
            self.roles,
            self.rank,
            train=train,
            device=device,
            param_layout=self.config.param_layout,
        )
        if init_weights is not None:
            from hp_train.checkpoint.hf import load_hf_weights

            load_hf_weights(policy, init_weights)
        optimizer = build_optimizer(policy, train)
        grid = DeviceMesh(device.type, self.roles.training_grid())
        stepper: torch.optim.Optimizer | OffloadedOptimizer = optimizer
        if self.config.offload_optimizer:
            stepper = OffloadedOptimizer(optimizer, device=device)
        return TrainingSide(
            policy,
            optimizer,
            build_schedule(optimizer, train),
            grid[["dp_replicate", "dp_shard"]].get_mesh_group(),
            stepper,
        )

    def _engine(self, model_config: ModelConfig, device: torch.device) -> BuiltinEngine:
        model = build_rollout_model(model_config, self.roles, device=device)
        group = None
        if self.roles.rollout_tp > 1:
            group = DeviceMesh(device.type, self.roles.rollout_grid()).get_group("tp")
        return BuiltinEngine(model, pad_id=self.tokenizer.eos_id, group=group)

    def _layouts_line_up(self) -> bool:
        """Whether every training rank trains on exactly its own rollout replica's rows."""
        r = self.roles
        if r.placement != "colocated" or r.rollout_groups != r.dp:
            return False
        return all(r.rollout_group(k) == r.training_dp_rank(k) for k in r.training_ranks)

    # Checkpoints -----------------------------------------------------------------------------

    def checkpoints(self) -> Path:
        """The folder of the run's checkpoints."""
        return Path(self.config.out) / "checkpoints"

    def resume(self) -> int:
        """Load the newest checkpoint, if any; returns the step to continue from (0: none).
        The policy, its optimizer state and the step are all a resume needs: the prompts and
        the sampling of every step are functions of the seed and the step, and the reference
        is the run's starting policy (loaded again from the same weights)."""
        found = latest_checkpoint(self.checkpoints())
        if found is None:
            return 0
        side = self._side()
        step = load_checkpoint(found[1], side.policy, side.optimizer)
        for _ in range(step * self.config.minibatches):
            side.schedule.step()
        self.start_step = step
        return step

    def save(self, step: int) -> Path:
        """A checkpoint after ``step`` steps (collective)."""
        side = self._side()
        files = {CONFIG_FILE: json.dumps(asdict(self.config), indent=1, sort_keys=True)}
        return save_checkpoint(self.checkpoints(), step, side.policy, side.optimizer, files=files)

    def _side(self) -> TrainingSide:
        if self.training is None:
            raise RuntimeError(f"rank {self.rank} does not train: it holds no policy")
        return self.training

    # One step --------------------------------------------------------------------------------

    def sync_weights(self, version: int) -> SyncResult:
        """Write the policy's weights into the rollout engine as ``version`` (collective)."""
        result = self.sync.run(version)
        if self.engine is not None:
            self.engine.policy_version = version
        return result

    def _rollout(self, step: int) -> tuple[Experience | None, int]:
        if self.engine is None:
            return None, 0
        c, r = self.config, self.roles
        replica = r.rollout_group(self.rank)
        problems = RolloutShare(replica, r.rollout_groups).of(
            step_problems(self.task, c.prompts_per_step, c.seed, step)
        )
        return make_experience(
            self.engine,
            problems,
            task=self.task,
            tokenizer=self.tokenizer,
            params=self.params,
            group_size=c.group_size,
            generator=step_generator(c.seed, step, replica),
            rescore_parts=c.minibatches if c.consistency else None,
            reference=self.reference,
            parts=c.minibatches,
        )

    def _rows_to_train(self, mine: Experience | None) -> Experience | None:
        """This training rank's rows of the step's batch."""
        r = self.roles
        if self.aligned:
            return mine if r.trains(self.rank) else None
        leader = mine is not None and r.rollout_tp_rank(self.rank) == 0
        parts = gather_objects(mine if leader else None, "grpo experience gather")
        if not r.trains(self.rank):
            return None
        batch = concat([p for p in parts if isinstance(p, Experience)], self.tokenizer.eos_id)
        return batch.split(r.dp)[r.training_dp_rank(self.rank)]

    def step(self, step: int) -> dict[str, Any]:
        """One GRPO step (collective); returns the job's metrics of it (on every rank)."""
        c = self.config
        sync_s = None
        if step % c.sync_every == 0 or step == self.start_step:
            sync_s = self.sync_weights(step).seconds
        started = time.perf_counter()
        mine, generated = self._rollout(step)
        rollout_s = time.perf_counter() - started
        rows = self._rows_to_train(mine)
        stats = None
        started = time.perf_counter()
        if rows is not None:
            check_fresh(rows.policy_version, step, c.max_lag)
            side = self._side()
            stats = grpo_update(
                side.policy,
                side.stepper,
                side.schedule,
                rows,
                loss_config=c.loss(),
                minibatches=c.minibatches,
                temperature=self.params.logprob_temperature,
                dp_group=side.dp_group,
                dp_size=self.roles.dp,
                clip_norm=c.clip_grad_norm,
            )
        train_s = time.perf_counter() - started
        return self._metrics(step, mine, generated, stats, rollout_s, train_s, sync_s)

    def _metrics(
        self,
        step: int,
        mine: Experience | None,
        generated: int,
        stats: UpdateStats | None,
        rollout_s: float,
        train_s: float,
        sync_s: float | None,
    ) -> dict[str, Any]:
        r = self.roles
        rollout_leader = mine is not None and r.rollout_tp_rank(self.rank) == 0
        train_leader = stats is not None and r.training_tp_rank(self.rank) == 0
        record = {
            "rewards": mine.rewards.tolist() if rollout_leader and mine is not None else None,
            "lengths": int(mine.mask.sum()) if rollout_leader and mine is not None else 0,
            "generated": generated if rollout_leader else 0,
            "stats": asdict(stats) if train_leader and stats is not None else None,
            "rollout_s": rollout_s,
            "train_s": train_s,
            "sync_s": sync_s,
        }
        everyone = [x for x in gather_objects(record, "grpo metrics gather") if isinstance(x, dict)]
        rewards = [v for x in everyone if x["rewards"] for v in x["rewards"]]
        trained = [x["stats"] for x in everyone if x["stats"] is not None]
        rollout_time = max(x["rollout_s"] for x in everyone)
        train_time = max(x["train_s"] for x in everyone)

        def mean(key: str) -> float:
            return float(sum(s[key] for s in trained)) / len(trained)

        return {
            "step": step + 1,
            "reward": sum(rewards) / len(rewards),
            "response_length": sum(x["lengths"] for x in everyone) / len(rewards),
            "loss": mean("loss"),
            "kl": mean("kl"),
            "clip_fraction": mean("clip_fraction"),
            "ratio_max": max(s["ratio_max"] for s in trained),
            "grad_norm": trained[0]["grad_norm"],
            "logprob_diff_max": max(s["logprob_diff_max"] for s in trained),
            "logprob_diff_mean": mean("logprob_diff_mean"),
            "rollout_tokens_per_s": sum(x["generated"] for x in everyone) / rollout_time,
            "train_tokens_per_s": sum(s["tokens"] for s in trained) / max(train_time, 1e-9),
            "rollout_s": rollout_time,
            "train_s": train_time,
            "sync_s": None if sync_s is None else max(x["sync_s"] for x in everyone),
            "policy_version": step if sync_s is not None else None,
        }

    # Evaluation ------------------------------------------------------------------------------

    def evaluate(self, step: int) -> float:
        """Greedy accuracy of the rollout weights on ``eval_prompts`` held-out problems
        (collective; the rollout replicas share the problems)."""
        c, r = self.config, self.roles
        score = torch.zeros(2, dtype=torch.float64)
        if self.engine is not None:
            replica = r.rollout_group(self.rank)
            count = c.eval_prompts - c.eval_prompts % r.rollout_groups
            problems = RolloutShare(replica, r.rollout_groups).of(
                step_problems(self.task, count, c.seed, 0, "eval")
            )
            greedy = SamplingParams(
                max_new_tokens=c.max_new_tokens,
                temperature=0.0,
                stop_tokens=self.params.stop_tokens,
            )
            prompts = [self.tokenizer.encode(p.prompt) for p in problems]
            generation = self.engine.generate(prompts, greedy, torch.Generator().manual_seed(0))
            if r.rollout_tp_rank(self.rank) == 0:
                for i, problem in enumerate(problems):
                    n = int(generation.response_lengths[i])
                    text = self.tokenizer.decode(generation.response[i, :n].tolist())
                    score += torch.tensor(
                        [self.task.reward(problem, text), 1.0], dtype=torch.float64
                    )
        with watch("grpo evaluation all-reduce"):
            dist.all_reduce(score)
        right, asked = (float(v) for v in score.tolist())
        return right / asked if asked else math.nan

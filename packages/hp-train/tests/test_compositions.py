"""Every technique of the main job, composed, against one rank on the same batches.

Each case trains a few steps at world 2 or 4 in the rank pool and compares its global losses
and its step-0 gradient norm (before any update: a scaled gradient shows there at once) with
one rank's, or with the same layout without the technique where the claim is bit-equality.
Tolerances (fp32 unless the case is about precision), measured on an AMD EPYC (AVX2), torch
2.13 CPU, and stated in the hp-train README:

* fp32 compositions: losses within ``FP32_LOSS_TOLERANCE`` (measured at most 7.2e-7) and the
  step-0 gradient norm within ``FP32_NORM_TOLERANCE`` relative (measured 0 to 1.1e-7);
* activation checkpointing, swap, offload: bit-equal to the same layout without them;
* bf16 mixed precision / FP8 (emulated in fp32 on the CPU) against fp32 over 100 steps: the
  loss curves within ``BF16_CURVE_TOLERANCE`` / ``FP8_CURVE_TOLERANCE``.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_testing import run_on_ranks
from hp_train.config.combinations import REFUSALS, check_combination, combination_table
from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.runtime import init_runtime
from hp_train.trainer import RunOptions, train

DENSE = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
DEEP = ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def _moe(aux: float, expert_ffn_dim: int = 32, every: int = 2) -> ModelConfig:
    moe = MoEConfig(
        n_experts=4,
        top_k=2,
        expert_ffn_dim=expert_ffn_dim,
        every=every,
        n_shared_experts=1,
        aux_loss_weight=aux,
    )
    return ModelConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, moe=moe
    )


# A large load-balancing weight, so that a wrongly scaled auxiliary gradient shows.
MOE = _moe(0.5)
MOE_NO_AUX = _moe(0.0)
# Every block a MoE: the first one's FSDP group prefetches the next block inside the region.
ALL_MOE = _moe(0.5, every=1)

FP32_LOSS_TOLERANCE = 2e-6
FP32_NORM_TOLERANCE = 1e-6
# 100 steps against fp32 at FSDP 2 (measured: bf16 with the bf16 gradient wire 1.3e-3, FP8
# tensorwise with the FP8 all-gather 1.8e-2).
BF16_CURVE_TOLERANCE = 5e-3
FP8_CURVE_TOLERANCE = 6e-2


def _config(**kwargs: Any) -> TrainConfig:
    base: dict[str, Any] = {
        "steps": 6,
        "global_batch": 8,
        "seq_len": 16,
        "data": "synthetic",
        "log_every": 1,
        "warmup_steps": 2,
        "optimizer": "adamw",
    }
    return TrainConfig(**{**base, **kwargs})


def _run(
    model: ModelConfig, parallel: ParallelConfig, config: TrainConfig, out: str
) -> dict[str, Any]:
    """Train; the global losses, rank 0's gradient norms by step, and hp-fsdp's gradient
    collectives by purpose."""
    from hp_fsdp.counting import CountingMode
    from hp_offload import OffloadedOptimizer, Swapper
    from hp_train.model.llama import Attention

    runtime = init_runtime("cpu", threads=1)
    folder = Path(out) / f"rank{runtime.rank}"
    # How often attention ran (recomputation runs it again), tensors were swapped out and the
    # offloaded optimizer stepped: evidence that a technique was applied at all.
    seen: Counter[str] = Counter()
    from torch._inductor.output_code import CompiledFxGraph

    originals = {
        (Attention, "forward"): Attention.forward,
        (Swapper, "offload"): Swapper.offload,
        (OffloadedOptimizer, "step"): OffloadedOptimizer.step,
        (CompiledFxGraph, "__call__"): CompiledFxGraph.__call__,
    }

    def counted(name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen[name] += 1
            return method(*args, **kwargs)

        return call

    for (cls, name), method in originals.items():
        setattr(cls, name, counted(f"{cls.__name__}.{name}", method))
    # A torch dispatch mode makes dynamo skip every frame: a compiled run is not counted, or it
    # would run eager.
    counting = CountingMode()
    if config.compile:
        torch._dynamo.reset()  # the rank pool outlives a test: no earlier test's graphs
    try:
        if config.compile:
            summary = train(model, parallel, config, RunOptions(folder, quiet=True), runtime)
        else:
            with counting:
                summary = train(model, parallel, config, RunOptions(folder, quiet=True), runtime)
    finally:
        torch.use_deterministic_algorithms(False)
        for (cls, name), method in originals.items():
            setattr(cls, name, method)
        if config.compile:
            _forget_compiled()
    norms: dict[int, float] = {}
    if runtime.rank == 0:
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "grad_norm" in record:
                norms[record["step"]] = record["grad_norm"]
    calls = Counter(c.purpose for c in counting.collectives if c.purpose is not None)
    return {"losses": summary.losses, "norms": norms, "calls": dict(calls), "seen": dict(seen)}


def _forget_compiled() -> None:
    """Drop what dynamo keeps of this run (guards on its modules, its compiled graphs): the
    rank pool outlives the test. Inductor's own pattern tables stay for the process's life."""
    torch._dynamo.reset()
    gc.collect()


def _launch(
    model: ModelConfig, parallel: ParallelConfig, config: TrainConfig, out: Path
) -> list[dict[str, Any]]:
    return run_on_ranks(parallel.world_size, _run, model, parallel, config, str(out), timeout=600)


def _differences(ref: dict[str, Any], got: dict[str, Any]) -> tuple[float, float]:
    loss = max(abs(ref["losses"][s] - got["losses"][s]) for s in ref["losses"])
    norm = abs(ref["norms"][1] - got["norms"][1]) / ref["norms"][1]  # step 1 (1-based)
    return loss, norm


COMPOSITIONS: dict[str, tuple[ModelConfig, ParallelConfig, dict[str, Any]]] = {
    "fsdp2 x cp2 ring": (DENSE, ParallelConfig(dp_shard=2, cp=2), {}),
    "fsdp2 x cp2 ulysses": (DENSE, ParallelConfig(dp_shard=2, cp=2, cp_variant="ulysses"), {}),
    "cp2 x tp2, full ac, accum 2": (
        DENSE,
        ParallelConfig(cp=2, tp=2),
        {"ac": "full", "grad_accum": 2},
    ),
    "fsdp2 x cp2, selective ac, accum 2": (
        DENSE,
        ParallelConfig(dp_shard=2, cp=2),
        {"ac": "selective", "grad_accum": 2},
    ),
    # ep equal to every data-parallel rank: the load-balancing loss is the whole batch's.
    "fsdp4 x ep4 (MoE)": (MOE, ParallelConfig(dp_shard=4, ep=4), {}),
    "hsdp 2x2 x ep2 (MoE), full ac": (
        MOE_NO_AUX,
        ParallelConfig(dp_replicate=2, dp_shard=2, ep=2),
        {"ac": "full"},
    ),
    # The MoE whole on each tp rank (adjoint convention, load-balancing loss seeded once).
    "tp2 (MoE)": (MOE, ParallelConfig(tp=2), {}),
    # Experts whole on each tp rank, or split over it: each MoE in an exact region over tp.
    "fsdp2 x ep2 x tp2 (MoE)": (MOE, ParallelConfig(dp_shard=2, ep=2, tp=2), {}),
    "fsdp2 x ep2 x tp2, ep-tp (MoE)": (
        MOE,
        ParallelConfig(dp_shard=2, ep=2, tp=2, ep_tp=True),
        {},
    ),
    # ep carved from dp_shard x cp: with ep equal to all of it the load-balancing loss is the
    # whole batch's (every rank's columns of every sequence), as on one rank.
    "cp2 x ep2 (MoE)": (MOE, ParallelConfig(cp=2, ep=2), {}),
    "fsdp2 x cp2 x ep4 ulysses (MoE)": (
        MOE,
        ParallelConfig(dp_shard=2, cp=2, ep=4, cp_variant="ulysses"),
        {},
    ),
    "fsdp2 x cp2 x ep2 (MoE)": (MOE_NO_AUX, ParallelConfig(dp_shard=2, cp=2, ep=2), {}),
    "pp2 x tp2, full ac": (DEEP, ParallelConfig(pp=2, tp=2), {"ac": "full", "microbatches": 2}),
    "fsdp4, clip 0.5": (DENSE, ParallelConfig(dp_shard=4), {"clip_grad_norm": 0.5}),
    "fsdp2 x tp2, compile": (DENSE, ParallelConfig(dp_shard=2, tp=2), {"compile": True}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(COMPOSITIONS))
def test_composition_matches_one_rank(case: str, tmp_path: Path) -> None:
    """The composed run's losses and step-0 gradient norm agree with one rank's to fp32
    rounding (clipping is applied on both sides)."""
    model, parallel, extra = COMPOSITIONS[case]
    single = {k: v for k, v in extra.items() if k == "clip_grad_norm"}
    (one,) = _launch(model, ParallelConfig(), _config(**single), tmp_path / "one")
    many = _launch(model, parallel, _config(**extra), tmp_path / "many")
    assert all(r["losses"] == many[0]["losses"] for r in many)
    # Compiled code ran (or the case would compare eager with eager).
    ran_compiled = all(r["seen"].get("CompiledFxGraph.__call__", 0) > 0 for r in many)
    assert ran_compiled == bool(extra.get("compile"))
    loss, norm = _differences(one, many[0])
    print(f"{case}: max |loss - one rank| {loss:.3g}, step-0 grad norm relative {norm:.3g}")
    assert loss <= FP32_LOSS_TOLERANCE
    assert norm <= FP32_NORM_TOLERANCE


@pytest.mark.multiprocess
def test_hsdp_accumulation_all_reduces_once_per_step(tmp_path: Path) -> None:
    """HSDP 2 x 2 with 3 micro-steps: the replicas' all-reduce runs once per optimizer step
    (reduce-scatters every micro-step), and training matches one rank."""
    steps = 4
    config = _config(steps=steps, global_batch=12, grad_accum=3)
    (one,) = _launch(DENSE, ParallelConfig(), _config(steps=steps, global_batch=12), tmp_path / "1")
    four = _launch(DENSE, ParallelConfig(dp_replicate=2, dp_shard=2), config, tmp_path / "four")
    for result in four:
        assert result["calls"]["grad_all_reduce"] == steps, result["calls"]
        assert result["calls"]["grad_reduce_scatter"] == 3 * steps * 3, result["calls"]
    loss, norm = _differences(one, four[0])
    assert loss <= FP32_LOSS_TOLERANCE, loss
    assert norm <= FP32_NORM_TOLERANCE, norm


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "technique",
    [
        {"ac": "full"},
        {"ac": "selective", "swap": True},
        {"swap": True},
        {"ac": "budget:0.01"},
        {"offload": "both"},
    ],
    ids=lambda t: ",".join(f"{k}={v}" for k, v in t.items()),
)
def test_memory_techniques_are_bit_equal(technique: dict[str, Any], tmp_path: Path) -> None:
    """Activation checkpointing, swap and offload change where tensors live, not a bit of the
    training: FSDP 2 x TP 2 with and without them gives equal losses and gradient norms."""
    parallel = ParallelConfig(dp_shard=2, tp=2)
    if technique.get("offload") == "both":
        parallel = ParallelConfig(dp_shard=4)
    plain = _launch(DENSE, parallel, _config(), tmp_path / "plain")
    wrapped = _launch(DENSE, parallel, _config(**technique), tmp_path / "wrapped")
    assert wrapped[0]["losses"] == plain[0]["losses"]
    assert wrapped[0]["norms"] == plain[0]["norms"]
    seen, before = wrapped[0]["seen"], plain[0]["seen"]
    if technique.get("ac", "none") != "none":
        assert seen["Attention.forward"] > before["Attention.forward"], (seen, before)
    if technique.get("swap"):
        assert seen.get("Swapper.offload", 0) > 0, seen
    if technique.get("offload") == "both":
        assert seen.get("OffloadedOptimizer.step", 0) == 6, seen


#: Selective recomputation where a block's forward runs collectives of its own: the expert
#: dispatch's count all-gather (with FSDP prefetches from the nested MoE group that differ
#: between forward and recompute), and tp's in-place sum of a saved matmul output under cp.
SELECTIVE_WITH_COLLECTIVES: dict[str, tuple[ModelConfig, ParallelConfig, dict[str, Any]]] = {
    "fsdp4 x ep4 (MoE), selective": (
        ALL_MOE,
        ParallelConfig(dp_shard=4, ep=4),
        {"ac": "selective"},
    ),
    "fsdp2 x ep2 (MoE), budget": (
        ALL_MOE,
        ParallelConfig(dp_shard=2, ep=2),
        {"ac": "budget:0.01"},
    ),
    "cp2 x tp2, selective": (DENSE, ParallelConfig(cp=2, tp=2), {"ac": "selective"}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(SELECTIVE_WITH_COLLECTIVES))
def test_selective_recompute_with_collectives_is_bit_equal(case: str, tmp_path: Path) -> None:
    """Selective and budget checkpointing of blocks that communicate in forward give the
    losses and gradient norms of the run without checkpointing, bit for bit."""
    model, parallel, technique = SELECTIVE_WITH_COLLECTIVES[case]
    plain = _launch(model, parallel, _config(), tmp_path / "plain")
    wrapped = _launch(model, parallel, _config(**technique), tmp_path / "wrapped")
    assert wrapped[0]["losses"] == plain[0]["losses"]
    assert wrapped[0]["norms"] == plain[0]["norms"]
    seen, before = wrapped[0]["seen"], plain[0]["seen"]
    assert seen["Attention.forward"] > before["Attention.forward"], (seen, before)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("precision", "tolerance"),
    [
        ({"mixed_precision": "bf16", "grad_reduce_dtype": "bf16"}, BF16_CURVE_TOLERANCE),
        ({"fp8": "tensorwise", "fp8_all_gather": True}, FP8_CURVE_TOLERANCE),
    ],
    ids=["bf16", "fp8"],
)
def test_low_precision_follows_fp32_for_100_steps(
    precision: dict[str, Any], tolerance: float, tmp_path: Path
) -> None:
    """bf16 mixed precision (bf16 wire for the gradients too) and FP8 linears with an FP8
    all-gather stay within their bound of the fp32 curve over 100 steps, and differ from it
    (they did run in low precision)."""
    parallel = ParallelConfig(dp_shard=2)
    config = {"steps": 100, "log_every": 100}
    fp32 = _launch(DENSE, parallel, _config(**config), tmp_path / "fp32")
    low = _launch(DENSE, parallel, _config(**config, **precision), tmp_path / "low")
    worst = max(abs(fp32[0]["losses"][s] - low[0]["losses"][s]) for s in range(100))
    print(f"{precision}: max |loss - fp32| over 100 steps {worst:.3g}")
    assert 1e-5 < worst <= tolerance
    first, last = low[0]["losses"][0], low[0]["losses"][99]
    assert last < first - 0.5, (first, last)


# One configuration per refusal that has it (and nothing else refused).
REFUSED: dict[str, tuple[ModelConfig, ParallelConfig, TrainConfig]] = {
    "--ep N>1|a dense model": (DENSE, ParallelConfig(dp_shard=2, ep=2), _config()),
    "--ep N>1|--experts E not divisible by N": (
        MOE,
        ParallelConfig(dp_shard=8, ep=8),
        _config(),
    ),
    "--ep-tp|--ep 1 or --tp 1": (MOE, ParallelConfig(dp_shard=2, ep=2, ep_tp=True), _config()),
    "--ep-tp|--expert-ffn-dim H not divisible by --tp": (
        _moe(0.5, expert_ffn_dim=31),
        ParallelConfig(dp_shard=2, ep=2, tp=2, ep_tp=True),
        _config(),
    ),
    "--cp N>1|--seq-len not divisible by 2N": (
        DENSE,
        ParallelConfig(cp=2),
        _config(seq_len=18),
    ),
    "--cp-variant ulysses|heads per tp rank not divisible by --cp": (
        DENSE,
        ParallelConfig(cp=4, tp=2, cp_variant="ulysses"),
        _config(),
    ),
    "--swap|--ac full": (DENSE, ParallelConfig(), _config(swap=True, ac="full")),
    "--swap|--ac budget:<MiB>": (DENSE, ParallelConfig(), _config(swap=True, ac="budget:8")),
}


def _key(first: str, second: str) -> str:
    return f"{first}|{second}"


def test_every_refusal_is_exercised() -> None:
    assert sorted(REFUSED) == sorted(_key(r.first, r.second) for r in REFUSALS)


@pytest.mark.parametrize("key", list(REFUSED))
def test_refused_pair_names_both_options(key: str) -> None:
    """Each refused configuration fails at start-up with the pair's message, and that is the
    first refusal that applies (no other pair is in the configuration)."""
    model, parallel, config = REFUSED[key]
    refusal = next(r for r in REFUSALS if _key(r.first, r.second) == key)
    assert [r for r in REFUSALS if r.applies(model, parallel, config)] == [refusal]
    with pytest.raises(ConfigError) as raised:
        check_combination(model, parallel, config)
    assert str(raised.value) == refusal.message()
    assert refusal.first in str(raised.value)
    assert refusal.second in str(raised.value)


def test_trainer_checks_combinations_before_any_process_group(tmp_path: Path) -> None:
    """The trainer refuses a pair when it is built, before meshes or groups exist; the
    refusal is the last line of the run's log."""
    from hp_train.runtime import Runtime
    from hp_train.trainer import Trainer

    model, parallel, config = REFUSED["--swap|--ac full"]
    runtime = Runtime(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="--swap"):
        Trainer(model, parallel, config, RunOptions(tmp_path), runtime)
    last = (tmp_path / "logs" / "rank_0.log").read_text().splitlines()[-1]
    assert "run stopped: ConfigError: --swap" in last


def test_readme_table_of_refused_pairs_is_the_code() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert combination_table() in readme


def test_command_line_sets_every_technique() -> None:
    from hp_train.config.cli import parse

    argv = [
        "--cp", "2", "--cp-variant", "ulysses", "--grad-accum", "2", "--clip-grad-norm", "1",
        "--ac", "budget:16", "--offload", "params", "--mixed-precision", "bf16", "--fp8",
        "blockwise", "--fp8-all-gather", "--grad-reduce-dtype", "bf16", "--compile",
    ]  # fmt: skip
    _, parallel, config, _, _ = parse(argv, 4)
    assert (parallel.cp, parallel.cp_variant, parallel.dp_shard) == (2, "ulysses", 2)
    assert config.grad_accum == 2
    assert config.clip_grad_norm == 1.0
    assert config.ac_budget_bytes == 16 * 2**20
    assert config.offload == "params"
    assert (config.mixed_precision, config.fp8, config.grad_reduce_dtype) == (
        "bf16",
        "blockwise",
        "bf16",
    )
    assert config.fp8_all_gather
    assert config.compile
    assert parse(["--experts", "4", "--ep", "2"], 4)[1].ep == 2
    ep_tp = parse(["--experts", "4", "--ep", "2", "--tp", "2", "--ep-tp"], 4)[1]
    assert (ep_tp.ep, ep_tp.tp, ep_tp.ep_tp) == (2, 2, True)


@pytest.mark.parametrize("bad", ["budget", "budget:x", "budget:-1", "partial"])
def test_bad_ac_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="budget:<MiB>"):
        TrainConfig(ac=bad)


# ----------------------------------------------------------------------- kill and resume
RESUME_STEPS, RESUME_EVERY = 8, 2


def _resume_args(kind: str) -> list[str]:
    common = [
        "--steps", str(RESUME_STEPS), "--checkpoint-every", str(RESUME_EVERY), "--data",
        "synthetic", "--global-batch", "4", "--seq-len", "16", "--quiet", "--threads", "1",
        "--optimizer", "adamw",
    ]  # fmt: skip
    if kind == "ep":
        return [*common, "--experts", "4", "--ep", "4"]
    if kind == "ep_cp_pp":
        # EP inside CP inside pipeline stages: ep 2 carved from dp_shard 1 x cp 2.
        pipelined = ["--pp", "2", "--microbatches", "2", "--cp", "2"]
        return [*common, *pipelined, "--experts", "4", "--ep", "2"]
    return [*common, "--dp-shard", "2", "--cp", "2"]


def _train_on_pool_rank(argv: list[str]) -> dict[int, float]:
    from hp_train.config.cli import parse

    runtime = init_runtime("cpu", threads=1)
    model, parallel, config, options, _ = parse(argv, runtime.world_size)
    return train(model, parallel, config, options, runtime).losses


def _logged_losses(out: Path) -> dict[int, float]:
    losses: dict[int, float] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[int(record["step"])] = float(record["loss"])
    return losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["ep", "cp", "ep_cp_pp"])
def test_sigkill_and_resume_is_identical(kind: str, tmp_path: Path) -> None:
    """World 4 with expert parallelism (ep 4), context parallelism (dp 2 x cp 2), or both
    inside pipeline stages (pp 2 x cp 2 x ep 2: EP x PP, CP x PP and EP x CP at once): rank 1 is
    killed with SIGKILL after a checkpoint, the job resumed with ``--resume``; every step's
    loss equals an uninterrupted run's bit for bit."""
    args = _resume_args(kind)
    reference = tmp_path / "reference"
    run_on_ranks(4, _train_on_pool_rank, [*args, "--out", str(reference)], timeout=300)
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "hp_train", *args, "--out", str(killed),
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = killed / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while proc.poll() is None and (
        not metrics.exists() or len(metrics.read_text().splitlines()) < RESUME_EVERY + 1
    ):
        assert time.monotonic() < deadline, "the run did not reach the kill point"
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(int((killed / "pids" / "rank_1.pid").read_text()), signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    run_on_ranks(4, _train_on_pool_rank, [*args, "--out", str(killed), "--resume"], timeout=300)
    got, want = _logged_losses(killed), _logged_losses(reference)
    assert sorted(got) == list(range(1, RESUME_STEPS + 1))  # metrics.jsonl: 1-based
    assert got == want

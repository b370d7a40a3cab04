"""``--compile`` with context parallelism (ring, Ulysses) and expert parallelism, at world 4,
against one eager rank on the same batches, with the compiled graphs counted.

The design under test (``hp_train.parallel.compiled``): each block's attention and
feed-forward forwards are compiled, the exchanges inside them run eager, so a part with ``n``
exchanges is ``n + 1`` graphs and every other shape is fixed by the batch. The counts below
come from the model's structure alone: which parts exist (attention, dense feed-forward, MoE)
and which of them exchange under the layout.

These runs do not go through ``test_compositions._run``: its ``CountingMode`` is a torch
dispatch mode, under which dynamo skips every frame and a "compiled" run is eager.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hp_testing import run_on_ranks
from hp_train.config.schema import ModelConfig, ParallelConfig, TrainConfig
from hp_train.runtime import init_runtime
from hp_train.trainer import RunOptions, train
from test_compositions import (
    DENSE,
    FP32_LOSS_TOLERANCE,
    FP32_NORM_TOLERANCE,
    MOE,
    _config,
    _differences,
    _forget_compiled,
    _launch,
)

STEPS = 3
# Every step is logged (log_every 1), so every step also runs the divergence probe: a
# forward in eval mode without gradients, which dynamo compiles apart from the training one.
GRAD_MODES = 2

#: The functions run eager inside the compiled forwards, one graph break each.
EXCHANGES = ("context_parallel_attention", "exchange_through_experts")


def _compiled_run(
    model: ModelConfig, parallel: ParallelConfig, config: TrainConfig, out: str
) -> dict[str, Any]:
    """Train with dynamo's counters fresh; the global losses, rank 0's gradient norms, the
    graphs dynamo made, its graph breaks by the function they skipped, and how often a
    compiled (inductor) graph ran, forward or backward."""
    from torch._dynamo.utils import counters
    from torch._inductor.output_code import CompiledFxGraph

    # The rank pool outlives a test: start without the code objects an earlier run compiled.
    torch._dynamo.reset()
    counters.clear()
    runtime = init_runtime("cpu", threads=1)
    folder = Path(out) / f"rank{runtime.rank}"
    runs = [0]
    original = CompiledFxGraph.__call__

    def counted(self: CompiledFxGraph, inputs: Any) -> Any:
        runs[0] += 1
        return original(self, inputs)

    CompiledFxGraph.__call__ = counted  # type: ignore[method-assign]
    try:
        summary = train(model, parallel, config, RunOptions(folder, quiet=True), runtime)
    finally:
        CompiledFxGraph.__call__ = original  # type: ignore[method-assign]
        torch.use_deterministic_algorithms(False)
    norms: dict[int, float] = {}
    if runtime.rank == 0:
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "grad_norm" in record:
                norms[record["step"]] = record["grad_norm"]
    breaks = {_skipped(reason): n for reason, n in counters["graph_break"].items()}
    result = {
        "losses": summary.losses,
        "norms": norms,
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": breaks,
        "runs": runs[0],
    }
    _forget_compiled()
    return result


def _skipped(reason: str) -> str:
    """The exchange a graph break skipped, or the whole reason when it is something else."""
    return next((name for name in EXCHANGES if f"function {name} at" in reason), reason)


def _parts(model: ModelConfig, parallel: ParallelConfig) -> dict[str, tuple[int, int]]:
    """Each kind of compiled part: (blocks that have it, exchanges in its forward)."""
    moe_blocks = sum(
        model.moe is not None and model.moe.is_moe_layer(i) for i in range(model.n_layers)
    )
    parts = {
        "attention": (model.n_layers, int(parallel.cp > 1)),
        "dense": (model.n_layers - moe_blocks, 0),
        "moe": (moe_blocks, int(parallel.ep > 1)),
    }
    return {kind: part for kind, part in parts.items() if part[0] > 0}


def _expected_graphs(model: ModelConfig, parallel: ParallelConfig) -> int:
    """Graphs dynamo compiles: ``exchanges + 1`` per kind of part (the blocks share its
    code, and no shape differs between them), once per grad mode."""
    return GRAD_MODES * sum(ex + 1 for _, ex in _parts(model, parallel).values())


def _expected_runs(model: ModelConfig, parallel: ParallelConfig) -> int:
    """Compiled graph calls: every graph of every block runs forward and backward in the
    training step and forward in the probe, each step."""
    per_forward = sum(blocks * (ex + 1) for blocks, ex in _parts(model, parallel).values())
    return STEPS * 3 * per_forward


CASES: dict[str, tuple[ModelConfig, ParallelConfig]] = {
    "fsdp2 x cp2 ring": (DENSE, ParallelConfig(dp_shard=2, cp=2)),
    "fsdp2 x cp2 ulysses": (DENSE, ParallelConfig(dp_shard=2, cp=2, cp_variant="ulysses")),
    "fsdp4 x ep4 (MoE)": (MOE, ParallelConfig(dp_shard=4, ep=4)),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_cp_ep_matches_one_rank(case: str, tmp_path: Path) -> None:
    """Compiled blocks with context- or expert-parallel exchanges: the losses and step-0
    gradient norm of one eager rank, graph breaks only at the exchanges, as many graphs as
    the structure gives, and the compiled graphs run at every step (not a silent eager
    fallback)."""
    model, parallel = CASES[case]
    (one,) = _launch(model, ParallelConfig(), _config(steps=STEPS), tmp_path / "one")
    many = run_on_ranks(
        parallel.world_size,
        _compiled_run,
        model,
        parallel,
        _config(steps=STEPS, compile=True),
        str(tmp_path / "many"),
        timeout=900,
    )
    assert all(r["losses"] == many[0]["losses"] for r in many)
    loss, norm = _differences(one, many[0])
    print(f"{case}: max |loss - one rank| {loss:.3g}, step-0 grad norm relative {norm:.3g}")
    assert loss <= FP32_LOSS_TOLERANCE
    assert norm <= FP32_NORM_TOLERANCE
    exchanging = [kind for kind, (_, ex) in _parts(model, parallel).items() if ex]
    assert exchanging, "the case exchanges nothing"
    for result in many:
        assert set(result["breaks"]) <= set(EXCHANGES), result["breaks"]
        assert result["breaks"], "no exchange ran eager between graphs"
        assert result["graphs"] == _expected_graphs(model, parallel), result
        assert result["runs"] == _expected_runs(model, parallel), result

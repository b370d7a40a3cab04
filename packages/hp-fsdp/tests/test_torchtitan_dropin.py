"""torchtitan 0.3.0 as an acceptance workload: its llama3 ``debugmodel``, trained by its own
``Trainer`` on 2 CPU ranks (gloo), through ``torchtitan_harness``, with torch's FSDP2 and with
hp-fsdp in its place (``torchtitan.distributed.fsdp.fully_shard`` and the ``FSDPModule`` class
its ``isinstance`` checks use, monkeypatched in the worker; torchtitan's files untouched).

Four runs of 20 steps (fp32, fixed seed, fixed data, one thread a rank), each saving a full
checkpoint (model, optimizer, scheduler, data loader) at step 10:

* torch FSDP2, and hp-fsdp (``param_layout="per_param"``: torchtitan initializes, clips and
  checkpoints DTensor parameters): the losses, maximum losses and gradient norms of every step
  equal bit for bit, from torchtitan's own meta-device initialization (``to_empty`` then
  ``init_weights`` on the DTensors);
* hp-fsdp resuming from FSDP2's step-10 checkpoint, and FSDP2 resuming from hp-fsdp's: steps
  11 to 20 equal the uninterrupted runs bit for bit.

torchtitan shards the model as recorded below (the calls a drop-in ``fully_shard`` serves:
a list ``[norm, lm_head]`` among them). Skipped, with the reason, where torchtitan 0.3.0 or
what it imports is not installed (outside CI: the nox sessions install it and set
``HP_REQUIRE_ACCEPTANCE=1``, which turns the skip into an error).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

import torchtitan_harness as harness

_UNAVAILABLE = harness.torchtitan_unavailable_reason()
if _UNAVAILABLE is not None and os.environ.get("HP_REQUIRE_ACCEPTANCE") == "1":
    # CI installs torchtitan (noxfile): there a missing tool is a failure, not a skip.
    raise RuntimeError(f"torchtitan harness: {_UNAVAILABLE}")

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"torchtitan harness: {_UNAVAILABLE}"),
]

STEPS = 20
WORLD = 2
RUN_TIMEOUT_S = 300


RESUME_STEP = 10
HP = {
    "fully_shard_impl": "torchtitan_harness:hp_fully_shard",
    "fsdp_module_impl": "hp_fsdp:FSDPModule",
}
TORCH: dict[str, str] = {}


def _run(impl: dict[str, str], **kwargs: Any) -> dict[str, Any]:
    return harness.launch(WORLD, steps=STEPS, timeout_s=RUN_TIMEOUT_S, **impl, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The torch FSDP2 and hp-fsdp runs, each checkpointed at step 10."""
    out = {}
    for name, impl in (("torch", TORCH), ("hp", HP)):
        folder = tmp_path_factory.mktemp(f"ckpt_{name}")
        out[name] = _run(impl, save_checkpoint_dir=str(folder), checkpoint_interval=RESUME_STEP)
        out[name]["checkpoint"] = str(Path(folder) / f"step-{RESUME_STEP}")
    return out


def _same_steps(a: dict[str, Any], b: dict[str, Any], first_step: int) -> None:
    offset = first_step - 1
    for key in ("loss", "max_loss", "grad_norm"):
        assert a[key] == b[key][offset:], key


def test_hp_fsdp_trains_torchtitan_like_torch_fsdp2(runs: dict[str, dict[str, Any]]) -> None:
    torch_run, hp_run = runs["torch"], runs["hp"]
    assert hp_run["fully_shard_impl"] == HP["fully_shard_impl"]
    assert "torchtitan.distributed.fsdp.FSDPModule" in hp_run["patched"]
    assert hp_run["steps"] == torch_run["steps"] == list(range(1, STEPS + 1))
    _same_steps(hp_run, torch_run, 1)


@pytest.mark.parametrize(("saver", "loader"), [("torch", "hp"), ("hp", "torch")])
def test_each_resumes_from_the_others_checkpoint(
    runs: dict[str, dict[str, Any]], saver: str, loader: str
) -> None:
    resumed = _run(HP if loader == "hp" else TORCH, load_checkpoint_dir=runs[saver]["checkpoint"])
    assert resumed["steps"] == list(range(RESUME_STEP + 1, STEPS + 1))
    _same_steps(resumed, runs[saver], RESUME_STEP + 1)


def test_torch_fsdp2_run_under_torchtitan(runs: dict[str, dict[str, Any]]) -> None:
    first = runs["torch"]

    assert first["steps"] == list(range(1, STEPS + 1))
    assert first["fully_shard_impl"] is None
    assert all(math.isfinite(x) for x in first["loss"] + first["grad_norm"])
    # It trains: 4 batches cycled, so the last cycle's mean loss is well below the first's.
    assert sum(first["loss"][-4:]) / 4 < sum(first["loss"][:4]) / 4 - 0.5

    # How torchtitan (apply_fsdp_to_decoder) shards the debugmodel, keywords included.
    calls = first["fully_shard_calls"]
    assert [(c["modules"], c["list"]) for c in calls] == [
        (["tok_embeddings"], False),
        (["norm", "lm_head"], True),  # one FSDP unit of two modules
        *[([f"layers.{i}"], False) for i in range(harness.DEFAULT_N_LAYERS)],
        (["<root>"], False),
    ]
    reshard = [c["kwargs"].get("reshard_after_forward", "unset") for c in calls]
    assert reshard == [True, False, *[True] * harness.DEFAULT_N_LAYERS, "unset"]
    for call in calls:
        assert call["args"] == []
        assert set(call["kwargs"]) <= {"mesh", "mp_policy", "reshard_after_forward"}
        assert "fsdp=2" in call["kwargs"]["mesh"]["repr"]
        policy = call["kwargs"]["mp_policy"]
        assert policy["type"] == "MixedPrecisionPolicy"
        assert (policy["param_dtype"], policy["reduce_dtype"]) == ("torch.float32",) * 2
        assert policy["cast_forward_inputs"] is False
    assert "torchtitan.distributed.fsdp.fully_shard" in first["patched"]

"""``python -m hp_train --print-plan`` and the ``plan.json`` a run writes.

``--print-plan`` plans the job on a meta-device model in one process (no torchrun, no
process group) and prints its tables; a real run (in the shared rank pool, as
``test_resume.py`` runs the command line's code) checks on every rank that its executors did
what the plan says (``check_applied``) and writes the plan to ``plan.json``. The printed plan
must be the one the run wrote: the rows of the printed table and ``plan_run`` (what
``--print-plan`` prints) are compared with ``plan.json``.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from hp_testing import run_on_ranks
from hp_train.config.cli import main, parse
from hp_train.parallel.job import plan_run
from hp_train.parallel.run_plan import PLAN_FILE
from hp_train.runtime import init_runtime
from hp_train.trainer import train

RUN_ARGS = [
    "--steps", "2", "--data", "synthetic", "--global-batch", "4", "--seq-len", "16",
    "--quiet", "--threads", "1", "--log-every", "1",
]  # fmt: skip
REPLICATED = "dp_replicate: Replicate(), dp_shard: Replicate(), tp: Replicate()"
TP_SHARD0 = "dp_replicate: Replicate(), dp_shard: Replicate(), tp: Shard(0)"
TP_SHARD1 = "dp_replicate: Replicate(), dp_shard: Replicate(), tp: Shard(1)"
# (flags, world size) of the real runs: FSDP x TP (dense and MoE: experts whole on every TP
# rank, routers on AdamW), a pipeline of TP stages, and a pipeline with no TP (the plan of a
# model no TP plan is applied to).
LAYOUTS = [
    (["--dp-shard", "2", "--tp", "2"], 4),
    (["--model", "tiny-moe", "--dp-shard", "2", "--tp", "2"], 4),
    (["--pp", "2", "--tp", "2", "--dp-shard", "1"], 4),
    (["--pp", "2", "--dp-shard", "1"], 2),
    # Expert parallelism (the MoE's own FSDP groups over the ranks holding the same experts),
    # context parallelism (FSDP over dp_shard x cp), HSDP with activation checkpointing, FSDP
    # with its parameters offloaded to the host.
    (["--model", "tiny-moe", "--dp-shard", "2", "--ep", "2"], 2),
    (["--model", "tiny-moe", "--dp-shard", "2", "--ep", "2", "--tp", "2"], 4),
    (["--cp", "2", "--dp-shard", "1", "--ac", "full"], 2),
    (["--dp-replicate", "2", "--dp-shard", "2", "--ac", "selective"], 4),
    (["--dp-shard", "2", "--offload", "params"], 2),
]
IDS = [
    "fsdp2xtp2",
    "moe-fsdp2xtp2",
    "pp2xtp2",
    "pp2",
    "moe-ep2",
    "moe-ep2xtp2",
    "cp2-ac",
    "hsdp2x2-ac",
    "fsdp2-offload",
]


def _tables(text: str) -> list[dict[str, tuple[str, ...]]]:
    """The parameter rows of each plan table in ``text``: fqn -> (global, placements, local,
    grad reduction, flat, optim)."""
    tables: list[dict[str, tuple[str, ...]]] = []
    rows: dict[str, tuple[str, ...]] | None = None
    for line in text.splitlines():
        if line.startswith("parameter "):
            rows = {}
            tables.append(rows)
            continue
        if rows is None or line.startswith("---"):
            continue
        if not line.strip():
            rows = None
            continue
        cells = re.split(r" {2,}", line.strip())
        assert len(cells) == 7, line
        rows[cells[0]] = tuple(cells[1:])
    return tables


def _print_plan(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    assert main(["--print-plan", *flags]) == 0
    out, err = capsys.readouterr()
    assert not err
    return out


def _local_shape(shape: list[int], placements: list[str], mesh_shape: list[int]) -> list[int]:
    """Rank 0's (the first rank's) piece: ``Shard(d)`` cuts dim ``d`` into ``size`` parts."""
    local = list(shape)
    for placement, size in zip(placements, mesh_shape, strict=True):
        match = re.fullmatch(r"Shard\((\d+)\)", placement)
        if match:
            dim = int(match.group(1))
            local[dim] = math.ceil(local[dim] / size)
    return local


def test_print_plan_in_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    """No process group: the header names the world and its axes, and the rows give the
    Megatron placements with rank 0's local shapes and the Muon/AdamW split."""
    out = _print_plan(capsys, "--tp", "2", "--dp-shard", "2")
    assert not dist.is_initialized()
    header = out.splitlines()[0]
    assert header.startswith("hp-train plan: world size 4 = dp_replicate=1 x dp_shard=2 x tp=2")
    assert "optimizer muon" in header
    (rows,) = _tables(out)
    # dim 64, 4 heads, ffn 128, vocab 256 (the tiny preset)
    assert rows["layers.0.attn.q_proj.weight"][:3] == ("64x64", TP_SHARD0, "32x64")
    assert rows["layers.0.attn.o_proj.weight"][:3] == ("64x64", TP_SHARD1, "64x32")
    assert rows["layers.1.ffn.w2.weight"][:3] == ("64x128", TP_SHARD1, "64x64")
    assert rows["output.weight"][:3] == ("256x64", TP_SHARD0, "128x64")
    assert rows["norm.weight"][:4] == ("64", REPLICATED, "64", "avg(dp_shard), sum(tp)")
    assert rows["layers.0.attn.q_proj.weight"][5] == "muon"
    assert rows["tok_embeddings.weight"][5] == "adamw"  # embedding, head and norms: AdamW
    assert rows["output.weight"][5] == "adamw"
    assert rows["layers.0.attn_norm.weight"][5] == "adamw"
    assert "collectives per step:" in out


def test_print_plan_of_a_pipeline_shows_each_stage(capsys: pytest.CaptureFixture[str]) -> None:
    out = _print_plan(capsys, "--pp", "2", "--tp", "2", "--optimizer", "adamw")
    assert "world size 4 = pp=2 x dp_replicate=1 x dp_shard=1 x tp=2" in out.splitlines()[0]
    assert "=== stage 0 of 2: the embedding, block 0; ranks 0..1" in out
    assert "=== stage 1 of 2: block 1, the final norm and the head; ranks 2..3" in out
    first, last = _tables(out)
    assert "tok_embeddings.weight" in first
    assert "output.weight" not in first
    assert next(k for k in first if k.startswith("layers.")).startswith("layers.0.")
    assert "tok_embeddings.weight" not in last
    assert all(not k.startswith("layers.0.") for k in last)
    assert last["layers.1.attn.q_proj.weight"][:3] == ("64x64", TP_SHARD0, "32x64")
    assert last["output.weight"][5] == "adamw"
    assert "local shapes of rank 2" in out


def test_print_plan_rejects_a_model_that_does_not_split(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--print-plan", "--tp", "3"]) == 2
    _, err = capsys.readouterr()
    assert "tp=3 must divide n_heads=4" in err


def test_print_plan_as_a_plain_command(tmp_path: Path) -> None:
    """``python -m hp_train --print-plan --tp 2 --dp-shard 2``: no torchrun, exit 0, nothing
    written."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        [sys.executable, "-m", "hp_train", "--print-plan", "--tp", "2", "--dp-shard", "2"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (rows,) = _tables(done.stdout)
    assert rows["layers.0.attn.q_proj.weight"][:3] == ("64x64", TP_SHARD0, "32x64")
    assert list(tmp_path.iterdir()) == []


def _train_on_pool_rank(argv: list[str]) -> None:
    """What ``torchrun ... -m hp_train *argv`` runs on each rank (see test_resume.py)."""
    runtime = init_runtime("cpu", threads=1)
    model, parallel, config, options, _ = parse(argv, runtime.world_size)
    train(model, parallel, config, options, runtime)


def _param_keys(plan: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (p["fqn"], p["global_shape"], p["placements"], p["optimizer_group"]) for p in plan["params"]
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("flags", "world"), LAYOUTS, ids=IDS)
def test_plan_json_is_the_printed_plan(
    flags: list[str], world: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short real run writes ``plan.json`` beside ``metrics.jsonl`` (rank 0); its plan of
    each stage equals what ``--print-plan`` prints with the same flags, parameter by
    parameter (name, global shape, placements, optimizer group, and rank 0's local shape in
    the table) and as a whole (mesh, boundaries, collectives, FSDP flat slots)."""
    out = tmp_path / "run"
    run_on_ranks(world, _train_on_pool_rank, [*RUN_ARGS, *flags, "--out", str(out)], timeout=300)
    assert (out / "metrics.jsonl").exists()
    written = json.loads((out / PLAN_FILE).read_text())
    model, parallel, config, _, _ = parse([*RUN_ARGS, *flags], world)
    job = json.loads(plan_run(model, parallel, config).to_json())
    assert written == job  # the whole job plan: meshes, FSDP groups of every mesh, schedule
    assert written["dims"]["pp"] == parallel.pp
    stages = [stage["parallel"] for stage in written["stages"]]
    printed = [stage["parallel"] for stage in job["stages"]]
    assert len(stages) == len(printed) == parallel.pp
    for applied, want in zip(stages, printed, strict=True):
        assert applied["params"], "plan.json lists no parameters"
        assert _param_keys(applied) == _param_keys(want)
        assert applied == want  # flat slots too: the dry run plans FSDP as hp-fsdp does
        assert {p["optimizer_group"] for p in applied["params"]} == {"muon", "adamw"}
    # The table --print-plan prints, row by row, against plan.json.
    tables = _tables(_print_plan(capsys, *RUN_ARGS, *flags))
    assert len(tables) == len(stages)
    for rows, applied in zip(tables, stages, strict=True):
        assert list(rows) == [p["fqn"] for p in applied["params"]]
        mesh = applied["mesh"]
        for p in applied["params"]:
            placements = ", ".join(
                f"{axis}: {x}" for axis, x in zip(mesh["axis_names"], p["placements"], strict=True)
            )
            local = _local_shape(p["global_shape"], p["placements"], mesh["shape"])
            assert rows[p["fqn"]][:3] == (
                "x".join(map(str, p["global_shape"])),
                placements,
                "x".join(map(str, local)),
            ), p["fqn"]
            assert rows[p["fqn"]][5] == p["optimizer_group"]
    if parallel.tp > 1:
        q = next(p for p in stages[-1]["params"] if p["fqn"].endswith("attn.q_proj.weight"))
        assert q["placements"] == ["Replicate()", "Replicate()", "Shard(0)"]
    if model.moe is not None:
        router = next(p for p in stages[0]["params"] if ".router." in p["fqn"])
        assert router["optimizer_group"] == "adamw"
        assert router["placements"] == ["Replicate()"] * 3

"""Tests for hp_train.observe.memory_snapshot: live-tensor accounting of real steps against
byte counts worked out by hand, the labelled log line, and the allocator snapshot on CUDA.

The hand oracle (``test_live_tensor_peak_is_the_hand_count``): ``Linear(8, 16, bias=False)``,
fp32, AdamW, batch ``x`` of 256 x 8, the step ``out = model(x); loss = out.view(-1).sum();
backward; optimizer step; zero_grad(set_to_none=False)``, measured at step 2 (AdamW's state
exists, and the gradient is kept, zeroed, from step 1). Sizes: parameters P = 8 * 16 * 4 =
512 B; gradient P; AdamW state = exp_avg P + exp_avg_sq P + its ``step`` counter, a float32
scalar tensor of 4 B; batch X = 256 * 8 * 4 = 8192 B; output A = 256 * 16 * 4 = 16384 B; loss
4 B. The step's peak is right after the sum, while ``out`` (and its views) is still held: P +
P + (2P + 4) + X + A + 4 = 26632 B. Backward holds at most 2P + X + 8 more than the
parameters and state (``out`` is gone, the sum's gradient is a 4 B scalar expanded), and
AdamW at most a few P, both far below. Counting views by tensor instead of by storage would
add A per view of ``out``.
"""

from __future__ import annotations

import json
import pickle
import resource
from pathlib import Path

import pytest
import torch
from torch import nn

from hp_train.config.cli import parse
from hp_train.config.schema import ModelConfig
from hp_train.model.llama import Transformer, lm_loss
from hp_train.observe.memory_snapshot import MemorySnapshot, format_memory

CPU = torch.device("cpu")
P = 8 * 16 * 4
X = 256 * 8 * 4
A = 256 * 16 * 4
LOSS = 4
STEP_COUNTER = 4


def _linear_run(
    tmp_path: Path, steps: tuple[int, ...], n: int = 3
) -> dict[int, dict[str, int] | None]:
    torch.manual_seed(0)
    model = nn.Linear(8, 16, bias=False)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 8)
    snapshot = MemorySnapshot(tmp_path, 0, steps, CPU, model, optimizer)
    figures = {}
    for step in range(1, n + 1):
        snapshot.step_begin(step)
        out = model(x)
        half = out[:, :8]  # another view of the same storage, alive through the peak
        loss = out.view(-1).sum()
        del out, half
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        figures[step] = snapshot.step_end(step)
    snapshot.close()
    return figures


def test_live_tensor_peak_is_the_hand_count(tmp_path: Path) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    figures = _linear_run(tmp_path, (2,))
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert figures[1] is None
    assert figures[3] is None
    got = figures[2]
    assert got is not None
    assert got["live_parameters_bytes"] == P
    assert got["live_gradients_bytes"] == P
    assert got["live_optimizer_state_bytes"] == 2 * P + STEP_COUNTER
    assert got["live_activations_bytes"] == X + A + LOSS
    assert got["live_tensors_peak_bytes"] == P + P + 2 * P + STEP_COUNTER + X + A + LOSS
    # At the start the batch is not yet seen; at the end the loss is still held.
    assert got["live_tensors_start_bytes"] == P + P + 2 * P + STEP_COUNTER
    assert got["live_tensors_end_bytes"] == P + P + 2 * P + STEP_COUNTER + X + LOSS
    # RSS apart, labelled as the process's peak since it started.
    assert rss_before <= got["rss_peak_bytes"] <= rss_after
    assert "process RSS peak since start" in format_memory(got)
    record = json.loads((tmp_path / "memory" / "rank_0_step_2.json").read_text())
    assert record["figures"] == got
    assert record["method"] == "live tensors"
    assert record["largest_storages_at_peak"][0] == {
        "bytes": A,
        "category": "activations",
        "first_seen_after": "aten.mm",
    }
    assert sorted(p.name for p in (tmp_path / "memory").iterdir()) == ["rank_0_step_2.json"]


class _TwoViews(nn.Module):
    """Two parameters over one storage (as a flat buffer holds sharded parameters)."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(16, 16)
        self.a = nn.Parameter(base)
        self.b = nn.Parameter(base.t())  # the same storage, seen transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.a + x @ self.b


def test_shared_storages_count_once(tmp_path: Path) -> None:
    model = _TwoViews()
    assert model.a.untyped_storage().data_ptr() == model.b.untyped_storage().data_ptr()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 16)
    snapshot = MemorySnapshot(tmp_path, 3, (1,), CPU, model, optimizer)
    snapshot.step_begin(1)
    model(x).sum().backward()
    optimizer.step()
    got = snapshot.step_end(1)
    assert got is not None
    assert got["live_parameters_bytes"] == 16 * 16 * 4  # one storage, two parameters
    assert got["live_optimizer_state_bytes"] == 0  # plain SGD keeps none
    assert (tmp_path / "memory" / "rank_3_step_1.json").is_file()


def test_categories_of_a_transformer_step(tmp_path: Path) -> None:
    """hp-train's own model: the split's parameter, gradient and state bytes are the model's
    sizes (buffers with the parameters), and the categories sum to the peak."""
    config = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, config.vocab_size, (2, 16))
    params = list(model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    snapshot = MemorySnapshot(tmp_path, 0, (2,), CPU, model, optimizer)
    got = None
    for step in (1, 2):
        snapshot.step_begin(step)
        lm_loss(model(ids), ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        got = snapshot.step_end(step) or got
    assert got is not None
    assert got["live_parameters_bytes"] == param_bytes + buffer_bytes
    assert got["live_gradients_bytes"] == param_bytes
    assert got["live_optimizer_state_bytes"] == 2 * param_bytes + STEP_COUNTER * len(params)
    kinds = ("parameters", "gradients", "optimizer_state", "activations")
    split = sum(got[f"live_{kind}_bytes"] for kind in kinds)
    assert split == got["live_tensors_peak_bytes"]
    assert got["live_activations_bytes"] > 0


def test_format_memory_line() -> None:
    figures = {
        "live_tensors_peak_bytes": 26632,
        "live_parameters_bytes": 512,
        "live_gradients_bytes": 512,
        "live_optimizer_state_bytes": 1028,
        "live_activations_bytes": 24580,
        "live_tensors_start_bytes": 2052,
        "rss_peak_bytes": 325091328,
    }
    assert format_memory(figures) == (
        "memory: live tensors peak 26.0 KiB (parameters 512 B, gradients 512 B, optimizer state "
        "1.0 KiB, activations and temporaries 24.0 KiB); live tensors at step start 2.0 KiB; "
        "process RSS peak since start 310.0 MiB"
    )
    assert format_memory({"device_allocated_peak_bytes": 3 * 2**30, "other_bytes": 7}) == (
        "memory: device allocated peak 3.0 GiB; other_bytes 7 B"
    )
    with pytest.raises(ValueError, match="no memory figures"):
        format_memory({})
    with pytest.raises(ValueError, match="'rss_peak_bytes' must be an int"):
        format_memory({"rss_peak_bytes": 1.5})  # type: ignore[dict-item]


def test_order_errors_and_close(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    snapshot = MemorySnapshot(tmp_path, 0, (1, 2), CPU, model, torch.optim.SGD(model.parameters()))
    with pytest.raises(RuntimeError, match="without step_begin"):
        snapshot.step_end(1)
    snapshot.step_begin(1)
    with pytest.raises(RuntimeError, match="step 1 is measured"):
        snapshot.step_begin(2)
    snapshot.close()
    assert not (tmp_path / "memory").exists()
    with pytest.raises(RuntimeError, match="closed"):
        snapshot.step_begin(2)
    with pytest.raises(ValueError, match="1-based"):
        MemorySnapshot(tmp_path, 0, (0, 1), CPU, model, torch.optim.SGD(model.parameters()))


def test_cli_flag(tmp_path: Path) -> None:
    *_, run, args = parse(["--out", str(tmp_path), "--memory-snapshot", "3", "--steps", "4"], 1)
    assert run.memory_snapshot_steps == (3,)
    assert args.memory_snapshot == "3"  # kept as text for config.toml


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator snapshot needs CUDA")
def test_cuda_allocator_snapshot(tmp_path: Path) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = nn.Linear(64, 64, bias=False, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(1024, 64, device=device)
    snapshot = MemorySnapshot(tmp_path, 0, (1,), device, model, optimizer)
    assert snapshot.method == "allocator snapshot"
    snapshot.step_begin(1)
    model(x).sum().backward()
    optimizer.step()
    got = snapshot.step_end(1)
    snapshot.close()
    assert got is not None
    # The output (1024 x 64 fp32) was allocated during the step on top of what was there.
    out_bytes = 1024 * 64 * 4
    assert got["device_allocated_peak_bytes"] >= got["device_allocated_start_bytes"] + out_bytes
    with (tmp_path / "memory" / "rank_0_step_1.pickle").open("rb") as f:
        data = pickle.load(f)
    assert data["segments"]
    assert any(trace for trace in data["device_traces"])

"""hp's collectives under torch's ``CommDebugMode``: counted under torch's keys, same results.

While the mode watches, ``hp_dtensor._comm`` issues torch's functional collectives instead of
c10d's in-place ones. Every path is run with and without the mode on the same data (even and
uneven all-gather and reduce-scatter, all-reduce with SUM / AVG / MAX, all-to-all between dims
with uneven splits, all-to-all of rows with a rank sending nothing), and must give bit-equal
results and gradients; under the mode each counts once under its ``c10d_functional`` key. The
oracle for the values is the data itself, assembled by hand (a concatenation, a sum), not
the code under test. World 2.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from hp_dtensor import DeviceMesh, collectives
from hp_layout import Mesh, ReduceOp
from hp_testing import run_on_ranks

WORLD = 2


def _data(rank: int, rows: int, cols: int = 3) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 100 * rank + 0.5


def _calls(mesh: DeviceMesh, rank: int) -> dict[str, Any]:
    """Each collective's result and its input's gradient (for a fixed cotangent)."""
    uneven = (3, 1)  # rank 0 holds 3 rows, rank 1 holds 1
    out: dict[str, Any] = {}

    def run(name: str, x: torch.Tensor, fn: Any) -> None:
        x = x.clone().requires_grad_()
        y = fn(x)
        cotangent = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
        (y * cotangent).sum().backward()
        assert x.grad is not None
        out[name] = (y.detach(), x.grad.clone())

    run("all_gather_even", _data(rank, 2), lambda x: collectives.all_gather(x, 0, mesh, "tp"))
    run(
        "all_gather_uneven",
        _data(rank, uneven[rank]),
        lambda x: collectives.all_gather(x, 0, mesh, "tp", sizes=uneven),
    )
    run(
        "reduce_scatter_uneven",
        _data(rank, 4),
        lambda x: collectives.reduce_scatter(x, 0, mesh, "tp", ReduceOp.SUM, sizes=uneven),
    )
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
        run(
            f"all_reduce_{op.value}",
            _data(rank, 2),
            lambda x, op=op: collectives.all_reduce(x, mesh, "tp", op),
        )
    run(
        "all_to_all_dims",
        _data(rank, 3, 4),
        lambda x: collectives.all_to_all(x, 1, 0, mesh, "tp", (1, 3), (3, 3)),
    )
    send = (2, 0) if rank == 0 else (1, 2)  # rank 0 sends nothing to rank 1
    recv = (2, 1) if rank == 0 else (0, 2)
    run(
        "all_to_all_rows",
        _data(rank, sum(send)),
        lambda x: collectives.all_to_all_rows(x, mesh, "tp", send, recv),
    )
    return out


def _both() -> dict[str, Any]:
    mesh = DeviceMesh("cpu", Mesh((WORLD,), ("tp",)))
    rank = dist.get_rank()
    plain = _calls(mesh, rank)
    mode = CommDebugMode()
    with mode:
        watched = _calls(mesh, rank)
    counts = {str(op): n for op, n in mode.get_comm_counts().items() if n}
    wholes = {r: _data(r, 2) for r in range(WORLD)}
    return {"plain": plain, "watched": watched, "counts": counts, "wholes": wholes}


def test_collectives_counted_under_torchs_keys_with_equal_results() -> None:
    for got in run_on_ranks(WORLD, _both, timeout=60):
        for name, (value, grad) in got["plain"].items():
            w_value, w_grad = got["watched"][name]
            assert torch.equal(value, w_value), name
            assert torch.equal(grad, w_grad), name
        # Oracles by hand for two of them.
        whole = torch.cat([got["wholes"][r] for r in range(WORLD)])
        assert torch.equal(got["plain"]["all_gather_even"][0], whole)
        assert torch.equal(got["plain"]["all_reduce_sum"][0], sum(got["wholes"].values()))
        counts = got["counts"]
        # Forward and backward of each call: all-gather <-> reduce-scatter, all-reduce <->
        # all-reduce (MAX also counts the ranks holding the extreme), all-to-all both ways.
        # Nothing under c10d's own keys: every collective is counted once, under torch's.
        assert counts == {
            "c10d_functional.all_gather_into_tensor": 3,  # 2 gathers + 1 adjoint
            "c10d_functional.reduce_scatter_tensor": 3,  # 1 + 2 adjoints
            "c10d_functional.all_reduce": 7,  # SUM, AVG: 2 each; MAX: 1 + 1 + the tie count
            "c10d_functional.all_to_all_single": 4,
        }

"""Production mode's vocabulary-parallel embedding (``RowwiseParallel`` on an ``nn.Embedding``)
against ``F.embedding`` of the whole table on one device: ``padding_idx`` in each rank's piece of
the vocabulary and outside every piece, a vocabulary that does not divide by the ranks, ids at
both ends of every piece; output and weight gradient within fp32 rounding (exact: each output row
is one rank's row, the others add zeros), the padding row's gradient zero. The options a shard
cannot honour are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hp_dtensor import DeviceMesh
from hp_dtensor.parallel import ColwiseParallel, PlanError, RowwiseParallel, parallelize_module
from hp_dtensor.parallel.equivalence import full_value
from hp_layout import Mesh
from hp_testing import run_on_ranks

VOCAB, DIM = 11, 6  # 11 rows over 2 ranks: 6 and 5; over 4: 3, 3, 3, 2


def _case(padding_idx: int | None) -> tuple[float, float, float]:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", Mesh((world,), ("tp",)))
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, DIM)
    # Every id, the ends of each rank's piece among them, the padding id several times.
    ids = torch.tensor([[0, 5, 6, 10, 3], [2, 8, 9, 1, 4], [7, 0, 10, 5, 6]])
    if padding_idx is not None:
        ids[1, 2] = ids[2, 4] = padding_idx
    upstream = torch.randn(*ids.shape, DIM, generator=torch.Generator().manual_seed(1))

    whole = weight.clone().requires_grad_()
    expected = F.embedding(ids, whole, padding_idx=padding_idx)
    (expected * upstream).sum().backward()
    assert whole.grad is not None

    embedding = nn.Embedding(VOCAB, DIM, padding_idx=padding_idx)
    with torch.no_grad():
        embedding.weight.copy_(weight)
    parallelize_module(embedding, mesh, {"": RowwiseParallel()})
    out = embedding(ids)
    (out * upstream).sum().backward()
    grad = embedding.weight.grad
    assert grad is not None
    got = full_value(grad, mesh, like=embedding.weight)
    output_error = (out.detach() - expected.detach()).abs().max().item()
    grad_error = (got - whole.grad).abs().max().item()
    padding_grad = 0.0 if padding_idx is None else got[padding_idx].abs().max().item()
    return output_error, grad_error, padding_grad


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("padding_idx", [None, 0, 5, 6, 10], ids=lambda p: f"padding={p}")
def test_vocab_parallel_embedding_equals_the_whole_table(
    world: int, padding_idx: int | None
) -> None:
    for output_error, grad_error, padding_grad in run_on_ranks(
        world, _case, padding_idx, timeout=120
    ):
        # Each output row is one rank's row plus zeros, each gradient row one rank's sum of
        # upstream rows in the same order as on one device: equal, not merely close.
        assert output_error == 0.0
        assert grad_error == 0.0
        assert padding_grad == 0.0


@pytest.mark.parametrize(
    ("options", "style", "refused"),
    [
        ({"max_norm": 1.0}, RowwiseParallel(), "max_norm"),
        ({"scale_grad_by_freq": True}, RowwiseParallel(), "scale_grad_by_freq"),
        ({"sparse": True}, RowwiseParallel(), "sparse"),
        ({"max_norm": 1.0}, ColwiseParallel(), "max_norm"),
    ],
)
def test_options_a_shard_cannot_honour_are_refused(
    options: dict[str, object], style: RowwiseParallel | ColwiseParallel, refused: str
) -> None:
    from hp_dtensor.parallel import resolve

    with torch.device("meta"):
        embedding = nn.Embedding(VOCAB, DIM, **options)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=f"embedding '': its {refused} option"):
        resolve(embedding, Mesh((2,), ("tp",)), {"": style})

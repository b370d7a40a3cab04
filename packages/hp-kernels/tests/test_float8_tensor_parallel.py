"""A column- or row-parallel ``Float8Linear`` (``set_tensor_parallel``) quantizes its pieces
exactly as one rank quantizes the whole, forward and backward, at world 2 (gloo).

Oracles: the whole tensor quantized by ``quantize_tensorwise`` / ``quantize_blockwise_2d`` and
sliced (the split quantizers must give those bits), and a one-rank ``Float8Linear`` on the
whole weight (the split product and gradients must agree with it to fp32 rounding of sums).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hp_kernels.float8 import (
    Float8Format,
    Float8Linear,
    Float8LinearConfig,
    ScalingGranularity,
    TensorParallelSplit,
    dequantize_operand,
    quantize_blockwise_2d,
    quantize_tensorwise,
)
from hp_kernels.float8.tensor_parallel import quantize_split_blockwise, quantize_split_tensorwise
from hp_testing import run_on_ranks

TENSORWISE = Float8LinearConfig()
BLOCKWISE = Float8LinearConfig(granularity=ScalingGranularity.BLOCKWISE, block_size=16)
# Measured (torch 2.13, x86 CPU): the weight gradients (a contraction over tokens, which no
# split shortens) are bit-equal to one rank's, and so is the row-parallel input gradient; the
# others differ by fp32 rounding only (sums over ranks, or the BLAS blocking of a narrower
# matmul), at most 2.9e-7 relative to the largest entry. A piece quantized with its own scales
# instead differs by ~1e-2.
REL_TOLERANCE = 1e-6


def _whole(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _max_over_world(t: torch.Tensor) -> None:
    """The amax reduction a tensor-parallel executor hands a split linear (here unwatched)."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX)


def _bounds(extent: int, cut: int) -> tuple[tuple[int, int], ...]:
    return ((0, cut), (cut, extent))


def _quantizer_body(cut: int, dim: int, block: tuple[int, int]) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    whole = _whole(0, 40, 72)
    # A large value in one rank's piece of a straddling block: the other rank must see it.
    whole[3, cut - 1 if dim == 1 else 5] = 300.0
    if dim == 0:
        whole[cut - 1, 7] = -300.0
    split = TensorParallelSplit(None, dim, _bounds(whole.shape[dim], cut), rank, _max_over_world)
    start, stop = split.bounds[rank]
    piece = whole.narrow(dim, start, stop - start).clone()
    fmt = Float8Format.E4M3
    data, scales, shape = quantize_split_blockwise(piece, fmt, block, dim, split)
    ref_data, ref_scales = quantize_blockwise_2d(whole, fmt, block)
    ref = dequantize_operand(ref_data, ref_scales, block).narrow(dim, start, stop - start)
    got = dequantize_operand(data, scales, shape)
    assert torch.equal(got, ref), float((got - ref).abs().max())
    t_data, t_scale = quantize_split_tensorwise(piece, fmt, split)
    w_data, w_scale = quantize_tensorwise(whole, fmt)
    assert torch.equal(t_scale, w_scale)
    want = w_data.float().narrow(dim, start, stop - start)
    assert torch.equal(t_data.float(), want)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("cut", "dim", "block"),
    [(20, 0, (16, 16)), (32, 0, (16, 16)), (36, 1, (16, 16)), (24, 1, (1, 16)), (40, 1, (1, 16))],
    ids=["rows-straddle", "rows-on-edges", "cols-straddle", "act-straddle", "act-on-edges"],
)
def test_split_quantizers_give_the_whole_tensors_bits(
    cut: int, dim: int, block: tuple[int, int]
) -> None:
    run_on_ranks(2, _quantizer_body, cut, dim, block, timeout=120)


def _linear_body(config: Float8LinearConfig, dim: int, cut: int, bias: bool) -> dict[str, float]:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out_f, in_f = 40, 72
    ref = Float8Linear.from_float(nn.Linear(in_f, out_f, bias=bias), config)
    with torch.no_grad():
        ref.weight.copy_(_whole(1, out_f, in_f))
        if bias:
            assert ref.bias is not None
            ref.bias.copy_(_whole(2, out_f))
    x = _whole(3, 4, 9, in_f).requires_grad_(True)
    g = _whole(4, 4, 9, out_f) * 1e-3
    (ref(x) * g).sum().backward()
    bounds = _bounds(out_f if dim == 0 else in_f, cut)
    start, stop = bounds[rank]
    lin = Float8Linear(in_f, out_f, bias=bias, config=config)
    with torch.no_grad():
        lin.weight = nn.Parameter(ref.weight.detach().narrow(dim, start, stop - start).clone())
        if bias:
            assert ref.bias is not None
            piece = ref.bias.detach()
            lin.bias = nn.Parameter(piece[start:stop].clone() if dim == 0 else piece.clone())
    lin.set_tensor_parallel(None, dim, bounds, rank, _max_over_world)
    errors: dict[str, float] = {}

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        errors[name] = float((got - want).abs().max() / want.abs().max())

    if dim == 0:  # column-parallel: whole input, output and grad_output pieces
        xs = x.detach().clone().requires_grad_(True)
        y = lin(xs)
        (y * g[..., start:stop]).sum().backward()
        grad_x = xs.grad
        assert grad_x is not None
        dist.all_reduce(grad_x)
        check("y", y.detach(), ref(x).detach()[..., start:stop])
        check("grad_x", grad_x, x.grad)  # type: ignore[arg-type]
        check("grad_w", lin.weight.grad, ref.weight.grad[start:stop])  # type: ignore[arg-type, index]
    else:  # row-parallel: input pieces, partial output summed, whole grad_output
        xs = x.detach()[..., start:stop].clone().requires_grad_(True)
        b = lin.bias if rank == 0 or lin.bias is None else lin.bias * 0.0
        y = lin.linear_with_bias(xs, b)
        (y * g).sum().backward()
        y_sum = y.detach().clone()
        dist.all_reduce(y_sum)
        check("y", y_sum, ref(x).detach())
        check("grad_x", xs.grad, x.grad[..., start:stop])  # type: ignore[arg-type, index]
        check("grad_w", lin.weight.grad, ref.weight.grad[:, start:stop])  # type: ignore[arg-type, index]
    return errors


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", [TENSORWISE, BLOCKWISE], ids=["tensorwise", "blockwise"])
@pytest.mark.parametrize(
    ("dim", "cut"),
    [(0, 20), (0, 32), (1, 36), (1, 32)],
    ids=["col-straddle", "col-on-edges", "row-straddle", "row-on-edges"],
)
def test_split_linear_matches_one_rank(config: Float8LinearConfig, dim: int, cut: int) -> None:
    """Forward output, input and weight gradients of the pieces equal one rank's pieces."""
    results: list[Any] = run_on_ranks(2, _linear_body, config, dim, cut, True, timeout=120)
    worst = max(e for r in results for e in r.values())
    print(f"dim={dim} cut={cut}: worst relative difference {worst:.3g}")
    assert worst <= REL_TOLERANCE, results
    assert all(r["grad_w"] == 0.0 for r in results), results
    if dim == 1:
        assert all(r["grad_x"] == 0.0 for r in results), results


def test_set_tensor_parallel_refuses_bad_splits() -> None:
    lin = Float8Linear(8, 6, config=TENSORWISE)
    with pytest.raises(ValueError, match="dim must be 0"):
        lin.set_tensor_parallel(None, 2, ((0, 3), (3, 6)), 0, _max_over_world)
    with pytest.raises(ValueError, match="not contiguous"):
        lin.set_tensor_parallel(None, 0, ((0, 3), (4, 6)), 0, _max_over_world)
    with pytest.raises(ValueError, match="cover 7 features along dim 1, the linear has 8"):
        lin.set_tensor_parallel(None, 1, ((0, 3), (3, 7)), 0, _max_over_world)
    with pytest.raises(ValueError, match="outside bounds"):
        lin.set_tensor_parallel(None, 0, ((0, 3), (3, 6)), 2, _max_over_world)
    lin.set_tensor_parallel(
        None, 0, ((0, 3), (3, 6)), 0, _max_over_world
    )  # the weight is still whole (6x8)
    with pytest.raises(ValueError, match=r"gave this rank the piece \(0, 3\) of dim 0"):
        lin(torch.randn(2, 8))


def _compiled_body() -> float:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    lin = Float8Linear(16, 8, bias=False, config=TENSORWISE)
    with torch.no_grad():
        lin.weight = nn.Parameter(_whole(1, 8, 16)[:, rank * 8 : rank * 8 + 8].clone())
    lin.set_tensor_parallel(None, 1, ((0, 8), (8, 16)), rank, _max_over_world)
    x = _whole(3, 5, 16)[:, rank * 8 : rank * 8 + 8].clone().requires_grad_(True)
    eager = lin(x)
    compiled = torch.compile(lambda t: lin(t).relu(), backend="aot_eager")(x)
    compiled.sum().backward()
    return float((compiled - eager.relu()).abs().max())


@pytest.mark.multiprocess
def test_split_linear_compiles() -> None:
    """Under torch.compile (the trainer's --compile) the amax all-reduce and the split
    quantization trace, and give the eager values."""
    assert run_on_ranks(2, _compiled_body, timeout=300) == [0.0, 0.0]

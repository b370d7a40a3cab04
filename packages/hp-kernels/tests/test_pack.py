"""pack/unpack: every backend bit-equal to the reference; checks, fake tensors, opcheck."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import hp_kernels
from _util import bit_equal, bits
from hp_kernels import reference
from hp_kernels._extension import load_cpu_extension

needs_ext = pytest.mark.skipif(
    load_cpu_extension() is not None, reason=f"CPU extension not loaded: {load_cpu_extension()}"
)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _values(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values with the cases casts get wrong: ties, huge, tiny, zeros of both signs, inf."""
    x = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 30, (n,), generator=gen))
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), 1.0 + 2**-8, 1.0 + 3 * 2**-8, 65504.0, 7e4, 1e-8]
    )
    k = min(n, specials.numel())
    x[:k] = specials[:k]
    if dtype.is_floating_point:
        return x.to(dtype)
    return (x * 100).clamp(-1e6, 1e6).to(dtype)


def _bucket(
    sizes: list[tuple[int, ...]], dtypes: list[torch.dtype], seed: int
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, dtype in zip(sizes, dtypes, strict=True):
        n = 1
        for s in shape:
            n *= s
        out.append(_values(n, dtype, gen).view(shape))
    return out


SHAPES = [(3, 5), (0,), (1,), (70001,), (33, 1000), (0, 7), (2, 3, 4), (40000,)]


def _both(
    tensors: list[torch.Tensor], out_dtype: torch.dtype, offsets: list[int], size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    got = torch.full((size,), 7, dtype=out_dtype)
    want = got.clone()
    hp_kernels.pack(tensors, got, offsets)
    reference.pack(tensors, want, offsets)
    return got, want


@pytest.mark.parametrize("out_dtype", FLOATS)
@pytest.mark.parametrize("in_dtype", FLOATS)
def test_pack_unpack_bit_equal_to_reference(in_dtype: torch.dtype, out_dtype: torch.dtype) -> None:
    tensors = _bucket(SHAPES, [in_dtype] * len(SHAPES), seed=1)
    offsets, size = hp_kernels.offsets_of(tensors, align=3)  # uneven starts, gaps between
    got, want = _both(tensors, out_dtype, offsets, size + 5)
    assert bit_equal(got, want)
    outs = [torch.empty_like(t) for t in tensors]
    refs = [torch.empty_like(t) for t in tensors]
    hp_kernels.unpack(got, offsets, outs)
    reference.unpack(want, offsets, refs)
    for o, r in zip(outs, refs, strict=True):
        assert bit_equal(o, r)


def test_mixed_input_dtypes_and_random_sizes() -> None:
    gen = torch.Generator().manual_seed(5)
    for trial in range(5):
        count = int(torch.randint(1, 40, (), generator=gen))
        sizes: list[tuple[int, ...]] = [
            (int(torch.randint(0, 50000, (), generator=gen)),) for _ in range(count)
        ]
        dtypes = [FLOATS[int(torch.randint(0, 3, (), generator=gen))] for _ in range(count)]
        tensors = _bucket(sizes, dtypes, seed=trial)
        offsets, size = hp_kernels.offsets_of(tensors)
        for out_dtype in (torch.float32, torch.bfloat16):
            got, want = _both(tensors, out_dtype, offsets, size)
            assert bit_equal(got, want)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool, torch.float32]
)
def test_same_dtype_copies_of_other_dtypes(dtype: torch.dtype) -> None:
    tensors = _bucket([(100,), (0,), (3, 33)], [dtype] * 3, seed=2)
    offsets, size = hp_kernels.offsets_of(tensors)
    got, want = _both(tensors, dtype, offsets, size)
    assert bit_equal(got, want)


def test_other_casts_go_through_copy() -> None:
    # fp64 -> bf16 and int -> fp32 are outside the extension's fast pairs: same bits anyway.
    tensors = [torch.randn(1000, dtype=torch.float64), torch.arange(77, dtype=torch.int32)]
    offsets, size = hp_kernels.offsets_of(tensors)
    for out_dtype in (torch.bfloat16, torch.float32):
        got, want = _both(tensors, out_dtype, offsets, size)
        assert bit_equal(got, want)


def test_non_contiguous_inputs_and_outputs() -> None:
    base = torch.randn(300, 200)
    tensors = [base.t(), base[::2, 1:], torch.randn(10, 10).bfloat16().t()]
    offsets, size = hp_kernels.offsets_of(tensors)
    got, want = _both(tensors, torch.bfloat16, offsets, size)
    assert bit_equal(got, want)
    outs = [torch.empty(200, 300).t(), torch.empty(150, 398)[:, ::2], torch.empty(10, 10).t()]
    refs = [torch.empty(200, 300).t(), torch.empty(150, 398)[:, ::2], torch.empty(10, 10).t()]
    hp_kernels.unpack(got, offsets, outs)
    reference.unpack(want, offsets, refs)
    for o, r in zip(outs, refs, strict=True):
        assert bit_equal(o, r)


def test_nan_stays_nan() -> None:
    t = torch.tensor([float("nan"), 1.0, -float("nan")] * 40000)
    out = hp_kernels.pack([t], torch.empty(t.numel(), dtype=torch.bfloat16), [0])
    assert torch.equal(out.isnan(), t.isnan())
    assert torch.equal(bits(out[1::3]), bits(t[1::3].bfloat16()))


def test_empty_bucket_and_gaps_untouched() -> None:
    out = torch.full((10,), 3.0)
    hp_kernels.pack([], out, [])
    hp_kernels.pack([torch.ones(2), torch.ones(0)], out, [4, 10])
    assert out.tolist() == [3.0] * 4 + [1.0, 1.0] + [3.0] * 4
    hp_kernels.unpack(out, [], [])


def test_threads_do_not_change_the_result() -> None:
    tensors = _bucket([(300001,), (5,), (70000,)], [torch.float32] * 3, seed=9)
    offsets, size = hp_kernels.offsets_of(tensors)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.empty(size, dtype=torch.bfloat16)
            hp_kernels.pack(tensors, out, offsets)
            results.append(out)
    finally:
        torch.set_num_threads(before)
    assert bit_equal(results[0], results[1])


@pytest.mark.parametrize(
    ("tensors", "size", "offsets", "match"),
    [
        ([torch.ones(3)], 10, [0, 3], r"1 tensors but 2 offsets; give one offset per tensor"),
        (
            [torch.ones(3)],
            10,
            [8],
            r"tensors\[0\] \(3 elements\) at offset 8 does not fit.*\[0, 7\]",
        ),
        ([torch.ones(3)], 10, [-1], r"at offset -1 does not fit"),
        ([torch.ones(11)], 10, [0], r"tensors\[0\] has 11 elements, more than out"),
        (
            [torch.ones(3), torch.ones(3)],
            10,
            [0, 2],
            r"tensors\[0\] and tensors\[1\] overlap in out \(elements \[2, 3\)",
        ),
    ],
)
def test_pack_errors_name_the_problem(
    tensors: list[torch.Tensor], size: int, offsets: list[int], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        hp_kernels.pack(tensors, torch.empty(size), offsets)


def test_unpack_and_buffer_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"outs\[1\] \(4 elements\) at offset 8 does not fit"):
        hp_kernels.unpack(torch.empty(10), [0, 8], [torch.empty(2), torch.empty(4)])
    with pytest.raises(
        ValueError, match=r"out must be a contiguous 1-D buffer, got shape \(2, 5\)"
    ):
        hp_kernels.pack([torch.ones(2)], torch.empty(2, 5), [0])
    with pytest.raises(ValueError, match="contiguous 1-D"):
        hp_kernels.pack([torch.ones(2)], torch.empty(20)[::2], [0])
    with pytest.raises(ValueError, match="align must be a positive"):
        hp_kernels.offsets_of([], align=0)


def test_fake_tensors_and_meta() -> None:
    with FakeTensorMode():
        tensors = [torch.empty(3, 4), torch.empty(5, dtype=torch.bfloat16)]
        out = torch.empty(20, dtype=torch.bfloat16)
        hp_kernels.pack(tensors, out, [0, 12])
        hp_kernels.unpack(out, [0, 12], tensors)
        with pytest.raises(ValueError, match="overlap"):
            hp_kernels.pack(tensors, out, [0, 11])
    meta = torch.empty(20, device="meta")
    hp_kernels.pack([torch.empty(4, device="meta")], meta, [0])


def test_opcheck() -> None:
    tensors = [torch.randn(3, 4), torch.randn(5).bfloat16()]
    out = torch.zeros(20, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.hp_kernels.pack.default, (tensors, out, [0, 12]))
    outs = [torch.empty(3, 4), torch.empty(5)]
    torch.library.opcheck(torch.ops.hp_kernels.unpack.default, (out, [0, 12], outs))


def test_traces_under_torch_compile_free_make_fx() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = torch.empty(a.numel() + b.numel(), dtype=torch.bfloat16)
        return hp_kernels.pack([a, b], out, [0, a.numel()])

    graph = make_fx(f, tracing_mode="fake")(torch.randn(3, 4), torch.randn(5))
    assert "hp_kernels.pack" in str(graph.code)


@needs_ext
def test_extension_kernel_is_what_runs_on_cpu() -> None:
    t = torch.randn(1000)
    out = torch.empty(1000, dtype=torch.bfloat16)
    torch.ops.hp_kernels_cpu.pack([t], out, [0])
    assert bit_equal(out, t.bfloat16())

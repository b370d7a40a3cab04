"""``hp_kernels.precision``: the bf16-matmul capability check, its override and its warning."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hp_kernels import precision


def _ask(env_value: str | None, expression: str) -> subprocess.CompletedProcess[str]:
    """Evaluate ``expression`` in a fresh process (the answer is cached per process)."""
    import os

    env = dict(os.environ)
    env.pop(precision.ENV_VARIABLE, None)
    if env_value is not None:
        env[precision.ENV_VARIABLE] = env_value
    code = f"import torch; from hp_kernels import precision as p; print({expression})"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    ("value", "slow", "dtype"), [("slow", True, "float32"), ("fast", False, "bfloat16")]
)
def test_the_override_decides(value: str, slow: bool, dtype: str) -> None:
    out = _ask(value, "p.bf16_matmul_is_slow('cpu'), p.newton_schulz_dtype('cpu')")
    assert out.stdout.strip() == f"{slow} torch.{dtype}", out.stderr


def test_a_bad_override_is_named() -> None:
    out = _ask("maybe", "p.bf16_matmul_is_slow('cpu')")
    assert out.returncode != 0
    assert "HP_KERNELS_BF16_MATMUL='maybe': use 'fast' or 'slow'" in out.stderr


X86_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma\n"
X86_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
X86_AMX = "flags\t\t: avx2 avx512f amx_bf16 amx_tile\n"
X86_AVX512_ONLY = "flags\t\t: avx2 avx512f avx512bw avx512_vnni\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
ARM_NONE = "processor\t: 0\nFeatures\t: fp asimd crc32\n"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        (X86_AVX2, False),
        (X86_BF16, True),
        (X86_AMX, True),
        (X86_AVX512_ONLY, False),  # AVX-512 emulates bf16: about 2x fp32, a timing's borderline
        (ARM_BF16, True),
        (ARM_NONE, False),
        ("processor\t: 0\nmodel name\t: unknown\n", None),  # no feature line: no verdict
        (None, None),  # no /proc/cpuinfo
    ],
)
def test_the_cpu_flags_decide(cpuinfo: str | None, native: bool | None) -> None:
    assert precision.native_bf16_from_cpuinfo(cpuinfo) is native


def test_every_process_of_a_machine_decides_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    # Where the flags decide, the calibration never runs (a timing near the threshold decided
    # differently in two processes of one CI machine: a run and its resumption orthonormalized
    # in different dtypes).
    def no_timing() -> bool:
        raise AssertionError("the calibration ran although the CPU flags decide")

    monkeypatch.delenv(precision.ENV_VARIABLE, raising=False)
    monkeypatch.setattr(precision, "_calibrated_bf16_is_slow", no_timing)
    for cpuinfo, slow in [(X86_AVX512_ONLY, True), (X86_BF16, False), (ARM_NONE, True)]:
        monkeypatch.setattr(precision, "_read_cpuinfo", lambda text=cpuinfo: text)
        precision.bf16_matmul_is_slow.cache_clear()
        try:
            assert precision.bf16_matmul_is_slow("cpu") is slow
        finally:
            precision.bf16_matmul_is_slow.cache_clear()


def test_without_flags_the_calibration_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(precision.ENV_VARIABLE, raising=False)
    monkeypatch.setattr(precision, "_read_cpuinfo", lambda: None)
    for verdict in (True, False):
        monkeypatch.setattr(precision, "_calibrated_bf16_is_slow", lambda v=verdict: v)
        precision.bf16_matmul_is_slow.cache_clear()
        try:
            assert precision.bf16_matmul_is_slow("cpu") is verdict
        finally:
            precision.bf16_matmul_is_slow.cache_clear()


def test_this_machine_follows_its_flags() -> None:
    native = precision.native_bf16_from_cpuinfo(precision._read_cpuinfo())
    if native is None:
        pytest.skip("no CPU feature flags on this machine")
    assert _ask(None, "p.bf16_matmul_is_slow('cpu')").stdout.strip() == str(not native)


def test_the_calibration_agrees_with_a_direct_timing() -> None:
    verdict = precision._calibrated_bf16_is_slow()
    assert isinstance(verdict, bool)
    ratio = precision._best_time(torch.bfloat16) / precision._best_time(torch.float32)
    if ratio > 4 * precision.SLOW_RATIO or ratio < precision.SLOW_RATIO / 4:
        assert verdict == (ratio > precision.SLOW_RATIO), ratio  # clearly one side


def test_the_warning_comes_once_where_bf16_is_slow() -> None:
    out = _ask(
        "slow",
        "p.warn_if_bf16_is_slow('cpu', 'X'), p.warn_if_bf16_is_slow('cpu', 'X')",
    )
    assert out.stdout.strip() == "True True"  # cached: the second call does not warn again
    assert out.stderr.count("X asks for bf16 compute") == 1
    assert _ask("fast", "p.warn_if_bf16_is_slow('cpu', 'X')").stdout.strip() == "False"


def test_the_calibration_runs_on_one_thread_whatever_the_process_uses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Both timings run on one thread, and the process keeps its own thread count after.
    seen: list[int] = []

    def timed(dtype: torch.dtype) -> float:
        seen.append(torch.get_num_threads())
        return 1.0 if dtype == torch.float32 else 3.0

    monkeypatch.setattr(precision, "_best_time", timed)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert precision._calibrated_bf16_is_slow() is True  # 3x > SLOW_RATIO
        assert seen == [1, 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

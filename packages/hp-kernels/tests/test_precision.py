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


def test_the_calibration_agrees_with_a_direct_timing() -> None:
    # Without the override: a boolean, the same on every call (cached).
    first = precision.bf16_matmul_is_slow("cpu")
    assert first is precision.bf16_matmul_is_slow("cpu")
    ratio = precision._best_time(torch.bfloat16) / precision._best_time(torch.float32)
    if ratio > 4 * precision.SLOW_RATIO or ratio < precision.SLOW_RATIO / 4:
        assert first == (ratio > precision.SLOW_RATIO), ratio  # clearly one side


def test_the_warning_comes_once_where_bf16_is_slow() -> None:
    out = _ask(
        "slow",
        "p.warn_if_bf16_is_slow('cpu', 'X'), p.warn_if_bf16_is_slow('cpu', 'X')",
    )
    assert out.stdout.strip() == "True True"  # cached: the second call does not warn again
    assert out.stderr.count("X asks for bf16 compute") == 1
    assert _ask("fast", "p.warn_if_bf16_is_slow('cpu', 'X')").stdout.strip() == "False"


def test_the_calibration_runs_on_one_thread_whatever_the_process_uses() -> None:
    # A fresh process on every thread of the machine (at least 2): the verdict equals that of
    # a process on one thread, and the process keeps its thread count.
    expression = "torch.set_num_threads(max(2, torch.get_num_threads())) or "
    expression += "(p.bf16_matmul_is_slow('cpu'), torch.get_num_threads())"
    many = _ask(None, expression)
    one = _ask(None, "torch.set_num_threads(1) or p.bf16_matmul_is_slow('cpu')")
    verdict, threads = many.stdout.strip().strip("()").split(", ")
    assert verdict == one.stdout.strip(), (many.stderr, one.stderr)
    assert int(threads) >= 2

"""Device types: the backend table, and a device this machine lacks refused by name."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hp_dtensor.device import DeviceUnavailableError, backend_for, prepare_device_type


def test_cpu_is_gloo() -> None:
    assert backend_for("cpu") == "gloo"


def test_an_unknown_device_type_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"use one of \['cpu', 'cuda', 'npu'\]"):
        prepare_device_type("tpu")


def test_cuda_without_cuda_is_refused_by_name() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(DeviceUnavailableError, match=r"'cuda' is not available on this machine"):
        backend_for("cuda")


def test_npu_without_torch_npu_is_refused_by_name() -> None:
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    with pytest.raises(DeviceUnavailableError, match="needs torch_npu"):
        prepare_device_type("npu")

"""Kernel tests run implementations on fake devices (CPU tensors standing in for NPU and MUSA ones),
where timing them against the reference means nothing: the registry chooses by preference order
here unless a test turns timing on itself (tests/kernels/test_registry.py does)."""

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

import kernels
from kernels.registry import TIMING_ENV_VAR

FAKES_DIR = Path(__file__).resolve().parents[1] / "fakes"


@pytest.fixture(autouse=True)
def choose_kernels_by_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMING_ENV_VAR, "off")


@pytest.fixture(scope="module")
def npu() -> Iterator[ModuleType]:
    """kernels.npu imported afresh against the fake torch_npu (once for this module); both are gone
    again afterwards, so elsewhere "npu" stays "not installed"."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(FAKES_DIR))
        mp.delattr(kernels, "npu", raising=False)
        for name in ("torch_npu", "torch_npu.npu", "kernels.npu", "kernels.npu_mla", "kernels.npu_quant"):
            mp.delitem(sys.modules, name, raising=False)
        module = importlib.import_module("kernels.npu")
        assert module.torch_npu.__file__.startswith(str(FAKES_DIR))  # never a real one by accident
        yield module
        for name in ("torch_npu", "torch_npu.npu", "kernels.npu", "kernels.npu_mla", "kernels.npu_quant"):
            sys.modules.pop(name, None)
        if hasattr(torch, "npu"):  # set by the fake's import, as the real torch_npu sets it
            delattr(torch, "npu")
        if hasattr(kernels, "npu"):
            delattr(kernels, "npu")

"""Kernel tests run implementations on fake devices (CPU tensors standing in for NPU and MUSA ones),
where timing them against the reference means nothing: the registry chooses by preference order
here unless a test turns timing on itself (tests/kernels/test_registry.py does)."""

import importlib
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch

import xinserve.engines.core.engine
from xinserve import kernels
from xinserve.engines.platforms import npu as ascend
from xinserve.kernels import ascend as ascend_package
from xinserve.kernels.registry import ENV_VAR, TIMING_ENV_VAR

FAKES_DIR = Path(__file__).resolve().parents[1] / "fakes"
# imported afresh against the fake torch_npu by the ``npu`` fixture, and dropped after it
ASCEND_MODULES = ("ops", "mla", "quant", "kv", "lora")
FRESH_MODULES = ("torch_npu", "torch_npu.npu", *(f"xinserve.kernels.ascend.{name}" for name in ASCEND_MODULES))


@pytest.fixture(autouse=True)
def choose_kernels_by_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMING_ENV_VAR, "off")


@pytest.fixture(scope="module")
def npu() -> Iterator[ModuleType]:
    """xinserve.kernels.ascend.ops imported afresh against the fake torch_npu (once for this module); both are gone
    again afterwards, so elsewhere "npu" stays "not installed"."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(FAKES_DIR))
        mp.delattr(kernels, "npu", raising=False)
        for name in FRESH_MODULES:
            mp.delitem(sys.modules, name, raising=False)
        for name in ASCEND_MODULES:  # else ``from xinserve.kernels.ascend import lora`` takes a stale one
            mp.delattr(ascend_package, name, raising=False)
        module = importlib.import_module("xinserve.kernels.ascend.ops")
        assert module.torch_npu.__file__.startswith(str(FAKES_DIR))  # never a real one by accident
        yield module
        for name in FRESH_MODULES:
            sys.modules.pop(name, None)
        if hasattr(torch, "npu"):  # set by the fake's import, as the real torch_npu sets it
            delattr(torch, "npu")
        for name in ("npu", "npu_kv"):
            if hasattr(kernels, name):
                delattr(kernels, name)


@pytest.fixture
def no_forced_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


@pytest.fixture
def npu_platform(npu, no_forced_kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """get_platform("npu...") answers an Ascend platform whose device is the CPU (block size 128, as
    Ascend's paged kernels want), so the runner chooses kernels for "npu" while every tensor stays on
    the host."""
    cpu = torch.device("cpu")
    platform = replace(ascend.record(cpu), default_kv_cache_memory_fraction=0.1, free_memory=lambda: 2**30,
                       synchronize=lambda: None, dist_backend="gloo")
    real = xinserve.engines.core.engine.get_platform
    monkeypatch.setattr(xinserve.engines.core.engine, "get_platform",
                        lambda device: platform if device.startswith("npu") else real(device))

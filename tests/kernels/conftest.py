"""Kernel tests run implementations on fake devices (CPU tensors standing in for NPU and MUSA ones),
where timing them against the reference means nothing: the registry chooses by preference order
here unless a test turns timing on itself (tests/kernels/test_registry.py does)."""

import pytest

from kernels.registry import TIMING_ENV_VAR


@pytest.fixture(autouse=True)
def choose_kernels_by_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIMING_ENV_VAR, "off")

"""Platforms: one record per device kind, and a missing vendor package named with what to install."""

import pytest
import torch

from xinserve.engines.platforms import PlatformError, get_platform


def test_cpu_platform():
    cpu = get_platform("cpu")
    assert cpu.device == torch.device("cpu") and cpu.default_block_size == 16
    assert cpu.dist_backend == "gloo" and torch.bfloat16 in cpu.dtypes
    assert cpu.free_memory() > 0


MISSING = [
    ("npu:0", "torch_npu is not installed .* CANN toolkit"),
    ("musa:1", "torch_musa is not installed .* MUSA container image"),
] + ([] if torch.cuda.is_available() else [("cuda:0", "no CUDA device is usable")])


@pytest.mark.parametrize(("device", "says"), MISSING)
def test_a_missing_vendor_stack_says_what_to_install(device, says):
    with pytest.raises(PlatformError, match=says):
        get_platform(device)


@pytest.mark.parametrize("device", ["gpu", "npu:x"])
def test_unknown_devices_are_refused(device):
    with pytest.raises(ValueError, match="expected cpu, cuda:N, npu:N or musa:N"):
        get_platform(device)

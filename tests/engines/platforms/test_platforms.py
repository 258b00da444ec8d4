"""Platforms: one record per device kind, and a missing vendor package named with what to install."""

import pytest
import torch

from xinserve.engines.platforms import (
    PlatformError,
    get_platform,
    is_host,
    normal_device,
    ranks_share_the_device,
    splits_host_threads,
)


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


@pytest.mark.parametrize(("spec", "normal"), [("cpu", "cpu"), (" NPU ", "npu:0"), ("musa", "musa:0"), ("cuda:3", "cuda:3")])
def test_a_configured_device_has_one_spelling(spec, normal):
    assert normal_device(spec) == normal


@pytest.mark.parametrize("spec", ["gpu", "cpu:0", "npu:x", "cuda0"])
def test_a_device_no_platform_accepts_is_refused_in_config(spec):
    with pytest.raises(ValueError, match="worker device must be cpu, cuda:N, npu:N or musa:N"):
        normal_device(spec)


def test_only_the_host_is_shared_by_ranks_and_splits_its_threads():
    assert ranks_share_the_device("cpu") and splits_host_threads("cpu")
    for device in ("cuda:0", "npu:1", "musa:2"):
        assert not ranks_share_the_device(device) and not splits_host_threads(device)
    assert is_host(torch.device("cpu")) and not is_host(torch.device("meta"))

"""The Ascend tests' platform: the fake torch_npu (tests/fakes/torch_npu) behind an Ascend record on the CPU."""

from dataclasses import replace

import pytest
import torch

import xinserve.engines.core.engine
from xinserve.engines.platforms import npu as ascend
from xinserve.kernels import registry

BS = 128  # Ascend's paged kernels want 128


@pytest.fixture
def npu_platform(npu, monkeypatch):
    """get_platform("npu...") answers an Ascend platform whose device is the CPU."""
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    platform = replace(ascend.record(torch.device("cpu")), default_block_size=BS, default_kv_cache_memory_fraction=0.1,
                       free_memory=lambda: 2**30, synchronize=lambda: None, dist_backend="gloo")
    real = xinserve.engines.core.engine.get_platform
    monkeypatch.setattr(xinserve.engines.core.engine, "get_platform",
                        lambda device: platform if device.startswith("npu") else real(device))
    return npu

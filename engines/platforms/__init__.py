"""Where a worker runs: device string, memory query, default block size.

One small record per device kind. ``torch_npu`` and ``torch_musa`` are imported only when a worker
is placed on such a device (importing them registers the ``npu`` / ``musa`` device with torch).
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Platform:
    kind: str  # "cpu" | "cuda" | "npu" | "musa"
    device: torch.device
    default_block_size: int
    default_kv_cache_memory_fraction: float
    free_memory: Callable[[], int]  # bytes free for the KV pool, measured now
    synchronize: Callable[[], None]


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); what a CPU worker may still allocate."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _accelerator(kind: str, device: torch.device, block_size: int) -> Platform:
    module = getattr(torch, kind)
    module.set_device(device)
    return Platform(
        kind=kind,
        device=device,
        default_block_size=block_size,
        default_kv_cache_memory_fraction=0.7,
        free_memory=lambda: module.mem_get_info(device)[0],
        synchronize=lambda: module.synchronize(device),
    )


def get_platform(device: str) -> Platform:
    """``cpu``, ``cuda[:N]``, ``npu[:N]`` (Ascend, needs torch_npu) or ``musa[:N]`` (needs torch_musa)."""
    kind, _, index = device.partition(":")
    if index and not index.isdigit():
        raise ValueError(f"bad device {device!r}: expected cpu, cuda:N, npu:N or musa:N")
    if kind == "cpu":
        # CPU KV lives in host RAM next to everything else: take a modest share by default.
        return Platform("cpu", torch.device("cpu"), 16, 0.1, _host_available_bytes, lambda: None)
    if kind == "npu":
        importlib.import_module("torch_npu")
        return _accelerator("npu", torch.device(f"npu:{index or 0}"), 128)  # Ascend kernels want 128
    if kind == "musa":
        importlib.import_module("torch_musa")
        return _accelerator("musa", torch.device(f"musa:{index or 0}"), 16)
    if kind == "cuda":
        return _accelerator("cuda", torch.device(f"cuda:{index or 0}"), 16)
    raise ValueError(f"unknown device {device!r}: expected cpu, cuda:N, npu:N or musa:N")

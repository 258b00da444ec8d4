"""The host's CPU: one device that every worker and rank on the machine shares."""

from typing import TYPE_CHECKING

from xinserve.engines.platforms.record import Platform, all_dtypes

if TYPE_CHECKING:
    import torch

KIND = "cpu"
DEVICE_PATTERN = r"cpu"  # config accepts "cpu" only: there is one host
DEFAULT_DEVICE = "cpu"
# What provides Mooncake's transfer engine here (P/D disaggregation, engines/kv/mooncake_connector.py)
TRANSFER_ENGINE_HINT = "pip install mooncake-transfer-engine-non-cuda, with apt-get install libibverbs1 libnuma1 libcurl4"
KERNEL_PREFERENCE = ("cpp", "sdpa", "int8mm", "dequant", "reference")
EP_DISPATCH_PREFERENCE = ("all_to_all",)
# Ranks and workers all run on the host's cores: any number may list "cpu", and they split torch's threads.
RANKS_SHARE_THE_DEVICE = True
SPLITS_HOST_THREADS = True


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); what a CPU worker may still allocate."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def record(device: "torch.device") -> Platform:
    import torch

    return Platform(
        kind=KIND,
        device=device,
        default_block_size=16,
        # The KV pool lives in host RAM next to everything else: take a modest share by default.
        default_kv_cache_memory_fraction=0.1,
        free_memory=host_available_bytes,
        synchronize=lambda: None,
        kernel_preference=KERNEL_PREFERENCE,
        ep_dispatch_preference=EP_DISPATCH_PREFERENCE,
        graph_class=None,  # decode buckets are compiled instead
        typical_dtype=torch.float32,
        splits_host_threads=SPLITS_HOST_THREADS,
        builds_kernels_in_background=True,
        pins_host_memory=False,  # the host tier and the KV pool are the same memory
        dtypes=all_dtypes(),
        schedules_ahead=True,  # async scheduling is built and tested on the CPU (not on accelerators yet)
        visible_devices_env=None,
        dist_backend="gloo",
    )


def get(index: int) -> Platform:
    """The CPU platform (``cpu:N`` names the same host: the index is ignored)."""
    import torch

    return record(torch.device("cpu"))

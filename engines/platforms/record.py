"""The record of where a worker runs: what the engine, the runner and the kernel registry ask of a device.

torch is a type here only: the HTTP process reads the platform modules' device patterns and flags
before it imports torch (server/http/heavy_imports.py); a record is built where a worker runs.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class PlatformError(RuntimeError):
    """A device that cannot be used: its package, driver or card is missing or broken."""


@dataclass(frozen=True, slots=True)
class Platform:
    kind: str  # "cpu" | "cuda" | "npu" | "musa": the module in engines/platforms/ that made this record
    device: "torch.device"
    default_block_size: int
    default_kv_cache_memory_fraction: float
    free_memory: Callable[[], int]  # bytes free for the KV pool, measured now
    synchronize: Callable[[], None]
    kernel_preference: tuple[str, ...]  # kernels/registry.py's candidates, most preferred first, "reference" last
    ep_dispatch_preference: tuple[str, ...]  # kernels/ep_dispatch.py's, "all_to_all" last
    # torch.<kind>.<graph_class> captures the decode step per bucket; None: the buckets are compiled
    # with torch.compile instead (engines/worker/graphs.py)
    graph_class: str | None
    typical_dtype: "torch.dtype"  # what a served model usually computes in here (``xinserve doctor`` probes in it)
    # Capability flags: what the engine does differently here, named for why.
    splits_host_threads: bool  # its ranks run on the host's cores: each takes a share of torch's threads
    builds_kernels_in_background: bool  # C++ kernels not on disk yet are built after start-up (engines/worker/warmup.py)
    pins_host_memory: bool  # the host KV tier is pinned, so copies to the device run asynchronously
    schedules_ahead: bool  # step N+1 is scheduled while step N runs (engines/core/async_scheduling.py)
    dtypes: "tuple[torch.dtype, ...]"  # what it computes in
    visible_devices_env: str | None  # e.g. ASCEND_RT_VISIBLE_DEVICES
    dist_backend: str  # torch.distributed backend between the ranks of a replica

    @property
    def captures_graphs(self) -> bool:
        """Whether the decode step is captured as a device graph (else compiled, on the host)."""
        return self.graph_class is not None


def all_dtypes() -> "tuple[torch.dtype, ...]":
    import torch

    return (torch.float32, torch.float16, torch.bfloat16)

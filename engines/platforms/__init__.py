"""Where a worker runs: the one place that knows each device kind.

One small record per device kind: the torch device, default block size and KV share, memory
query and synchronize, the variable that limits which cards a process sees, the torch.distributed
backend, the dtypes it computes in. ``torch_npu`` and ``torch_musa`` are imported only when a
worker is placed on such a device (importing them registers the ``npu`` / ``musa`` device with
torch); when one is missing, or the device does not answer, the error says what to install or
check instead of a bare ImportError.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# kind -> (vendor module or None, what to install when it is missing)
VENDOR = {
    "cuda": (None, "a CUDA build of torch with an NVIDIA driver"),
    "npu": ("torch_npu", ("torch-npu matching your torch, with Huawei's CANN toolkit installed and sourced "
                         "(set_env.sh); see `pip install -e '.[npu]'`")),
    "musa": ("torch_musa", ("Moore Threads' MUSA container image, which ships torch_musa with the MUSA "
                           "toolkit (torch_musa is not on PyPI)")),
}


class PlatformError(RuntimeError):
    """A device that cannot be used: its package, driver or card is missing or broken."""


@dataclass(frozen=True, slots=True)
class Platform:
    kind: str  # "cpu" | "cuda" | "npu" | "musa"
    device: torch.device
    default_block_size: int
    default_kv_cache_memory_fraction: float
    free_memory: Callable[[], int]  # bytes free for the KV pool, measured now
    synchronize: Callable[[], None]
    visible_devices_env: str | None = None  # e.g. ASCEND_RT_VISIBLE_DEVICES
    dist_backend: str = "gloo"  # torch.distributed backend between the ranks of a replica
    dtypes: tuple[torch.dtype, ...] = ALL_DTYPES


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); what a CPU worker may still allocate."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _import_vendor(kind: str) -> None:
    module, install = VENDOR[kind]
    if module is None:
        if not torch.cuda.is_available():
            raise PlatformError(f"no CUDA device is usable by this torch ({torch.__version__}); "
                                f"needs a GPU, its driver and {install}")
        return
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise PlatformError(f"{module} is not installed ({exc}); install {install}") from None


def _accelerator(kind: str, index: int, block_size: int, visible_env: str, backend: str) -> Platform:
    _import_vendor(kind)
    module = getattr(torch, kind)
    device = torch.device(f"{kind}:{index}")
    try:
        module.set_device(device)
        module.mem_get_info(device)  # a card that is absent or faulty fails here, with its own text
    except Exception as exc:  # noqa: BLE001  driver errors come in every type
        raise PlatformError(f"{device} failed to initialise: {type(exc).__name__}: {exc}") from None
    return Platform(
        kind=kind,
        device=device,
        default_block_size=block_size,
        default_kv_cache_memory_fraction=0.7,
        free_memory=lambda: module.mem_get_info(device)[0],
        synchronize=lambda: module.synchronize(device),
        visible_devices_env=visible_env,
        dist_backend=backend,
    )


def get_platform(device: str) -> Platform:
    """``cpu``, ``cuda[:N]``, ``npu[:N]`` (Ascend, needs torch_npu) or ``musa[:N]`` (needs torch_musa),
    made current. Raises PlatformError naming what is missing when the device cannot be used."""
    kind, _, index = device.partition(":")
    if index and not index.isdigit():
        raise ValueError(f"bad device {device!r}: expected cpu, cuda:N, npu:N or musa:N")
    if kind == "cpu":
        # CPU KV lives in host RAM next to everything else: take a modest share by default.
        return Platform("cpu", torch.device("cpu"), 16, 0.1, _host_available_bytes, lambda: None)
    if kind == "npu":  # Ascend's paged-attention kernels want 128-token blocks
        return _accelerator("npu", int(index or 0), 128, "ASCEND_RT_VISIBLE_DEVICES", "hccl")
    if kind == "musa":  # MATE's paged decode takes its fastest load path with 64-token pages
        return _accelerator("musa", int(index or 0), 64, "MUSA_VISIBLE_DEVICES", "mccl")
    if kind == "cuda":
        return _accelerator("cuda", int(index or 0), 16, "CUDA_VISIBLE_DEVICES", "nccl")
    raise ValueError(f"unknown device {device!r}: expected cpu, cuda:N, npu:N or musa:N")

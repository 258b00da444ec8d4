"""Where a worker runs: the one place that knows each device kind (the vendor seam).

One module per kind (``cpu``, ``cuda``, ``npu``, ``musa``) owns everything vendor-specific: its
``record(device)`` (record.py's ``Platform``: torch device, block size and KV share defaults, memory
query, synchronize, visible-devices variable, distributed backend, dtypes, the kernel registry's
preference list, the graph class, and the capability flags the engine branches on), its
``DEVICE_PATTERN`` (what config accepts), its ``INSTALL_HINT`` and ``VENDOR_MODULE`` (what
``xinserve doctor`` and a failed start-up name), and ``get(index)``, which opens the device. An
accelerator module may also say why this torch build cannot drive it at all (``torch_build_problem``).

``torch_npu`` and ``torch_musa`` are imported only when a worker is placed on such a device
(importing them registers the ``npu`` / ``musa`` device with torch); when one is missing, or the
device does not answer, PlatformError says what to install or check instead of a bare ImportError.
The package imports no torch itself (torch is imported where a record is built): the HTTP process reads
the device patterns and flags to check its config before it imports torch (server/http/heavy_imports.py).
A new vendor is one module here, listed in ``ACCELERATORS``, plus its kernels in kernels/<vendor>/.
"""

import re
from types import ModuleType
from typing import TYPE_CHECKING

from xinserve.engines.platforms import cpu, cuda, musa, npu
from xinserve.engines.platforms.record import Platform, PlatformError

if TYPE_CHECKING:
    import torch

__all__ = ["ACCELERATORS", "KINDS", "Platform", "PlatformError", "get_platform", "is_host", "normal_device",
           "ranks_share_the_device", "splits_host_threads", "transfer_engine_hint"]

ACCELERATORS: dict[str, ModuleType] = {module.KIND: module for module in (cuda, npu, musa)}
KINDS: dict[str, ModuleType] = {cpu.KIND: cpu, **ACCELERATORS}
_EXPECTED = "expected cpu, cuda:N, npu:N or musa:N"
_DEVICE = re.compile("|".join(f"(?:{module.DEVICE_PATTERN})" for module in KINDS.values()))


def get_platform(device: str) -> Platform:
    """``cpu``, ``cuda[:N]``, ``npu[:N]`` (Ascend, needs torch_npu) or ``musa[:N]`` (needs torch_musa),
    made current. Raises PlatformError naming what is missing when the device cannot be used."""
    index = device.partition(":")[2]
    if index and not index.isdigit():
        raise ValueError(f"bad device {device!r}: {_EXPECTED}")
    return _kind(device).get(int(index or 0))


def normal_device(spec: str) -> str:
    """A configured device in its one spelling (``"NPU"`` -> ``"npu:0"``, as torch's own device strings
    read a bare kind); ValueError for one no platform accepts."""
    spec = spec.strip().lower()
    if not _DEVICE.fullmatch(spec):
        raise ValueError(f"worker device must be cpu, cuda:N, npu:N or musa:N, got {spec!r}")
    return spec if ":" in spec else _kind(spec).DEFAULT_DEVICE


def ranks_share_the_device(device: str) -> bool:
    """Whether several workers or ranks may list ``device`` (the host), where a card needs one each."""
    return _kind(device).RANKS_SHARE_THE_DEVICE


def splits_host_threads(device: str) -> bool:
    """Whether workers on ``device`` run on the host's cores, each with a share of its threads."""
    return _kind(device).SPLITS_HOST_THREADS


def transfer_engine_hint(device: str) -> str:
    """What to install for Mooncake's transfer engine on ``device``'s kind."""
    return _kind(device).TRANSFER_ENGINE_HINT


def is_host(device: "torch.device") -> bool:
    """Whether tensors on ``device`` live in host memory (numpy can view them; no copy is needed)."""
    return device.type == cpu.KIND


def _kind(device: str) -> ModuleType:
    kind = device.partition(":")[0]
    if kind not in KINDS:
        raise ValueError(f"unknown device {device!r}: {_EXPECTED}")
    return KINDS[kind]

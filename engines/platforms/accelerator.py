"""Opening one card of an accelerator kind (CUDA, Ascend, MUSA): its vendor package imported, the card made
current and asked for its memory, so a missing package, driver or card fails here with what to do."""

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from xinserve.engines.platforms.record import Platform, PlatformError, all_dtypes

if TYPE_CHECKING:
    import torch


def open_card(kind: str, index: int, vendor_module: str | None, install_hint: str,
              record: Callable[["torch.device"], Platform]) -> Platform:
    """``record``'s platform for card ``index`` of ``kind``, made current. ``vendor_module`` (e.g.
    ``torch_npu``) is imported first: importing it registers the device with torch."""
    import torch

    _import_vendor(kind, vendor_module, install_hint)
    module = getattr(torch, kind)
    device = torch.device(f"{kind}:{index}")
    try:
        module.set_device(device)
        module.mem_get_info(device)  # a card that is absent or faulty fails here, with its own text
    except Exception as exc:  # noqa: BLE001  driver errors come in every type
        raise PlatformError(f"{device} failed to initialise: {type(exc).__name__}: {exc}") from None
    return record(device)


def accelerator_record(kind: ModuleType, device: "torch.device", *, block_size: int, graph_class: str,
                       visible_devices_env: str, dist_backend: str) -> Platform:
    """The record of a card of the accelerator kind whose module is ``kind`` (cuda.py, npu.py, musa.py:
    its KIND, preference lists and flags); what differs between them is named here."""
    import torch

    free_memory, synchronize = memory_queries(kind.KIND, device)
    return Platform(
        kind=kind.KIND,
        device=device,
        default_block_size=block_size,
        default_kv_cache_memory_fraction=0.7,
        free_memory=free_memory,
        synchronize=synchronize,
        kernel_preference=kind.KERNEL_PREFERENCE,
        ep_dispatch_preference=kind.EP_DISPATCH_PREFERENCE,
        graph_class=graph_class,
        typical_dtype=torch.bfloat16,
        splits_host_threads=kind.SPLITS_HOST_THREADS,
        builds_kernels_in_background=False,
        pins_host_memory=True,
        schedules_ahead=False,  # unless async_scheduling_on_accelerators: off until measured on the device
        dtypes=all_dtypes(),
        visible_devices_env=visible_devices_env,
        dist_backend=dist_backend,
    )


def memory_queries(kind: str, device: "torch.device") -> tuple[Callable[[], int], Callable[[], None]]:
    """(bytes free on ``device`` now, wait for ``device``): looked up on ``torch.<kind>`` when called,
    which exists once the vendor package is imported."""
    import torch

    return (lambda: getattr(torch, kind).mem_get_info(device)[0]), (lambda: getattr(torch, kind).synchronize(device))


def _import_vendor(kind: str, vendor_module: str | None, install_hint: str) -> None:
    import torch

    if vendor_module is None:  # CUDA is built into torch
        if not torch.cuda.is_available():
            raise PlatformError(f"no CUDA device is usable by this torch ({torch.__version__}); "
                                f"needs a GPU, its driver and {install_hint}")
        return
    try:
        importlib.import_module(vendor_module)
    except ImportError as exc:
        raise PlatformError(f"{vendor_module} is not installed ({exc}); install {install_hint}") from None

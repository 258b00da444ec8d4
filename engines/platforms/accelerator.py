"""Opening one card of an accelerator kind (CUDA, Ascend, MUSA): its vendor package imported, the card made
current and asked for its memory, so a missing package, driver or card fails here with what to do."""

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from xinserve.engines.platforms.record import Platform, PlatformError

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

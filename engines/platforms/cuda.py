"""NVIDIA GPUs, through torch's own CUDA build."""

import sys
from typing import TYPE_CHECKING

from xinserve.engines.platforms.accelerator import accelerator_record, open_card
from xinserve.engines.platforms.record import Platform

if TYPE_CHECKING:
    import torch

KIND = "cuda"
DEVICE_PATTERN = r"cuda(:\d+)?"  # "cuda" alone means the first card
DEFAULT_DEVICE = "cuda:0"
VENDOR_MODULE = None
INSTALL_HINT = "a CUDA build of torch with an NVIDIA driver"
# What provides Mooncake's transfer engine here (P/D disaggregation, engines/kv/mooncake_connector.py)
TRANSFER_ENGINE_HINT = "pip install mooncake-transfer-engine (CUDA 12) or mooncake-transfer-engine-cuda13"
KERNEL_PREFERENCE = ("triton", "grouped_mm", "int8mm", "dequant", "reference")
EP_DISPATCH_PREFERENCE = ("all_to_all",)
RANKS_SHARE_THE_DEVICE = False  # each rank needs a card of its own
SPLITS_HOST_THREADS = False


def record(device: "torch.device") -> Platform:
    """What this kind is, for ``device`` (no card is touched: tests pass the CPU)."""
    return accelerator_record(sys.modules[__name__], device, block_size=16, graph_class="CUDAGraph",
                              visible_devices_env="CUDA_VISIBLE_DEVICES", dist_backend="nccl")


def get(index: int) -> Platform:
    """Card ``index``, made current; PlatformError says what to install or check when it cannot be used."""
    return open_card(KIND, index, VENDOR_MODULE, INSTALL_HINT, record)


def torch_build_problem() -> str | None:
    """Why this torch cannot drive a CUDA card whatever the machine has (a CPU-only build); None when it can."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    return None

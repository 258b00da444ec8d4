"""Moore Threads GPUs, through torch_musa (importing it registers the ``musa`` device with torch)."""

import sys
from typing import TYPE_CHECKING

from xinserve.engines.platforms.accelerator import accelerator_record, open_card
from xinserve.engines.platforms.record import Platform

if TYPE_CHECKING:
    import torch

KIND = "musa"
DEVICE_PATTERN = r"musa(:\d+)?"  # "musa" alone means the first card
DEFAULT_DEVICE = "musa:0"
VENDOR_MODULE = "torch_musa"
INSTALL_HINT = ("Moore Threads' MUSA container image, which ships torch_musa with the MUSA "
                "toolkit (torch_musa is not on PyPI)")
# What provides Mooncake's transfer engine here (P/D disaggregation, engines/kv/mooncake_connector.py)
TRANSFER_ENGINE_HINT = ("pip install mooncake-transfer-engine-non-cuda (the -musa package on PyPI is an empty "
                        "placeholder), with apt-get install libibverbs1 libnuma1 libcurl4")
KERNEL_PREFERENCE = ("musa", "triton", "dequant", "reference")
EP_DISPATCH_PREFERENCE = ("all_to_all",)
RANKS_SHARE_THE_DEVICE = False  # each rank needs a card of its own
SPLITS_HOST_THREADS = False


def record(device: "torch.device") -> Platform:
    """What this kind is, for ``device`` (no card is touched: tests pass the CPU)."""
    # block size: MATE's paged decode takes its fastest load path with 64-token pages
    return accelerator_record(sys.modules[__name__], device, block_size=64, graph_class="MUSAGraph",
                              visible_devices_env="MUSA_VISIBLE_DEVICES", dist_backend="mccl")


def get(index: int) -> Platform:
    """Card ``index``, made current; PlatformError says what to install or check when it cannot be used."""
    return open_card(KIND, index, VENDOR_MODULE, INSTALL_HINT, record)

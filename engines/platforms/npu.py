"""Huawei Ascend NPUs, through torch_npu (importing it registers the ``npu`` device with torch)."""

import sys
from typing import TYPE_CHECKING

from xinserve.engines.platforms.accelerator import accelerator_record, open_card
from xinserve.engines.platforms.record import Platform

if TYPE_CHECKING:
    import torch

KIND = "npu"
DEVICE_PATTERN = r"npu(:\d+)?"  # "npu" alone means the first card
DEFAULT_DEVICE = "npu:0"
VENDOR_MODULE = "torch_npu"
INSTALL_HINT = ("torch-npu matching your torch, with Huawei's CANN toolkit installed and sourced "
                "(set_env.sh); see `pip install -e '.[npu]'`")
# What provides Mooncake's transfer engine here (P/D disaggregation, engines/kv/mooncake_connector.py)
TRANSFER_ENGINE_HINT = "pip install mooncake-transfer-engine-npu (its Ascend transport needs CANN)"
KERNEL_PREFERENCE = ("npu", "npu_kv", "dequant", "reference")
EP_DISPATCH_PREFERENCE = ("npu_moe_dispatch", "all_to_all")
RANKS_SHARE_THE_DEVICE = False  # each rank needs a card of its own
SPLITS_HOST_THREADS = False


def record(device: "torch.device") -> Platform:
    """What this kind is, for ``device`` (no card is touched: tests pass the CPU)."""
    # block size: Ascend's paged-attention kernels want 128-token blocks
    return accelerator_record(sys.modules[__name__], device, block_size=128, graph_class="NPUGraph",
                              visible_devices_env="ASCEND_RT_VISIBLE_DEVICES", dist_backend="hccl")


def get(index: int) -> Platform:
    """Card ``index``, made current; PlatformError says what to install or check when it cannot be used."""
    return open_card(KIND, index, VENDOR_MODULE, INSTALL_HINT, record)

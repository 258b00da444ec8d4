"""Huawei Ascend NPUs, through torch_npu (importing it registers the ``npu`` device with torch)."""

from typing import TYPE_CHECKING

from xinserve.engines.platforms.accelerator import memory_queries, open_card
from xinserve.engines.platforms.record import Platform, all_dtypes

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
    import torch

    free_memory, synchronize = memory_queries(KIND, device)
    return Platform(
        kind=KIND,
        device=device,
        default_block_size=128,  # Ascend's paged-attention kernels want 128-token blocks
        default_kv_cache_memory_fraction=0.7,
        free_memory=free_memory,
        synchronize=synchronize,
        kernel_preference=KERNEL_PREFERENCE,
        ep_dispatch_preference=EP_DISPATCH_PREFERENCE,
        graph_class="NPUGraph",
        typical_dtype=torch.bfloat16,
        splits_host_threads=SPLITS_HOST_THREADS,
        builds_kernels_in_background=False,
        pins_host_memory=True,
        schedules_ahead=False,
        dtypes=all_dtypes(),
        visible_devices_env="ASCEND_RT_VISIBLE_DEVICES",
        dist_backend="hccl",
    )


def get(index: int) -> Platform:
    """Card ``index``, made current; PlatformError says what to install or check when it cannot be used."""
    return open_card(KIND, index, VENDOR_MODULE, INSTALL_HINT, record)

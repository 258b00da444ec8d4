"""Moore Threads GPUs, through torch_musa (importing it registers the ``musa`` device with torch)."""

from typing import TYPE_CHECKING

from xinserve.engines.platforms.accelerator import memory_queries, open_card
from xinserve.engines.platforms.record import Platform, all_dtypes

if TYPE_CHECKING:
    import torch

KIND = "musa"
DEVICE_PATTERN = r"musa(:\d+)?"  # "musa" alone means the first card
DEFAULT_DEVICE = "musa:0"
VENDOR_MODULE = "torch_musa"
INSTALL_HINT = ("Moore Threads' MUSA container image, which ships torch_musa with the MUSA "
                "toolkit (torch_musa is not on PyPI)")
# What provides Mooncake's transfer engine here (P/D disaggregation, engines/kv/mooncake_connector.py)
TRANSFER_ENGINE_HINT = ("pip install mooncake-transfer-engine-non-cuda (the -musa package on PyPI is an empty placeholder), "
                        "with apt-get install libibverbs1 libnuma1 libcurl4")
KERNEL_PREFERENCE = ("musa", "triton", "dequant", "reference")
EP_DISPATCH_PREFERENCE = ("all_to_all",)
RANKS_SHARE_THE_DEVICE = False  # each rank needs a card of its own
SPLITS_HOST_THREADS = False


def record(device: "torch.device") -> Platform:
    """What this kind is, for ``device`` (no card is touched: tests pass the CPU)."""
    import torch

    free_memory, synchronize = memory_queries(KIND, device)
    return Platform(
        kind=KIND,
        device=device,
        default_block_size=64,  # MATE's paged decode takes its fastest load path with 64-token pages
        default_kv_cache_memory_fraction=0.7,
        free_memory=free_memory,
        synchronize=synchronize,
        kernel_preference=KERNEL_PREFERENCE,
        ep_dispatch_preference=EP_DISPATCH_PREFERENCE,
        graph_class="MUSAGraph",
        typical_dtype=torch.bfloat16,
        splits_host_threads=SPLITS_HOST_THREADS,
        builds_kernels_in_background=False,
        pins_host_memory=True,
        schedules_ahead=False,
        dtypes=all_dtypes(),
        visible_devices_env="MUSA_VISIBLE_DEVICES",
        dist_backend="mccl",
    )


def get(index: int) -> Platform:
    """Card ``index``, made current; PlatformError says what to install or check when it cannot be used."""
    return open_card(KIND, index, VENDOR_MODULE, INSTALL_HINT, record)

"""Zeroed CPU memory on transparent huge pages, for the KV pool and the model's weights.

Decode attention reads each sequence's blocks where its block table puts them, scattered over a pool
of a gigabyte or more. On 4 KiB pages nearly every block is on pages the TLB does not hold, so each
block costs page walks before its bytes arrive (more under virtualisation, where a walk is nested);
on 2 MiB pages a 1 GiB pool is 512 TLB entries. Linux backs an anonymous mapping with huge pages when
it is asked to with ``madvise(MADV_HUGEPAGE)`` (transparent huge pages in "madvise" mode, the common
default; in "always" mode it would anyway, in "never" mode it will not). The mapping is made here with
``mmap`` and handed to torch without a copy; the tensor keeps it alive.

Where ``mmap.MADV_HUGEPAGE`` does not exist (not Linux) or ``madvise`` fails, the pool is a plain
``torch.zeros``: huge pages change how fast the pool is read, never what it holds.

The weights are read whole in every decode step, after the K/V stream has flushed the TLB; on 4 KiB
pages each page of a weight costs a (nested) walk and the hardware prefetcher stops at its end.
``weights_on_huge_pages`` gives the parameters of a model one arena of huge pages between them.
"""

import logging
import math
import mmap

import torch
from torch import nn

logger = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages): a PMD-sized transparent huge page
CACHE_LINE = 64


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous zeroed CPU tensor of ``shape`` and ``dtype`` whose memory is asked to be huge pages;
    a plain ``torch.zeros`` when that cannot be asked (see the module's docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    # One huge page more than needed, so the tensor can start on a 2 MiB boundary (an anonymous mapping is
    # only page aligned, and a huge page maps an aligned 2 MiB range). Anonymous memory is zero-filled.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError as exc:  # a kernel without THP support (EINVAL) or a sandbox that forbids it
        logger.info("KV pool on normal pages: madvise(MADV_HUGEPAGE) failed (%s)", exc)
        region.close()
        return torch.zeros(shape, dtype=dtype)
    offset = -_address(region) % HUGE_PAGE
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)  # holds ``region``
    return flat.view(dtype).view(shape)


def weights_on_huge_pages(model: nn.Module) -> None:
    """Rebind every CPU parameter of ``model`` to a view of one zeroed arena on huge pages, each view
    starting on a cache line. Meant for a model just made by ``to_empty`` (its values are not kept: the
    loader fills them next); the storage it had is released. A model of under one huge page, or one
    whose parameters live on a device, is left as it is."""
    params = [p for p in model.parameters() if p.device.type == "cpu"]  # each shared parameter once
    spans = [-(-p.numel() * p.element_size() // CACHE_LINE) * CACHE_LINE for p in params]
    if sum(spans) < HUGE_PAGE:
        return
    arena = zeros_on_huge_pages((sum(spans),), torch.uint8)
    offset = 0
    for param, span in zip(params, spans):
        nbytes = param.numel() * param.element_size()
        param.data = arena[offset : offset + nbytes].view(param.dtype).view(param.shape)
        offset += span


def _address(region: mmap.mmap) -> int:
    """The mapping's start address (mmap objects do not expose it; a zero-copy tensor view does)."""
    return torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()


def kv_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The worker's KV pool, zeroed: on huge pages in host memory, a plain ``torch.zeros`` on a device."""
    if device.type == "cpu":
        return zeros_on_huge_pages(tuple(shape), dtype)
    return torch.zeros(shape, dtype=dtype, device=device)

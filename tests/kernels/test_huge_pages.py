"""The KV pool on transparent huge pages (kernels/huge_pages.py), and its fallbacks."""

import mmap

import torch

from kernels import huge_pages


def test_a_pool_on_huge_pages_is_a_zeroed_tensor_on_a_huge_page_boundary():
    shape = (2, 3, 80, 16, 2, 64)  # 3.75 MiB of float32
    pool = huge_pages.zeros_on_huge_pages(shape, torch.float32)
    assert pool.shape == shape and pool.dtype == torch.float32 and pool.is_contiguous()
    assert pool.data_ptr() % huge_pages.HUGE_PAGE == 0 and not pool.any()
    pool[1, 2, 79] = 1.5  # writable, and its last element is in the mapping
    assert pool.sum() == 1.5 * 16 * 2 * 64
    fp8 = huge_pages.zeros_on_huge_pages((4, 1 << 20), torch.float8_e4m3fn)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == (4, 1 << 20) and not fp8.view(torch.uint8).any()


class _RefusingMap(mmap.mmap):
    def madvise(self, *args) -> None:
        raise OSError(22, "Invalid argument")


class _NoHugePages:
    """The mmap module of a platform without MADV_HUGEPAGE."""

    mmap, MAP_PRIVATE, MAP_ANONYMOUS = mmap.mmap, mmap.MAP_PRIVATE, mmap.MAP_ANONYMOUS


class _RefusingKernel(_NoHugePages):
    mmap, MADV_HUGEPAGE = _RefusingMap, 14


def test_without_huge_pages_the_pool_is_plain_zeros(monkeypatch):
    for module in (_NoHugePages, _RefusingKernel):
        monkeypatch.setattr(huge_pages, "mmap", module)
        pool = huge_pages.zeros_on_huge_pages((8, 1 << 18), torch.bfloat16)
        assert pool.shape == (8, 1 << 18) and pool.dtype == torch.bfloat16 and not pool.any()
    small = huge_pages.zeros_on_huge_pages((3, 5), torch.int8)  # under one huge page: never mapped
    assert small.shape == (3, 5) and not small.any()


def test_a_device_pool_is_not_mapped_here():
    pool = huge_pages.kv_pool((2, 4, 3), torch.float16, torch.device("meta"))
    assert pool.device.type == "meta" and pool.shape == (2, 4, 3)

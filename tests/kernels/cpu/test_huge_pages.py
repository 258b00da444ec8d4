"""The KV pool on transparent huge pages (kernels/cpu/huge_pages.py), and its fallbacks."""

import mmap

import torch

from xinserve.kernels.cpu import huge_pages


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


def test_the_weights_move_to_one_huge_page_arena_each_on_a_cache_line():
    model = torch.nn.Sequential(torch.nn.Linear(256, 1536), torch.nn.Linear(1536, 300, bias=False))
    old = [p.data_ptr() for p in model.parameters()]
    huge_pages.weights_on_huge_pages(model)
    params = list(model.parameters())
    assert all(p.data_ptr() != o for p, o in zip(params, old))
    assert params[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(p.data_ptr() % huge_pages.CACHE_LINE == 0 and p.is_contiguous() for p in params)
    ends = [p.data_ptr() + p.nbytes for p in params]
    assert all(end <= p.data_ptr() for end, p in zip(ends, params[1:]))  # side by side, none overlapping
    assert not any(p.any() for p in params)  # the arena's zeros (the loader fills them next)
    for p in params:
        p.data.fill_(0.5)  # each view is its own parameter's memory
    out = model(torch.ones(3, 256))
    assert out.shape == (3, 300) and torch.allclose(out, torch.full((3, 300), 0.5 * 1536 * (0.5 * 256 + 0.5)))


def test_a_shared_parameter_moves_once_and_small_models_stay():
    tied = torch.nn.Module()
    tied.a = torch.nn.Linear(512, 1024, bias=False)
    tied.b = torch.nn.Linear(1024, 512, bias=False)
    tied.b.weight = torch.nn.Parameter(tied.a.weight.data.T.contiguous())
    tied.c = torch.nn.Module()
    tied.c.weight = tied.a.weight  # the same parameter in two places
    huge_pages.weights_on_huge_pages(tied)
    assert tied.c.weight is tied.a.weight and tied.a.weight.data_ptr() % huge_pages.HUGE_PAGE == 0
    small = torch.nn.Linear(8, 8)
    before = small.weight.data_ptr()
    huge_pages.weights_on_huge_pages(small)  # under one huge page: left as it is
    assert small.weight.data_ptr() == before

"""Where each KV block of a pool lies in memory, for connectors that move blocks as they lie (no repacking).

A pool tensor is seen through per-layer views (``host_tier.block_views``), each contiguous with the blocks
on its first axis: block ``b`` of view ``v`` is ``block_bytes[v]`` bytes at ``offsets[v] + b *
block_bytes[v]`` from the pool's first byte. Two pools with the same layout (the same model, block size
and KV dtype) exchange block ``b`` for block ``c`` view by view; consecutive runs of block ids on both
sides become one range per view, so a prompt's blocks move in a few large reads.
"""

from dataclasses import dataclass
from typing import Any

import torch

from xinserve.engines.kv.host_tier import block_views


@dataclass(frozen=True, slots=True)
class BlockLayout:
    num_blocks: int
    block_size: int  # tokens per block
    offsets: tuple[int, ...]  # each view's first byte, from the pool's first byte
    block_bytes: tuple[int, ...]  # one block of each view

    @classmethod
    def of(cls, model: Any, kv_cache: torch.Tensor, block_size: int) -> "BlockLayout":
        base = kv_cache.data_ptr()
        views = block_views(model, kv_cache)
        for view in views:
            if not view.is_contiguous():
                raise ValueError("a KV view is not contiguous: its blocks cannot be moved as they lie")
        return cls(views[0].shape[0], block_size, tuple(v.data_ptr() - base for v in views),
                   tuple(v[0].nbytes for v in views))

    def same_shape(self, other: "BlockLayout") -> bool:
        """Whether blocks of ``other`` mean the same here (its block count may differ)."""
        return (self.block_size, self.block_bytes) == (other.block_size, other.block_bytes)

    def ranges(self, local_base: int, local_ids: list[int], remote_base: int, remote_ids: list[int],
               remote_offsets: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
        """(local addresses, remote addresses, lengths) that copy remote block ``remote_ids[i]`` into local
        block ``local_ids[i]`` in every view; runs consecutive on both sides are merged."""
        local_ptrs, remote_ptrs, lengths = [], [], []
        for start, stop in runs(local_ids, remote_ids):
            count = stop - start
            for offset, remote_offset, size in zip(self.offsets, remote_offsets, self.block_bytes):
                local_ptrs.append(local_base + offset + local_ids[start] * size)
                remote_ptrs.append(remote_base + remote_offset + remote_ids[start] * size)
                lengths.append(count * size)
        return local_ptrs, remote_ptrs, lengths


def runs(a: list[int], b: list[int]) -> list[tuple[int, int]]:
    """[start, stop) index ranges over which ``a`` and ``b`` both count up by one."""
    spans, start = [], 0
    for i in range(1, len(a) + 1):
        if i == len(a) or a[i] != a[i - 1] + 1 or b[i] != b[i - 1] + 1:
            spans.append((start, i))
            start = i
    return spans

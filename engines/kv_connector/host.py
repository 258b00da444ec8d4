"""A host-memory KV tier: the blocks the device pool evicts are copied to a host buffer of the same
layout, LRU within it, and copied back when a later prompt's prefix hits them.

The buffer is ``model.kv_cache_shape(capacity)`` (dense: [2, layers, slots, block_size, kv_heads,
head_dim]; MLA: [slots, block_size, latent values]), so any cache layout the model declares works:
a block is one index along the axis where the pool's shape grows with its block count. Pinned where
the device supports it; copies are issued ``non_blocking`` on the device's stream in step order (a
store before a load into the same pool block), so the host never waits for them. On the CPU they
are plain memory copies.
"""

from collections import OrderedDict
from typing import Any

import torch

GIB = 1 << 30


def block_axis(kv_cache_shape: Any, block_size: int) -> int:
    """The axis of the model's KV tensor that counts blocks (the one that grows with their number)."""
    one, two = kv_cache_shape(1, block_size), kv_cache_shape(2, block_size)
    return next(i for i, (a, b) in enumerate(zip(one, two)) if a != b)


class HostKVConnector:
    def __init__(self, model: Any, block_size: int, bytes_per_block: int, size_gib: float, dtype: torch.dtype,
                 pin_memory: bool) -> None:
        self.capacity = int(size_gib * GIB) // bytes_per_block
        if self.capacity < 1:
            raise ValueError(f"kv_offloading_size {size_gib} GiB holds no KV block of {bytes_per_block} bytes")
        self.axis = block_axis(model.kv_cache_shape, block_size)
        self.pinned = pin_memory
        self.buffer = torch.empty(model.kv_cache_shape(self.capacity, block_size), dtype=dtype,
                                  pin_memory=pin_memory)
        # block hash -> (slot, the block's token ids); least recently used first
        self.index: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self.free_slots = list(range(self.capacity - 1, -1, -1))
        self.stored_blocks = 0
        self.loaded_blocks = 0

    def contains(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Whether the tier holds this block (its tokens re-checked, as the pool does); a hit is used."""
        entry = self.index.get(block_hash)
        if entry is None or entry[1] != token_ids:
            return False
        self.index.move_to_end(block_hash)
        return True

    def transfer(self, stores: list[tuple[int, int, tuple[int, ...]]], loads: list[tuple[int, int]],
                 kv_cache: torch.Tensor) -> None:
        """Copy evicted pool blocks (hash, block id, tokens) in, then looked-up blocks (hash, block id)
        out to the pool. Slots about to be loaded are never reused by this call's stores."""
        loading = {self.index[h][0] for h, _ in loads}
        for block_hash, block_id, token_ids in stores:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
                continue
            slot = self._take_slot(loading)
            if slot is None:  # every slot is being loaded from: this block is dropped
                continue
            self.buffer.select(self.axis, slot).copy_(kv_cache.select(self.axis, block_id), non_blocking=True)
            self.index[block_hash] = (slot, token_ids)
            self.stored_blocks += 1
        for block_hash, block_id in loads:
            slot = self.index[block_hash][0]
            kv_cache.select(self.axis, block_id).copy_(self.buffer.select(self.axis, slot), non_blocking=True)
            self.loaded_blocks += 1

    def _take_slot(self, keep: set[int]) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        for block_hash, (slot, _) in self.index.items():  # least recently used first
            if slot not in keep:
                del self.index[block_hash]
                return slot
        return None

    def clear(self) -> None:
        """Forget every block (the pool's prefix cache was reset)."""
        self.index.clear()
        self.free_slots = list(range(self.capacity - 1, -1, -1))

    def report(self) -> dict[str, Any]:
        return {"kind": "host", "capacity_blocks": self.capacity, "bytes": self.buffer.nbytes,
                "pinned": self.pinned}


def make_host_tier(size_gib: float | None, runner: Any, block_size: int, device_kind: str) -> HostKVConnector | None:
    """The engine's host tier (None without ``kv_offloading_size``), laid out like ``runner``'s KV pool;
    pinned unless the device is the CPU itself."""
    if size_gib is None:
        return None
    return HostKVConnector(runner.model, block_size, runner.bytes_per_block(), size_gib, runner.kv_cache.dtype,
                           pin_memory=device_kind != "cpu")

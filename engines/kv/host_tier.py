"""A host-memory KV tier: the blocks the device pool evicts are copied to a host buffer of the same
layout, LRU within it, and copied back when a later prompt's prefix hits them.

The buffer is ``model.kv_cache_shape(capacity)`` and is read through the model's own per-layer views
(``layer_caches``: dense [N, BS, kv_heads, head_dim] keys and values; MLA [N, BS, latent] segments, which
are not slices of the pool's first axis), so a block is index N of every view of the pool and of the
buffer, whatever layout the model uses. Pinned where the device supports it; on a device, the copies
are issued ``non_blocking`` on its stream in step order (every store before any load, since a pool
block being reused is saved before it is overwritten), so the host never waits for them. On the CPU
they are one gather and scatter per view.
"""

from collections import OrderedDict
from typing import Any

import torch

from xinserve.engines.core.sequence import Sequence
from xinserve.engines.kv.connector import KVConnectorBase

GIB = 1 << 30


def block_views(model: Any, kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """Every per-layer view of a KV tensor of ``model``'s layout, each with blocks on its first axis."""
    return [view for caches in model.model.layer_caches(kv_cache) for view in caches if view is not None]


def copy_blocks(dst: list[torch.Tensor], dst_ids: list[int], src: list[torch.Tensor], src_ids: list[int]) -> None:
    """Block ``src_ids[i]`` of every view of ``src`` into block ``dst_ids[i]`` of ``dst``'s."""
    if not dst_ids:
        return
    if dst[0].device == src[0].device:  # a CPU pool: one gather and scatter per view
        dst_index, src_index = torch.tensor(dst_ids), torch.tensor(src_ids)
        for d, s in zip(dst, src):
            d.index_copy_(0, dst_index, s.index_select(0, src_index))
        return
    for d, s in zip(dst, src):
        for i, j in zip(dst_ids, src_ids):
            d[i].copy_(s[j], non_blocking=True)


class HostKVConnector(KVConnectorBase):
    """The host tier as a connector (engines/kv/connector.py): its scheduler side is the block manager's
    lookup of the blocks past its own hits (``external_blocks``, which asks ``contains``) and its
    record of the pool blocks it evicts; its worker side is ``transfer``."""

    def __init__(self, model: Any, block_size: int, bytes_per_block: int, size_gib: float, dtype: torch.dtype,
                 pin_memory: bool) -> None:
        self.capacity = int(size_gib * GIB) // bytes_per_block
        if self.capacity < 1:
            raise ValueError(f"kv_offloading_size {size_gib} GiB holds no KV block of {bytes_per_block} bytes")
        self.model = model
        self.pinned = pin_memory
        self.buffer = torch.empty(model.kv_cache_shape(self.capacity, block_size, dtype), dtype=dtype,
                                  pin_memory=pin_memory)
        self.views = block_views(model, self.buffer)
        # block hash -> (slot, the block's token ids); least recently used first
        self.index: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self.free_slots = list(range(self.capacity - 1, -1, -1))
        self.stored_blocks = 0
        self.loaded_blocks = 0
        self._matched: dict[int, list[int]] = {}  # seq id -> the hashes of its blocks found here, until allocated

    def get_num_new_matched_tokens(self, seq: Sequence, computed: list[int]) -> int:
        hashes = self.block_manager.external_blocks(seq, computed)
        if not hashes:
            self._matched.pop(seq.seq_id, None)
            return 0
        self._matched[seq.seq_id] = hashes
        return len(hashes) * self.block_manager.block_size

    def update_state_after_alloc(self, seq: Sequence, block_ids: list[int], num_external_tokens: int) -> None:
        hashes = self._matched.pop(seq.seq_id, [])
        self.block_manager.loads.extend(zip(hashes, block_ids))

    def request_finished(self, seq: Sequence, reason: str) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(seq.seq_id, None)  # matched, then never allocated (aborted while waiting)
        return False, None

    def build_connector_meta(self) -> tuple[list[tuple[int, int, tuple[int, ...]]], list[tuple[int, int]]]:
        """(evicted pool blocks to store, tier blocks to load) of the step."""
        return self.block_manager.take_transfers()

    def start_load_kv(self, meta: tuple[list[tuple[int, int, tuple[int, ...]]], list[tuple[int, int]]]) -> None:
        self.transfer(*meta, self.kv_cache)

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
        if not stores and not loads:
            return
        pool = block_views(self.model, kv_cache)
        loading = {self.index[h][0] for h, _ in loads}
        slots, blocks = [], []
        for block_hash, block_id, token_ids in stores:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
                continue
            slot = self._take_slot(loading)
            if slot is None:  # every slot is being loaded from: this block is dropped
                continue
            self.index[block_hash] = (slot, token_ids)
            slots.append(slot)
            blocks.append(block_id)
        copy_blocks(self.views, slots, pool, blocks)
        copy_blocks(pool, [block_id for _, block_id in loads], self.views, [self.index[h][0] for h, _ in loads])
        self.stored_blocks += len(slots)
        self.loaded_blocks += len(loads)

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


def make_host_tier(size_gib: float | None, runner: Any, block_size: int,
                   pin_memory: bool) -> HostKVConnector | None:
    """The engine's host tier (None without ``kv_offloading_size``), laid out like ``runner``'s KV pool;
    pinned where the platform says so (``Platform.pins_host_memory``: not when the device is the CPU itself)."""
    if size_gib is None:
        return None
    return HostKVConnector(runner.model, block_size, runner.bytes_per_block(), size_gib, runner.kv_cache.dtype,
                           pin_memory=pin_memory)

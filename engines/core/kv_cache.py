"""Paged KV cache bookkeeping: fixed-size blocks, ref counts and a prefix cache. No torch.

A block holds the KV of ``block_size`` consecutive tokens of one or more sequences (shared by
ref count). Once a block is full and computed it gets a hash chained over every token before it,
so a later prompt with the same prefix can reuse it. Freed blocks keep their hash and stay
reusable until they are handed out again, least recently freed first (LRU eviction).

Two optional observers of the cache: ``record_events`` keeps vLLM-style KV events (engines/kv/events.py)
for the engine to publish each step, and ``external`` is a second, larger tier (engines/kv/)
that takes the blocks this pool evicts and is looked up for the blocks past the pool's own hits.

``match_next_token`` (speculative method ``mtp``): a hit also needs the token after the block to be the
one its writer had, since the MTP layer's KV at a block's last position is computed from that token
(engines/models/mtp.py); another next token recomputes the block, never reads another sequence's draft
state. The external tier is not consulted then (its blocks do not keep their next token).
"""

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import Any

from xinserve.engines.core.sequence import Sequence
from xinserve.engines.kv.events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

NO_HASH = None
# The hash "before" a prompt's first block: a constant, so a prefix hashes the same in every process
# (hash(None) is not stable across processes before Python 3.12) and replicas agree in KV events.
ROOT_HASH = 0


class Block:
    __slots__ = ("block_id", "hash", "next_token", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = NO_HASH
        self.token_ids: tuple[int, ...] = ()
        self.next_token: int | None = None  # the token after the block when it was cached (match_next_token)


def chain_hash(prev_hash: int | None, token_ids: Seq[int]) -> int:
    """Hash of a full block given the hash of the block before it (None for the first)."""
    return hash((ROOT_HASH if prev_hash is None else prev_hash, tuple(token_ids)))


def root_hash(seq: Sequence) -> int:
    """The hash before a sequence's first block: ROOT_HASH, or its LoRA adapter's own root, so that a
    prefix-cache hit never crosses adapters (engines/lora/registry.py)."""
    return ROOT_HASH if seq.lora is None else seq.lora.root_hash


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False, external: Any = None, match_next_token: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks}x{block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.match_next_token = match_next_token
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front is evicted first. Values unused (ordered set).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found
        # KV events of the current step (None: not recorded); the engine takes them after each step.
        self.events: list[KVCacheEvent] | None = [] if record_events else None
        # The external tier: ``contains(block_hash, token_ids) -> bool`` (engines/kv/).
        self.external = external if enable_prefix_caching and not match_next_token else None
        # Of the current step, for the external tier: (hash, block id, tokens) of each cached block
        # evicted here (copy it out before the step overwrites it), and (hash, block id) of each block
        # to fill from the tier (before the step reads it).
        self.evicted: list[tuple[int, int, tuple[int, ...]]] = []
        self.loads: list[tuple[int, int]] = []
        self.external_queries = 0  # prompt tokens looked up in the external tier
        self.counts_external = False  # a KV connector other than the tier is looked up (engines/kv/connector.py)
        self.external_hits = 0  # of those, tokens it held past the pool's own hits

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """Blocks that already hold a prefix of a new sequence's tokens: the parent's prompt blocks
        for the extra choices of an n > 1 request, else prefix-cache hits. At least one token is
        always left to compute, so the last token's logits exist."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = seq.parent
        if parent is not None and not parent.is_finished:
            # Only blocks made wholly of prompt tokens are the same in every choice; past them the
            # parent's blocks hold the parent's own outputs (a preempted child resumes with its own).
            # (with match_next_token, a block whose next token is the parent's first output is not shared)
            prompt_blocks = (seq.num_prompt_tokens - self.match_next_token) // self.block_size
            shared = min(max_blocks, prompt_blocks, parent.num_computed_tokens // self.block_size,
                         len(parent.block_table))
            return parent.block_table[:shared]
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        prev_hash = root_hash(seq)
        for i in range(max_blocks):
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            prev_hash = chain_hash(prev_hash, tokens)
            block_id = self.hash_to_block.get(prev_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            if self.match_next_token and self.blocks[block_id].next_token != seq.token_ids[(i + 1) * self.block_size]:
                break
            hits.append(block_id)
        return hits

    def external_blocks(self, seq: Sequence, computed: list[int]) -> list[int]:
        """Hashes of the blocks right after ``computed`` that the external tier holds (a prefix this pool
        evicted): they are loaded instead of recomputed. Like ``computed_blocks`` it leaves at least
        one token to compute."""
        if self.external is None or seq.parent is not None:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        prev_hash = self.blocks[computed[-1]].hash if computed else root_hash(seq)
        hashes: list[int] = []
        for i in range(len(computed), max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            prev_hash = chain_hash(prev_hash, tokens)
            if not self.external.contains(prev_hash, tokens):
                break
            hashes.append(prev_hash)
        return hashes

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: list[int] | None = None,
                       external: list[int] | None = None) -> bool:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens (after ``computed`` cached blocks,
        which are adopted first, and the blocks of the ``external`` tier hashes, which are loaded).
        Returns False and changes nothing when there are not enough free blocks; the caller then
        preempts and retries."""
        if not computed and not external and (
                seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size):
            return True  # the usual decode step: its token fits in its last block, nothing to adopt or take
        computed = computed or []
        external = external or []
        num_cached = len(computed) + len(external)
        num_tokens = seq.num_computed_tokens + num_cached * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(seq.block_table) - len(computed)
        # Cached blocks nobody holds sit in the free queue: adopting them uses up free blocks too.
        num_revived = sum(1 for b in computed if self.blocks[b].ref_count == 0)
        if num_new_blocks + num_revived > len(self.free_blocks):
            return False
        for block_id in computed:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        first_new = len(seq.block_table)
        for _ in range(num_new_blocks):
            seq.block_table.append(self._take_free_block())
        # The loaded blocks count as computed now; they enter the prefix cache after the step, like
        # blocks computed by it (``cache_full_blocks``).
        self.loads.extend(zip(external, seq.block_table[first_new:]))
        seq.num_computed_tokens += num_cached * self.block_size
        return True

    def record_prefix_lookup(self, seq: Sequence, computed: list[int], external: Seq[int] = (),
                             external_tokens: int = 0) -> None:
        """Count a lookup once its sequence is admitted (a failed admission retries later). The external
        hits: the ``external`` tier's blocks, or ``external_tokens`` a KV connector loads."""
        if self.enable_prefix_caching and seq.parent is None:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(computed) * self.block_size
            if self.external is not None or self.counts_external:
                self.external_queries += seq.num_tokens
                self.external_hits += len(external) * self.block_size + external_tokens

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events recorded since the last call (none when not recording)."""
        events = self.events or []
        if self.events:
            self.events = []
        return events

    def take_transfers(self) -> tuple[list[tuple[int, int, tuple[int, ...]]], list[tuple[int, int]]]:
        """The external tier's work since the last call: (evicted blocks to store, blocks to load)."""
        transfers = self.evicted, self.loads
        self.evicted, self.loads = [], []
        return transfers

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (blocks held by running sequences stay theirs, uncached)."""
        for block in self.blocks:
            if block.ref_count == 0:
                block.hash, block.token_ids = NO_HASH, ()
        self.hash_to_block.clear()
        self.evicted.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not NO_HASH:
            # Evict: the least recently freed cached block is reused for new tokens.
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                if self.events is not None:
                    self.events.append(BlockRemoved([block.hash], MEDIUM_DEVICE))
                if self.external is not None:
                    self.evicted.append((block.hash, block_id, block.token_ids))
            block.hash = NO_HASH
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register the sequence's newly full, computed blocks in the prefix cache; ``num_computed``:
        at most this many tokens (async scheduling: a later step's rows are not computed yet)."""
        if not self.enable_prefix_caching:
            return
        computed = seq.num_computed_tokens if num_computed is None else min(num_computed, seq.num_computed_tokens)
        num_full = min(computed // self.block_size, len(seq.block_table))
        if num_full == 0 or self.blocks[seq.block_table[num_full - 1]].hash is not NO_HASH:
            return  # no full block since the last call (most decode steps)
        # Blocks are hashed in order, so walk back to the first unhashed one.
        first = num_full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash is NO_HASH:
            first -= 1
        prev_hash = self.blocks[seq.block_table[first - 1]].hash if first > 0 else root_hash(seq)
        lora_id = None if seq.lora is None else seq.lora.adapter_id  # vLLM's BlockStored.lora_id
        stored: BlockStored | None = None  # this call's event: one per run of newly cached blocks
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            tokens = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            parent_hash = prev_hash if i > 0 else None  # None at the start of a prompt, as in vLLM
            block.hash = chain_hash(prev_hash, tokens)
            block.token_ids = tuple(tokens)
            end = (i + 1) * self.block_size
            block.next_token = seq.token_ids[end] if end < seq.num_tokens and seq.token_ids[end] >= 0 else None
            prev_hash = block.hash
            if self.hash_to_block.setdefault(block.hash, block.block_id) != block.block_id or self.events is None:
                stored = None  # already cached in another block: not stored again
                continue
            if stored is None:
                stored = BlockStored([], parent_hash, [], self.block_size, lora_id, MEDIUM_DEVICE)
                self.events.append(stored)
            stored.block_hashes.append(block.hash)
            stored.token_ids.extend(tokens)

    def trim(self, seq: Sequence) -> None:
        """Free the sequence's tail blocks that hold no computed token (the slots of rejected draft
        tokens); a block with any verified token stays."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:  # it caches nothing: handed out before any cached block
                self.free_blocks[block.block_id] = None
                self.free_blocks.move_to_end(block.block_id, last=False)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, tail first, so the tail is evicted before the prefix."""
        self.release(seq.block_table)
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def detach(self, seq: Sequence) -> list[int]:
        """Take the sequence's blocks from it without freeing them (a KV connector holds them until
        another instance has read them); ``release`` frees them later."""
        block_ids = list(seq.block_table)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        return block_ids

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block, tail first (``free``'s order)."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None

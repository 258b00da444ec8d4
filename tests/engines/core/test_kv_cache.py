from xinserve.engines.core.kv_cache import BlockManager
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.sequence import Sequence


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams())


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    computed = bm.computed_blocks(seq)
    num_new = seq.num_tokens - len(computed) * bm.block_size
    assert bm.allocate_slots(seq, num_new, computed)
    bm.record_prefix_lookup(seq, computed)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)
    return computed


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.usage == 3 / 8
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and bm.usage == 0


def test_allocation_fails_without_side_effects_when_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not bm.allocate_slots(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_prefix_cache_hits_full_blocks_and_rechecks_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)), 0)
    assert admit(bm, a) == []
    b = make_seq(list(range(8)) + [99, 98, 97], 1)
    hits = admit(bm, b)
    assert hits == a.block_table[:2]
    assert bm.blocks[hits[0]].ref_count == 2
    assert bm.prefix_cache_queries == 21 and bm.prefix_cache_hits == 8
    # Same first block hash chain but a different second block: only the first one hits.
    c = make_seq(list(range(4)) + [5, 5, 5, 5, 1], 2)
    assert admit(bm, c) == a.block_table[:1]


def test_a_fully_cached_prompt_still_computes_its_last_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(8)), 0)
    admit(bm, a)
    b = make_seq(list(range(8)), 1)
    assert bm.computed_blocks(b) == a.block_table[:1]


def test_freed_cached_blocks_are_reused_then_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 5, 6, 7], 0)  # 4 blocks, first 3 full and cached
    admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4
    # The cached blocks survive freeing and are found again.
    b = make_seq([1, 2, 3, 4, 9], 1)
    assert bm.computed_blocks(b) == table[:2]
    # Taking one fresh block evicts the tail of the freed sequence first (freed in reverse).
    c = make_seq([42], 2)
    assert bm.allocate_slots(c, 1)
    assert c.block_table == [table[3]]
    d = make_seq([43, 44, 45], 3)
    assert bm.allocate_slots(d, 3)
    assert d.block_table == [table[2], table[1]]
    # table[2] and table[1] were cached; handing them out dropped them from the cache.
    assert bm.computed_blocks(make_seq([1, 2, 3, 4, 5, 6, 9], 4)) == table[:1]


def test_adopting_a_free_cached_block_counts_against_free_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = make_seq([1, 2, 3, 4, 5], 0)
    admit(bm, a)
    bm.free(a)
    b = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], 1)  # needs 5 blocks, more than the pool
    computed = bm.computed_blocks(b)
    assert len(computed) == 2
    assert not bm.allocate_slots(b, 5, computed)
    assert bm.num_free_blocks == 3 and b.block_table == [] and b.num_computed_tokens == 0


def test_child_shares_parent_prompt_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_seq(list(range(10)), 0)
    admit(bm, parent)
    child = Sequence(1, "r0", list(range(10)), SamplingParams(), index=1, parent=parent)
    shared = bm.computed_blocks(child)
    assert shared == parent.block_table[:2]
    assert bm.allocate_slots(child, 2, shared)
    assert child.num_computed_tokens == 8 and child.block_table[:2] == shared
    assert bm.blocks[shared[0]].ref_count == 2
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_preempted_child_adopts_only_the_parents_prompt_blocks():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    parent = make_seq(list(range(10)), 0)
    admit(bm, parent)
    parent.token_ids += [100, 101, 102, 103, 104, 105]  # the parent's own outputs: 16 tokens
    bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 16
    # A child re-admitted after preemption with outputs of its own (different from the parent's).
    child = Sequence(1, "r0", list(range(10)), SamplingParams(), index=1, parent=parent)
    child.token_ids += [200, 201, 202, 203, 204]
    assert bm.computed_blocks(child) == parent.block_table[:2]  # 8 prompt tokens, none of 100..105

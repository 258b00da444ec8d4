"""The host KV tier (``kv_offloading_size``): blocks the device pool evicts are kept in host memory and
loaded back on a later prefix hit, with greedy output identical to a cold run; LRU within the tier;
nothing served after the prefix cache is reset; MLA's latent cache too."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from xinserve.engines import LLM, SamplingParams
from xinserve.engines.core.kv_cache import BlockManager, chain_hash
from xinserve.engines.kv.host_tier import HostKVConnector

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i) % 250 + 3 for i in range(70)]  # 4 full blocks of 16, 6 tokens more


def others(seed: int) -> list[list[int]]:
    """Two prompts of 7 blocks each, unlike any other: run after PROMPT, they evict its blocks."""
    return [[(11 * i + seed + k) % 250 + 3 for i in range(100)] for k in (0, 100)]


def dense_shape(num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> tuple[int, ...]:
    return (2, 3, num_blocks, block_size, 2, 4)  # [2, layers, blocks, block_size, kv_heads, head_dim]


def test_the_tier_stores_evictions_lru_and_never_reuses_a_slot_being_loaded():
    model = SimpleNamespace(kv_cache_shape=dense_shape, model=SimpleNamespace(
        layer_caches=lambda kv: zip(kv[0].unbind(0), kv[1].unbind(0))))  # the dense models' views
    pool = torch.arange(2 * 3 * 4 * 2 * 2 * 4, dtype=torch.float32).reshape(dense_shape(4, 2))
    tier = HostKVConnector(model, 2, bytes_per_block=2 * 3 * 2 * 2 * 4 * 4, size_gib=2.5 * 384 / (1 << 30),
                           dtype=torch.float32, pin_memory=False)
    assert tier.capacity == 2
    tier.transfer([(101, 0, (1, 2)), (102, 1, (3, 4))], [], pool)
    assert tier.contains(101, (1, 2)) and not tier.contains(101, (9, 9))  # tokens re-checked
    block1 = pool[:, :, 1].clone()
    tier.transfer([(103, 2, (5, 6))], [], pool)  # full: 102 (least recently used) goes
    assert not tier.contains(102, (3, 4)) and tier.contains(103, (5, 6))
    # A store in the same transfer as a load never takes the loaded slot, and runs first.
    tier.transfer([(104, 3, (7, 8))], [(101, 1)], pool)
    assert torch.equal(pool[:, :, 1], pool[:, :, 0]) and not torch.equal(pool[:, :, 1], block1)
    assert tier.contains(101, (1, 2)) and tier.contains(104, (7, 8)) and not tier.contains(103, (5, 6))
    tier.clear()
    assert not tier.contains(101, (1, 2))


def test_the_block_manager_loads_tier_hits_past_its_own_and_counts_them():
    held: dict[int, tuple[int, ...]] = {}
    bm = BlockManager(num_blocks=4, block_size=2, external=SimpleNamespace(
        contains=lambda h, tokens: held.get(h) == tokens))
    h1 = chain_hash(None, [1, 2])
    held[h1], held[chain_hash(h1, [3, 4])] = (1, 2), (3, 4)
    from tests.engines.core.test_kv_cache import make_seq

    seq = make_seq([1, 2, 3, 4, 5])
    external = bm.external_blocks(seq, [])
    assert len(external) == 2
    assert bm.allocate_slots(seq, 1, [], external)
    assert seq.num_computed_tokens == 4 and bm.take_transfers() == ([], list(zip(external, seq.block_table)))
    bm.record_prefix_lookup(seq, [], external)
    assert (bm.external_queries, bm.external_hits) == (5, 4)


def evict_prompt(llm: LLM, seed: int) -> None:
    for other in others(seed):
        llm.generate(other, GREEDY)
    assert not llm.engine.block_manager.computed_blocks(llm_seq(PROMPT)), "evicted from the pool"


@pytest.mark.parametrize(("arch", "kv_cache_dtype"), [("llama", "auto"), ("deepseek_v3", "auto"), ("llama", "int8")])
def test_an_evicted_prompt_is_served_from_the_tier_as_a_cold_run_would_be(tiny_models, arch: str, kv_cache_dtype: str):
    """An 8-bit pool's blocks go to the tier and back with their scales (the last 4 bytes of each row)."""
    with LLM(tiny_models(arch), num_kv_blocks=8, block_size=16, kv_offloading_size=0.01,
             kv_cache_dtype=kv_cache_dtype) as llm:
        engine = llm.engine
        cold = llm.generate(PROMPT, GREEDY)[0].token_ids
        evict_prompt(llm, 1)
        before = engine.stats()
        warm = llm.generate(PROMPT, GREEDY)[0].token_ids
        after = engine.stats()
        assert warm == cold
        assert after.external_prefix_cache_hits_total - before.external_prefix_cache_hits_total == 4 * 16
        assert after.external_prefix_cache_queries_total - before.external_prefix_cache_queries_total == 70
        assert after.prefix_cache_hits_total == before.prefix_cache_hits_total  # not the pool's own hits

        if arch != "llama" or kv_cache_dtype != "auto":
            return
        # The loaded blocks are what was computed: corrupting the tier changes the output.
        evict_prompt(llm, 2)
        engine.kv_tier.buffer.normal_()
        assert llm.generate(PROMPT, GREEDY)[0].token_ids != cold


def test_nothing_is_served_from_the_tier_after_the_prefix_cache_is_reset(tiny_model_dir: Path):
    with LLM(tiny_model_dir, num_kv_blocks=8, block_size=16, kv_offloading_size=0.01) as llm:
        engine = llm.engine
        cold = llm.generate(PROMPT, GREEDY)[0].token_ids
        evict_prompt(llm, 1)
        llm.reset_prefix_cache()
        engine.kv_tier.buffer.normal_()  # what the tier held is garbage now: it must not be read
        hits = engine.stats().external_prefix_cache_hits_total
        assert llm.generate(PROMPT, GREEDY)[0].token_ids == cold
        assert engine.stats().external_prefix_cache_hits_total == hits


def test_the_tier_needs_the_prefix_cache_and_one_replica_rank():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM("/nonexistent", kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("/nonexistent", kv_offloading_size=1, tensor_parallel_size=2)


def llm_seq(tokens: list[int]):
    from tests.engines.core.test_kv_cache import make_seq

    return make_seq(tokens)

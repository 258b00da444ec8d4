"""The prefix cache keys include the adapter: a sequence's block hash chain starts from its adapter's root
(base sequences from ROOT_HASH, as before), so a hit never crosses adapters while n > 1 choices still share
their parent's blocks; KV events carry the adapter's id as vLLM's BlockStored.lora_id."""

from xinserve.engines.core.kv_cache import ROOT_HASH, BlockManager, chain_hash
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.kv.events import BlockStored
from xinserve.engines.lora.registry import AdapterRef, root_hash

A = AdapterRef(1, "a", "/adapters/a", root_hash("a", "/adapters/a"))
B = AdapterRef(2, "b", "/adapters/b", root_hash("b", "/adapters/b"))
PROMPT = list(range(10, 19))  # two full blocks of 4, one token left to compute


def cached(bm: BlockManager, seq_id: int, lora: AdapterRef | None) -> Sequence:
    """A sequence whose prompt was computed and cached under ``lora``."""
    seq = Sequence(seq_id, f"r{seq_id}", PROMPT, SamplingParams())
    seq.lora = lora
    assert bm.allocate_slots(seq, len(PROMPT), bm.computed_blocks(seq))
    seq.num_computed_tokens = len(PROMPT)
    bm.cache_full_blocks(seq)
    return seq


def lookup(bm: BlockManager, lora: AdapterRef | None) -> list[int]:
    seq = Sequence(99, "q", PROMPT, SamplingParams())
    seq.lora = lora
    return bm.computed_blocks(seq)


def test_a_prefix_hits_only_under_the_adapter_it_was_cached_with():
    bm = BlockManager(16, 4, record_events=True)
    base = cached(bm, 0, None)
    assert bm.blocks[base.block_table[0]].hash == chain_hash(ROOT_HASH, PROMPT[:4])  # the base chain is unchanged
    assert lookup(bm, A) == [] and lookup(bm, B) == []
    with_a = cached(bm, 1, A)
    assert lookup(bm, A) == with_a.block_table[:2]
    assert lookup(bm, None) == base.block_table[:2]
    assert lookup(bm, B) == []
    events = [e for e in bm.take_events() if isinstance(e, BlockStored)]
    assert [(e.lora_id, e.parent_block_hash) for e in events] == [(None, None), (1, None)]
    assert events[1].block_hashes[0] == chain_hash(A.root_hash, PROMPT[:4])


def test_extra_choices_share_their_parents_blocks_under_its_adapter():
    bm = BlockManager(16, 4)
    parent = cached(bm, 0, A)
    child = Sequence(1, "r0", PROMPT, SamplingParams(n=2), index=1, parent=parent)
    child.lora = A
    assert bm.computed_blocks(child) == parent.block_table[:2]


def test_adapter_roots_are_stable_distinct_and_never_the_base_root(tmp_path):
    assert root_hash("a", "/adapters/a") == A.root_hash
    assert len({ROOT_HASH, A.root_hash, B.root_hash, root_hash("a", "/adapters/b")}) == 4
    (tmp_path / "adapter_model.safetensors").write_bytes(b"1")
    first = root_hash("a", str(tmp_path))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"22")  # retrained files: another root
    assert root_hash("a", str(tmp_path)) != first

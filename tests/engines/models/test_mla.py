"""Multi-head latent attention models (DeepSeek-V3, DeepSeek-V3.2 and GLM-5 with the DSA indexer) on
the paged latent cache: greedy tokens equal transformers' under batching, prefix caching, preemption
and chunked prefill; the absorbed decode equals the up-projected form; the pool is sized from the
model's cache spec."""

import random

import numpy as np
import pytest
import torch

from tests.engines.test_llm_vs_transformers import MAX_TOKENS, Reference, check_against_reference
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.models.mla import MLAAttention
from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather
from xinserve.kernels.probes.inputs import scrambled_block_tables
from xinserve.kernels.references.mla import indexer_topk
from xinserve.server.embedded_model.factory import make_config

INDEX_TOPK = 12  # server/embedded_model/factory.py's DSA models keep 12 positions per query
# name -> tiny_models arguments (3 layers, the first dense; 8 experts top-2 in 2 groups; kv_lora_rank
# 32, q_lora_rank 48, qk_rope_head_dim 8)
MODELS = {
    "deepseek_v3": ("deepseek_v3", {}),
    # no query compression, rotate-half rotary and YaRN whose mscale_all_dim scales the softmax
    "deepseek_v3_plain_q_yarn": ("deepseek_v3", {
        "q_lora_rank": None, "rope_interleave": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 512}}),
    "deepseek_v32": ("deepseek_v32", {}),
    "glm_moe_dsa": ("glm_moe_dsa", {}),
    # GLM-5's cross-layer sharing: layer 1 has no indexer and attends where layer 0 selected
    "glm_moe_dsa_shared": ("glm_moe_dsa", {"indexer_types": ["full", "shared", "full"]}),
}


def prompts_for(vocab_size: int) -> list[list[int]]:
    """Two prompts shorter than index_topk (their decodes cross it), then four that share a 17-token
    prefix (prefix-cache hits) and reach 20-37 tokens (the indexer drops positions)."""
    rng = random.Random(11)
    short = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (4, 9)]
    prefix = [rng.randrange(3, vocab_size) for _ in range(17)]
    shared = [prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 20))] for _ in range(4)]
    return short + shared


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_greedy_equals_transformers_batched_prefix_cached_preempted_chunked(tiny_models, name):
    arch, kwargs = MODELS[name]
    path = tiny_models(arch, **kwargs)
    reference = Reference(path)
    prompts = prompts_for(reference.vocab_size)
    # batched, the long prompts after a first one that fills the prefix cache
    cached = LLM(path, num_kv_blocks=256, block_size=4, enable_prefix_caching=True)
    check_against_reference(cached, reference, prompts[2:3])
    check_against_reference(cached, reference, prompts[:2] + prompts[3:])
    assert cached.engine.stats().prefix_cache_hits_total >= 3 * 16  # 4 whole blocks of the prefix each
    # a pool too small for the batch: sequences are preempted and recomputed
    tight = LLM(path, num_kv_blocks=24, block_size=4, enable_prefix_caching=False)
    check_against_reference(tight, reference, prompts[3:])
    assert tight.engine.stats().num_preemptions_total > 0
    # chunked prefill: a 16-token budget, so long prompts are prefilled over cached chunks
    chunked = LLM(path, num_kv_blocks=256, block_size=4, max_num_batched_tokens=16)
    check_against_reference(chunked, reference, prompts)
    assert all(len(reference.generate(p)) == MAX_TOKENS for p in prompts)


def mixed_prompts(vocab_size: int) -> list[list[int]]:
    """12 prompts of 3-40 tokens, then 4 that share a 12-token prefix (3 blocks of 4): a prefix token
    sees at most index_topk positions, so it selects all of them, ties or not, and its cached latent
    equals what transformers computes inside each prompt."""
    rng = random.Random(11)
    mixed = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 40))] for _ in range(12)]
    prefix = [rng.randrange(3, vocab_size) for _ in range(INDEX_TOPK)]
    return mixed + [prefix + [rng.randrange(3, vocab_size) for _ in range(rng.randint(5, 25))] for _ in range(4)]


@pytest.mark.parametrize("heads", [2, 4])
def test_few_indexer_heads_break_score_ties_as_transformers_does(tiny_models, heads):
    """With 2 or 4 indexer heads many positions score exactly 0 (every head's relu is 0), and which tied
    positions torch.topk keeps depends on the length of the row it ranks. transformers' generate (our
    reference, with its cache) ranks a prompt token over the whole prompt and a generated token over
    exactly its context; its uncached forward ranks every token over the whole sequence and so can
    disagree with its own cached path. Batched (decode rows of different lengths), chunked prefill,
    prefix-cached and preempted (recomputed) schedules all rank as the cached path does. Before: 3 of
    12 mixed prompts matched batched or chunked with 2 heads."""
    path = tiny_models("glm_moe_dsa", index_n_heads=heads)
    reference = Reference(path)
    prompts = mixed_prompts(reference.vocab_size)
    check_against_reference(LLM(path, num_kv_blocks=256, block_size=4), reference, prompts[:12])
    chunked = LLM(path, num_kv_blocks=256, block_size=4, max_num_batched_tokens=16)
    check_against_reference(chunked, reference, prompts[:12])
    cached = LLM(path, num_kv_blocks=256, block_size=4, enable_prefix_caching=True)
    check_against_reference(cached, reference, prompts[12:13])
    check_against_reference(cached, reference, prompts[13:])
    assert cached.engine.stats().prefix_cache_hits_total >= 3 * INDEX_TOPK
    tight = LLM(path, num_kv_blocks=24, block_size=4, enable_prefix_caching=False)
    check_against_reference(tight, reference, prompts[12:])
    assert tight.engine.stats().num_preemptions_total > 0


@pytest.mark.parametrize(("name", "indexer_layers"), [("deepseek_v3", 0), ("glm_moe_dsa", 3),
                                                    ("glm_moe_dsa_shared", 2)])
def test_pool_bytes_per_block_are_the_latent_plus_the_indexer_keys(tiny_models, name, indexer_layers):
    arch, kwargs = MODELS[name]
    llm = LLM(tiny_models(arch, **kwargs), num_kv_blocks=10, block_size=4)
    runner, config = llm.engine.runner, llm.engine.runner.hf_config
    latent = config.kv_lora_rank + config.qk_rope_head_dim  # 32 + 8, no head dimension
    # 3 layers x 4 tokens x the latent, plus 4 tokens of each indexer layer's keys, float32
    expected = (3 * 4 * latent + indexer_layers * 4 * (config.index_head_dim if indexer_layers else 0)) * 4
    assert config.num_hidden_layers == 3 and latent == 40
    assert runner.bytes_per_block() == expected
    # ten blocks plus the scratch block where padded decode rows write (engines/worker/decode_buckets.py)
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == 11 * expected


def test_dense_pool_layout_is_unchanged(tiny_models):
    llm = LLM(tiny_models("llama"), num_kv_blocks=10, block_size=4)
    runner, config = llm.engine.runner, llm.engine.runner.hf_config
    head_dim = config.hidden_size // config.num_attention_heads
    # ten blocks plus the scratch block
    assert runner.kv_cache.shape == (2, config.num_hidden_layers, 11, 4, config.num_key_value_heads, head_dim)
    assert runner.bytes_per_block() == 2 * config.num_hidden_layers * 4 * config.num_key_value_heads * head_dim * 4


@pytest.mark.parametrize("name", ["deepseek_v3_plain_q_yarn", "deepseek_v32", "glm_moe_dsa_shared"])
def test_greedy_equals_transformers_batched_and_chunked(tiny_models, name):
    """The other variants (no q_lora_rank with rotate-half YaRN; DeepSeek-V3.2's indexer; GLM-5 with
    a shared indexer layer) in one batch whose prefills are chunked, so decodes and prefill chunks
    share steps."""
    arch, kwargs = MODELS[name]
    path = tiny_models(arch, **kwargs)
    reference = Reference(path)
    check_against_reference(LLM(path, num_kv_blocks=256, block_size=4, max_num_batched_tokens=12), reference,
                            prompts_for(reference.vocab_size))


def _random_attention(seed: int) -> MLAAttention:
    config = make_config("deepseek_v3", vocab_size=100, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(seed)
    attention = MLAAttention(config, ops=_reference_ops(), rope_is_neox=False, indexer=None)
    for param in attention.parameters():
        param.data.normal_(0, 0.3)
    return attention


def _reference_ops():
    from xinserve.kernels.ops import REFERENCE_OPS
    return REFERENCE_OPS


def _metadata(lens: list[int], tables: np.ndarray, decode: bool) -> AttentionMetadata:
    """One new token per sequence (the last of each context), as a decode batch or as P one-token
    prefill chunks after a cached prefix."""
    block_size = 4
    seq_lens = np.array(lens, dtype=np.int32)
    slots = np.array([tables[i, (n - 1) // block_size] * block_size + (n - 1) % block_size
                      for i, n in enumerate(lens)], dtype=np.int64)
    return AttentionMetadata(
        slot_mapping=torch.from_numpy(slots), block_tables=torch.from_numpy(tables),
        seq_lens=torch.from_numpy(seq_lens), num_decode_seqs=len(lens) if decode else 0,
        prefill_query_start_loc=[] if decode else list(range(len(lens) + 1)),
        prefill_seq_lens=[] if decode else list(lens),
        decode_gather=build_decode_gather(tables, seq_lens, block_size, torch.device("cpu")) if decode else None,
    )


@pytest.mark.parametrize("sparse", [False, True])
def test_absorbed_decode_equals_up_projected_attention(sparse):
    """W_UK absorbed into the query and W_UV applied after attention over the latents gives what
    up-projecting every cached latent to per-head keys and values gives, on random weights, latents
    and queries; with a DSA-style selection, on the selected positions only."""
    attention = _random_attention(seed=3)
    lens = [1, 5, 13, 30]
    tables = scrambled_block_tables(lens, 4, 40, seed=1)
    gen = torch.Generator().manual_seed(0)
    latent_cache = torch.randn(40, 4, 40, generator=gen)  # [N, BS, kv_lora_rank + qk_rope_head_dim]
    q_nope = torch.randn(len(lens), 4, 16, generator=gen)
    q_rope = torch.randn(len(lens), 4, 8, generator=gen)
    selected = None
    if sparse:  # up to 6 random positions of each context (all of a shorter one), -1 padded
        rows = [torch.randperm(n, generator=gen)[:6] for n in lens]
        selected = torch.stack([torch.cat((r, torch.full((6 - len(r),), -1))) for r in rows])
    absorbed = attention.absorbed_decode(q_nope, q_rope, latent_cache, _metadata(lens, tables, True), selected)
    naive = attention.up_projected_prefill(torch.cat((q_nope, q_rope), dim=-1), latent_cache,
                                           _metadata(lens, tables, False), selected)
    assert absorbed.shape == naive.shape == (len(lens), 4, 16)
    torch.testing.assert_close(absorbed, naive, rtol=1e-4, atol=1e-4)
    if sparse:  # the selection matters: attending everywhere gives another answer
        everywhere = attention.absorbed_decode(q_nope, q_rope, latent_cache, _metadata(lens, tables, True), None)
        assert not torch.allclose(everywhere[2:], absorbed[2:], atol=1e-3)


def test_indexer_topk_keeps_the_best_visible_positions_and_pads_short_contexts():
    """A decode and a chunked prefill in one step: each token gets the top-K of the positions at or
    before its own by the weighted relu score, -1 past a context shorter than K."""
    lens, topk = [5, 20], 8
    tables = scrambled_block_tables(lens, 4, 16, seed=2)
    gen = torch.Generator().manual_seed(1)
    index_cache = torch.randn(16, 4, 6, generator=gen)
    query = torch.randn(1 + 3, 2, 6, generator=gen)  # the decode token, then a 3-token chunk
    weights = torch.randn(4, 2, generator=gen)
    seq_lens = np.array(lens, dtype=np.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(4, dtype=torch.int64), block_tables=torch.from_numpy(tables),
        seq_lens=torch.from_numpy(seq_lens), num_decode_seqs=1, prefill_query_start_loc=[0, 3],
        prefill_seq_lens=[20], decode_gather=build_decode_gather(tables[:1], seq_lens[:1], 4, torch.device("cpu")),
    )
    got = indexer_topk(query, weights, index_cache, metadata, topk, scale=0.5)
    keys = [index_cache[torch.from_numpy(tables[i]).long()].reshape(-1, 6)[:n] for i, n in enumerate(lens)]
    for row, (seq, position) in enumerate([(0, 4), (1, 17), (1, 18), (1, 19)]):
        visible = keys[seq][: position + 1]
        scores = (torch.relu(query[row] @ visible.T * 0.5) * weights[row][:, None]).sum(0)
        chosen = got[row][got[row] >= 0]
        assert len(set(chosen.tolist())) == len(chosen) and chosen.max() <= position
        # compared by score: positions that tie (every head's relu at 0) are interchangeable
        expected = scores.topk(min(topk, position + 1)).values
        torch.testing.assert_close(scores[chosen].sort().values, expected.sort().values)
        assert (got[row] == -1).sum() == max(0, topk - position - 1)


def test_compiled_dsa_decode_carries_the_selection_without_graph_breaks(tiny_models, monkeypatch):
    """GLM-5 with a layer that reuses the previous layer's DSA selection: the decode compiles into one
    graph (the per-step MLAStep that carries the selection from layer to layer traces; the compile child
    compiles with fullgraph=True, so a graph break would leave the bucket failed) and its greedy tokens
    equal eager's."""
    import xinserve.engines.worker.graphs

    path = tiny_models("glm_moe_dsa", indexer_types=["full", "shared", "full"], max_position_embeddings=64)
    options = {"block_size": 4, "num_kv_blocks": 40, "max_num_seqs": 2, "max_model_len": 64}
    monkeypatch.setattr(xinserve.engines.worker.graphs, "bucket_sizes", lambda max_num_seqs: [2])  # one bucket: compiles cost
    compiled = LLM(path, compile="on", warm_up_in_background=False, **options)
    assert compiled.engine.warmup.report()["buckets"] == {"2": {"state": "compiled", "error": None}}
    eager = LLM(path, compile="off", **options)
    batch = prompts_for(compiled.engine.vocab_size)[:2]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [r.token_ids for r in compiled.generate(batch, greedy)] == [r.token_ids for r in eager.generate(batch,
                                                                                                           greedy)]
    assert compiled.engine.runner.decode_graphs.steps_run >= greedy.max_tokens - 1

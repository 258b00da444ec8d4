"""Pipeline parallelism on CPU ranks (gloo): greedy tokens equal transformers' for a dense and an MoE
model at PP 2 and for TP 2 x PP 2 (dense, and MoE with expert parallelism) on 4 ranks, under batching, preemption,
prefix hits and chunked prefill, and for GLM-5 (MLA + DSA, each stage's latent pool its own layers')
at PP 2; two micro-batches are in flight per step; each rank reports its
role; bad splits name the model."""

import pytest
import torch

from tests.engines.test_llm_vs_transformers import GREEDY, Reference, assert_all_blocks_free, random_prompts
from xinserve.engines import LLM
from xinserve.engines.model_loader import load_model
from xinserve.engines.parallel.micro_batch import micro_batches
from xinserve.engines.parallel.pipeline_parallel import PipelineStage, StageLayout, stage_layers
from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather

CASES = {
    "llama_pp2": ("llama", {"num_layers": 3}, 1, 2, False),  # 3 layers: stage 0 holds two
    "glm4_moe_pp2": ("glm4_moe", {}, 1, 2, False),  # a dense first layer on stage 0, experts on stage 1
    "llama_tp2_pp2": ("llama", {"num_layers": 3}, 2, 2, False),
    "qwen3_moe_tp2_pp2_ep": ("qwen3_moe", {}, 2, 2, True),
    # GLM-5: MLA with the latent pool of each stage's layers, the DSA indexer on layers 0 and 2, layer 1
    # reusing layer 0's selection on the same stage (TP 2 x PP 2 passes too, in about 4 minutes on 2 cores)
    "glm_moe_dsa_pp2": ("glm_moe_dsa", {"indexer_types": ["full", "shared", "full"]}, 1, 2, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stages_match_transformers_with_preemption_prefix_caching_and_chunks(tiny_models, case):
    arch, kwargs, tp, pp, ep = CASES[case]
    path = tiny_models(arch, **kwargs)
    ref = Reference(path)
    prefix = random_prompts(1, ref.vocab_size, seed=3, lengths=(12, 12))[0]
    prompts = (random_prompts(6, ref.vocab_size, seed=2, lengths=(10, 30))
               + random_prompts(5, ref.vocab_size, seed=4, lengths=(1, 9), prefix=prefix))
    with LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep,
             num_kv_blocks=24, block_size=4, max_num_batched_tokens=8) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
        counts = llm.engine.runner.group.counts
        ranks = llm.engine.runner.ranks()
        assert_all_blocks_free(llm)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == ref.generate(prompt), f"prompt of {len(prompt)} tokens diverged"
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    # more sends than steps: steps with several sequences ran as two micro-batches
    assert counts["send"] > counts["broadcast"]
    assert [(r["role"]["pp_stage"], r["role"]["tp_rank"]) for r in ranks] == [(s, t) for s in range(pp) for t in range(tp)]
    if arch in ("llama", "glm_moe_dsa"):
        assert [r["role"]["layers"] for r in ranks] == [layers for layers in ("0-1", "2-2") for _ in range(tp)]
    if ep:
        assert [r["role"]["expert_range"] for r in ranks] == ["0-3", "4-7", "0-3", "4-7"]


def _step(decode_lens: list[int], prefill: list[tuple[int, int]], block_size: int = 4) -> tuple:
    """A step's tensors: decodes of those context lengths, then prefills of (new tokens, context)."""
    lens = decode_lens + [ctx for _, ctx in prefill]
    width = max(-(-n // block_size) for n in lens)
    tables = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    qsl = [0]
    for new, _ in prefill:
        qsl.append(qsl[-1] + new)
    t = len(decode_lens) + qsl[-1]
    d = len(decode_lens)
    gather = build_decode_gather(tables[:d].numpy(), torch.tensor(decode_lens).numpy(), block_size,
                                 torch.device("cpu")) if d else None
    metadata = AttentionMetadata(torch.arange(t), tables, torch.tensor(lens, dtype=torch.int32), d, qsl,
                                 [ctx for _, ctx in prefill], gather, [ctx for _, ctx in prefill])
    return torch.arange(100, 100 + t), torch.arange(t), metadata


def test_micro_batches_cut_whole_sequences_and_balance_tokens():
    ids, pos, m = _step([5, 9, 3], [(6, 6), (2, 10)])  # 3 decode tokens, then 6 and 2 prefill tokens
    first, second = micro_batches(ids, pos, m)
    assert (first.rows, second.rows) == ((0, 3), (3, 11))  # 3 | 8 tokens: closer than 9 | 2
    assert first.metadata.num_decode_seqs == 3 and first.metadata.prefill_query_start_loc == [0]
    assert first.metadata.decode_gather is m.decode_gather or torch.equal(first.metadata.decode_gather.block_ids,
                                                                          m.decode_gather.block_ids)
    assert torch.equal(torch.cat([first.input_ids, second.input_ids]), ids)
    assert second.metadata.num_decode_seqs == 0 and second.metadata.prefill_seq_lens == [6, 10]
    assert second.metadata.prefill_query_start_loc == [0, 6, 8]
    assert torch.equal(second.metadata.slot_mapping, m.slot_mapping[3:])
    ids, pos, m = _step([5, 9, 3, 7], [])
    first, second = micro_batches(ids, pos, m)
    assert first.metadata.num_decode_seqs == 2 and second.metadata.num_decode_seqs == 2
    per_seq = len(m.decode_gather.block_ids) // 4
    assert torch.equal(second.metadata.decode_gather.block_ids, m.decode_gather.block_ids[2 * per_seq :])
    assert torch.equal(second.metadata.decode_gather.mask, m.decode_gather.mask[2:])
    (only,) = micro_batches(*_step([4], [])[:2], _step([4], [])[2])  # one sequence: one micro-batch
    assert only.rows == (0, 1)


def test_bad_pipelines_name_the_model(tiny_models):
    assert stage_layers(5, 2, "m") == [range(3), range(3, 5)]
    with pytest.raises(ValueError, match=r"LlamaForCausalLM at .*pipeline_parallel_size 3 does not fit: 2 layers "
                                         r"cannot be split over 3 stages"):
        LLM(tiny_models("llama"), pipeline_parallel_size=3)
    shared_at_stage_start = tiny_models("glm_moe_dsa", indexer_types=["full", "full", "shared"])
    with pytest.raises(ValueError, match=r"GlmMoeDsaForCausalLM at .*: pipeline stage layers 2-2 start with a DSA "
                                         r"layer that reuses the previous stage's top-k selection"):
        load_model(str(shared_at_stage_start), None, torch.device("cpu"),
                   pipeline=PipelineStage(None, StageLayout.of(1, 1, 2)))

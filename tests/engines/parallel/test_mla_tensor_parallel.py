"""Multi-head latent attention under tensor parallelism (engines/models/tensor_parallel.py): greedy
tokens equal transformers' at TP 2 and TP 4 on CPU ranks with batching, preemption, prefix hits and
chunked prefill in one engine each (starting ranks costs seconds); each rank loads exactly its heads
of q / kv_b / o_proj, the latent projections and the DSA indexer whole; its pool keeps the whole
latent per token."""

import pytest
import torch
from transformers import AutoConfig

from tests.engines.models.test_mla import MODELS, prompts_for
from tests.engines.parallel.test_tensor_parallel import LoadOnly, RecordingSafeOpen, checkpoint
from tests.engines.test_llm_vs_transformers import MAX_TOKENS, Reference, assert_all_blocks_free
from xinserve.engines import LLM, SamplingParams
from xinserve.engines import model_loader as loader
from xinserve.engines.core.capacity import Layout, plan
from xinserve.engines.model_loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize(("name", "tp"), [
    ("glm_moe_dsa_shared", 2),  # q_b_proj, the DSA indexer on layers 0 and 2, layer 1 reusing its selection
    ("deepseek_v3_plain_q_yarn", 4),  # one head per rank, q_proj without a query latent, YaRN
])
def test_ranks_match_transformers_with_preemption_prefix_caching_and_chunks(tiny_models, name, tp):
    arch, kwargs = MODELS[name]
    path = tiny_models(arch, **kwargs)
    reference = Reference(path)
    prompts = prompts_for(reference.vocab_size)
    # 24 blocks of 4 tokens for 6 prompts of up to 49 tokens: preemption; an 8-token budget: chunks
    with LLM(path, tensor_parallel_size=tp, num_kv_blocks=24, block_size=4, max_num_batched_tokens=8) as llm:
        results = llm.generate(prompts, GREEDY)
        stats = llm.engine.stats()
        assert_all_blocks_free(llm)
        config = llm.engine.runner.hf_config
        # every rank keeps the whole latent (and indexer keys) of every token: no head dim to split
        assert llm.engine.runner.model.num_kv_heads == 1
        assert llm.engine.runner.kv_cache.shape[-1] == llm.engine.runner.model.model.values_per_token
        assert llm.engine.runner.model.model.layers[0].self_attn.num_heads == config.num_attention_heads // tp
        assert [r["role"]["tp_rank"] for r in llm.engine.runner.ranks()] == list(range(tp))
        # the plan's KV bytes per token per device are the pool's (the same cache spec, sharded alike)
        planned = plan(str(path), layout=Layout(tp=tp), dtype=torch.float32)
        assert planned.kv_bytes_per_token_per_device * 4 == llm.engine.runner.bytes_per_block()
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference.generate(prompt), f"prompt of {len(prompt)} tokens diverged"
    assert stats.num_preemptions_total > 0
    assert stats.prefix_cache_hits_total > 0


@pytest.mark.parametrize("name", ["glm_moe_dsa", "deepseek_v3_plain_q_yarn"])
def test_each_rank_loads_its_heads_and_the_whole_latent_and_indexer(tiny_models, monkeypatch, name):
    arch, kwargs = MODELS[name]
    path = tiny_models(arch, **kwargs)
    full = checkpoint(path)
    cfg = AutoConfig.from_pretrained(path)
    heads, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    monkeypatch.setattr(loader, "safe_open", RecordingSafeOpen)
    attn = "model.layers.1.self_attn"
    q_name = f"{attn}.q_proj.weight" if cfg.q_lora_rank is None else f"{attn}.q_b_proj.weight"
    for rank in range(2):
        RecordingSafeOpen.reads = {}
        model, _ = load_model(str(path), torch.float32, torch.device("cpu"), group=LoadOnly(rank, 2))
        params = dict(model.named_parameters())
        mine = range(rank * heads // 2, (rank + 1) * heads // 2)
        q_rows = torch.cat([full[q_name].view(heads, dn + dr, -1)[h] for h in mine])
        assert torch.equal(params[q_name], q_rows)
        kv_rows = torch.cat([full[f"{attn}.kv_b_proj.weight"].view(heads, dn + dv, -1)[h] for h in mine])
        assert torch.equal(params[f"{attn}.kv_b_proj.weight"], kv_rows)
        o = full[f"{attn}.o_proj.weight"][:, mine.start * dv : mine.stop * dv]
        assert torch.equal(params[f"{attn}.o_proj.weight"], o)
        # replicated: the latent's projection and norm, the indexer
        whole = [key for key in full if key.startswith(attn) and ("_a_" in key or "indexer" in key)]
        assert whole and all(torch.equal(params[key], full[key]) for key in whole)
        assert model.num_kv_heads == 1
        assert model.model.layers[1].self_attn.num_heads == heads // 2
        # the head-split tensors: at most half of each was read
        for key in (q_name, f"{attn}.kv_b_proj.weight", f"{attn}.o_proj.weight"):
            assert RecordingSafeOpen.reads[key] == full[key].numel() // 2


def test_heads_that_do_not_divide_name_the_model_and_the_shape(tiny_models):
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM at .*tensor_parallel_size 3 does not fit: "
                                         r"4 attention heads do not divide by 3"):
        LLM(tiny_models("deepseek_v3"), tensor_parallel_size=3)

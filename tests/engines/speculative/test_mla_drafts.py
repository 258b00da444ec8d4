"""Drafted steps on MLA models (DeepSeek-V3's absorbed latent attention; GLM-5's with the DSA indexer):
a query of 1 + k rows over the paged latent cache gives the same greedy tokens as one row per step."""

import pytest

from tests.engines.speculative.doubles import OracleProposer
from xinserve.engines import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_mla_greedy_with_drafts_equals_without(tiny_models, arch):
    path = tiny_models(arch)
    prompts = [list(range(10, 18)) * 3, [5, 9, 14, 200, 31, 7], list(range(40, 75))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [r.token_ids for r in LLM(path, num_kv_blocks=128, block_size=4).generate(prompts, params)]
    spec = LLM(path, num_kv_blocks=128, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    spec.engine.proposer = OracleProposer({tuple(p): e for p, e in zip(prompts, expected)}, 3, wrong_rate=0.3)
    assert [r.token_ids for r in spec.generate(prompts, params)] == expected
    stats = spec.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens

"""Tensor parallel with drafts: rank 0's step message carries every logits row of a drafted sequence,
so the followers make the same logits gather and greedy output is unchanged."""

from tests.engines.speculative.doubles import OracleProposer
from xinserve.engines import LLM, SamplingParams


def test_drafted_steps_at_tensor_parallel_2_equal_one_device(tiny_models):
    path = tiny_models("llama")
    prompts = [list(range(10, 18)) * 3, [5, 9, 14, 200, 31, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(path, num_kv_blocks=128, block_size=4) as plain:
        expected = [r.token_ids for r in plain.generate(prompts, params)]
    with LLM(path, num_kv_blocks=128, block_size=4, tensor_parallel_size=2,
             speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as tp:
        tp.engine.proposer = OracleProposer({tuple(p): e for p, e in zip(prompts, expected)}, 3, wrong_rate=0.3)
        assert [r.token_ids for r in tp.generate(prompts, params)] == expected
        spec = tp.engine.stats().spec_decode
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens

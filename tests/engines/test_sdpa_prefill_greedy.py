"""Greedy tokens with the batched SDPA prefill attention (kernels/cpu/sdpa_prefill.py) forced equal
transformers', with a cached prefix, chunked prefill and several prompts per step (GQA ratio 4; the
kernel's own tests, tests/kernels/cpu/test_sdpa_prefill.py, cover ratios 1/2/4 against the reference)."""

from tests.engines.test_llm_vs_transformers import Reference, check_against_reference, random_prompts
from xinserve.engines import LLM


def test_greedy_equals_transformers_with_prefix_hits_and_chunks(tiny_models) -> None:
    path = tiny_models("llama", num_kv_heads=1)
    reference = Reference(path)
    # a 16-token budget over 4-token blocks: prompts are cut into chunks after a cached prefix, and a
    # step holds whole short prompts side by side (padded into one attention call)
    llm = LLM(path, num_kv_blocks=256, block_size=4, enable_prefix_caching=True, max_num_batched_tokens=16,
              kernels={"prefill_attention": "sdpa"})
    assert llm.engine.runner.kernels.chosen["prefill_attention"] == "sdpa"
    prefix = random_prompts(1, reference.vocab_size, seed=3, lengths=(21, 21))[0]
    check_against_reference(llm, reference, random_prompts(1, reference.vocab_size, seed=8, prefix=prefix))
    prompts = random_prompts(4, reference.vocab_size, seed=9, lengths=(2, 30), prefix=prefix)
    prompts += random_prompts(2, reference.vocab_size, seed=10, lengths=(3, 7))
    check_against_reference(llm, reference, prompts)
    assert llm.engine.stats().prefix_cache_hits_total >= 4 * 20

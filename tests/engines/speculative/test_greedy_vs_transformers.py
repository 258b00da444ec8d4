"""Greedy with speculation equals transformers without it, token for token, on every dense tiny model:
prompt-lookup drafts and test-double drafts with errors, batched, with preemption, prefix-cache hits
and chunked prefill in the same run."""

import random

import pytest

from tests.engines.speculative.doubles import OracleProposer
from tests.engines.test_llm_vs_transformers import MODELS, Reference, check_against_reference
from xinserve.engines import LLM

DENSE = ["llama", "qwen2", "qwen3", "glm4", "mistral_window", "qwen2_window", "stories260K"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}


@pytest.fixture(scope="module", params=DENSE)
def model_dir(request, tiny_models):
    if request.param == "stories260K":
        return request.getfixturevalue("stories_dir")
    arch, kwargs = MODELS[request.param]
    return tiny_models(arch, **kwargs)


def repetitive_prompts(count: int, vocab_size: int, seed: int, prefix: list[int]) -> list[list[int]]:
    """A shared prefix, then a short pattern three times (prompt lookup finds it), then a random tail."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        pattern = [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 4))]
        prompts.append(prefix + pattern * 3 + [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 5))])
    return prompts


def test_greedy_with_drafts_equals_transformers(model_dir):
    reference = Reference(model_dir)
    rng = random.Random(1)
    prefix = [rng.randrange(3, reference.vocab_size) for _ in range(9)]
    prompts = repetitive_prompts(6, reference.vocab_size, seed=2, prefix=prefix)
    # 24 blocks of 4 hold about two of these sequences: the rest wait or are preempted; the budget
    # of 16 chunks the prompts; the shared prefix hits the cache after the first prompt.
    llm = LLM(model_dir, num_kv_blocks=24, block_size=4, max_num_batched_tokens=16, speculative_config=NGRAM)
    check_against_reference(llm, reference, prompts[:1])
    check_against_reference(llm, reference, prompts[1:])
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    # Drafts right and wrong at every position (the reference continuation with 40% of its tokens
    # changed): every number of accepted drafts occurs, and the output is still transformers'.
    more = repetitive_prompts(5, reference.vocab_size, seed=3, prefix=prefix)
    llm.engine.proposer = OracleProposer({tuple(p): reference.generate(p) for p in more}, k=3, wrong_rate=0.4)
    before = llm.engine.stats().spec_decode
    check_against_reference(llm, reference, more)
    after = llm.engine.stats().spec_decode
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert 0 < accepted < after.num_draft_tokens - before.num_draft_tokens

"""Speculative method ``mtp`` after a prefix-cache hit: the MTP layer's KV at a cached block's last
position was computed from the token after the block, which another prompt with the same blocks may
not have. A hit therefore also needs that token (engines/core/kv_cache.py ``match_next_token``): the MTP
state after a hit is what a fresh prefill computes, and a draft that always matches is still accepted
whole."""

import torch

from tests.engines.speculative.test_mtp_greedy import OracleMTP
from xinserve.engines import LLM, SamplingParams

K = 2
MTP = {"method": "mtp", "num_speculative_tokens": K}
SHARED = [11, 240, 37, 5, 310, 82, 9, 44]  # two blocks of 4
FIRST, SECOND = SHARED + [7, 19, 3], SHARED + [8, 19, 3]  # the token after the shared blocks differs


def _seed_state(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """The MTP layer's output at the prompt's last position (what its first draft comes from)."""
    runner, kept = llm.engine.runner, []
    run = runner._mtp

    def spy(*args):
        out = run(*args)
        kept.append(out[-1].clone())
        return out

    runner._mtp = spy
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    runner._mtp = run
    return kept[0]


def test_after_a_prefix_hit_the_mtp_state_is_what_a_fresh_prefill_computes(tiny_models):
    path = tiny_models("deepseek_v3", mtp=True)
    with LLM(path, num_kv_blocks=32, block_size=4, speculative_config=MTP) as fresh:
        want = _seed_state(fresh, SECOND)
        steps = 3
        params = SamplingParams(temperature=0, max_tokens=1 + steps * (K + 1), ignore_eos=True)
        expected = fresh.generate([SECOND], params)[0].token_ids
    with LLM(path, num_kv_blocks=32, block_size=4, speculative_config=MTP) as cached:
        _seed_state(cached, FIRST)
        got = _seed_state(cached, SECOND)
        assert cached.engine.stats().prefix_cache_hits_total > 0  # the first block still hits
        # The hit computes the suffix after cached blocks, the fresh run the whole prompt: other kernels and
        # summation orders (1.6e-5 apart with AVX-512's kernels), while reading another prompt's MTP state would
        # be off by the size of the values themselves.
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # a draft that always matches is accepted whole after a (full) prefix hit too
        oracle = OracleMTP(SECOND + expected)
        cached.engine.runner._mtp, cached.engine.runner._draft_tokens = oracle.run, oracle.drafts
        hits = cached.engine.stats().prefix_cache_hits_total
        assert cached.generate([SECOND], params)[0].token_ids == expected
        stats = cached.engine.stats()
        assert stats.prefix_cache_hits_total > hits
        assert (stats.spec_decode.num_draft_tokens, stats.spec_decode.num_accepted_tokens) == (steps * K, steps * K)

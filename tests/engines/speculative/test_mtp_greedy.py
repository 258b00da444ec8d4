"""Speculative method ``mtp`` (the checkpoint's MTP layer drafts): greedy output equals transformers
without speculation, token for token, on DeepSeek-V3, GLM-4.5 and GLM-5 tiny models whose MTP layer has
random weights (drafts mostly wrong), batched, with preemption, prefix-cache hits and chunked prefill in
the same run; and with an MTP test double that always drafts the target's next tokens, every step
accepts all k."""

import pytest
import torch

from tests.engines.speculative.test_greedy_vs_transformers import repetitive_prompts
from tests.engines.test_llm_vs_transformers import Reference, check_against_reference
from xinserve.engines import LLM, SamplingParams

MTP = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe", "glm_moe_dsa"])
def test_greedy_with_mtp_equals_transformers(tiny_models, arch):
    path = tiny_models(arch, mtp=True)
    reference = Reference(path)
    prefix = [17, 230, 45, 8, 190, 66, 3, 120, 99]
    prompts = repetitive_prompts(5, reference.vocab_size, seed=4, prefix=prefix)
    # 20 blocks of 4 hold about two of these sequences: the rest wait or are preempted; the budget
    # of 16 chunks the prompts; the shared prefix hits the cache after the first prompt.
    llm = LLM(path, num_kv_blocks=20, block_size=4, max_num_batched_tokens=16, speculative_config=MTP)
    check_against_reference(llm, reference, prompts[:1])
    check_against_reference(llm, reference, prompts[1:])
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert stats.spec_decode.num_draft_tokens > 0


class OracleMTP:
    """Stands in for the runner's MTP layer (``_mtp`` and ``_draft_tokens``): at position p it drafts
    the token the target puts at p + 2 (``expected``: one sequence's prompt and greedy output)."""

    def __init__(self, expected: list[int]) -> None:
        self.expected = expected

    def run(self, input_ids, positions, previous, metadata) -> torch.Tensor:
        index = (positions + 2).clamp(max=len(self.expected) - 1)
        return torch.tensor(self.expected)[index].unsqueeze(1).float()  # [T, 1]: the draft, as a "hidden state"

    @staticmethod
    def drafts(hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, 0].long()


def test_an_mtp_that_drafts_the_target_tokens_has_every_draft_accepted(tiny_models):
    path = tiny_models("deepseek_v3", mtp=True)
    k, steps = 3, 3
    params = SamplingParams(temperature=0, max_tokens=1 + steps * (k + 1), ignore_eos=True)
    prompt = [11, 240, 37, 5, 310, 82, 9]
    plain = LLM(path, num_kv_blocks=32, block_size=4).generate([prompt], params)[0].token_ids
    llm = LLM(path, num_kv_blocks=32, block_size=4, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    oracle = OracleMTP(prompt + plain)
    llm.engine.runner._mtp, llm.engine.runner._draft_tokens = oracle.run, oracle.drafts
    assert llm.generate([prompt], params)[0].token_ids == plain
    stats = llm.engine.stats().spec_decode
    # the prefill's token, then every later step verifies k drafts and keeps them all
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (steps, steps * k, steps * k)
    assert stats.accepted_per_position == [steps] * k

"""Verification on one tiny model: a draft that always matches is always accepted; log-probs and logit
bias apply to accepted tokens as without speculation; sampled outputs keep their distribution
(rejection sampling, chi-square against the same requests without speculation); n > 1 speculates."""

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engines.speculative.doubles import OracleProposer, TableProposer
from tests.engines.test_llm_vs_transformers import assert_all_blocks_free
from xinserve.engines import LLM, SamplingParams

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "disable_by_batch_size": 4096}
PROMPTS = [[5, 9, 14, 200, 31, 7], [44, 45, 46, 47, 48], [300, 12, 300, 12, 300, 12, 99]]


@pytest.fixture(scope="module")
def llms(tiny_models):
    path = tiny_models("llama")
    return LLM(path, num_kv_blocks=512, block_size=4), LLM(path, num_kv_blocks=512, block_size=4,
                                                          speculative_config=SPEC)


def steps_to_finish(llm: LLM, prompts, params) -> tuple[list, int]:
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            outputs[out.request_id].extend(out.new_token_ids)
        steps += 1
    return [outputs[f"s{i}"] for i in range(len(prompts))], steps


def test_drafts_that_always_match_are_always_accepted(llms):
    plain, spec = llms
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    expected = [r.token_ids for r in plain.generate(PROMPTS, params)]
    spec.engine.proposer = OracleProposer({tuple(p): e for p, e in zip(PROMPTS, expected)}, K)
    before = spec.engine.stats().spec_decode
    got, steps = steps_to_finish(spec, PROMPTS, params)
    assert got == expected
    after = spec.engine.stats().spec_decode
    drafts = after.num_drafts - before.num_drafts
    # The prefill's token, then three steps of K drafts + 1: 1 + 3 * 4 = 13 tokens in 4 steps.
    assert steps == 4 and drafts == 3 * len(PROMPTS)
    assert after.num_accepted_tokens - before.num_accepted_tokens == drafts * K
    earlier = before.accepted_per_position + [0] * K
    assert [a - b for a, b in zip(after.accepted_per_position, earlier)] == [drafts] * K
    assert_all_blocks_free(spec)


def test_logprobs_and_logit_bias_apply_to_accepted_tokens_as_without_speculation(llms):
    plain, spec = llms
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3,
                            logit_bias={17: 4.0, 300: 2.5})
    expected = plain.generate(PROMPTS, params)
    spec.engine.proposer = OracleProposer({tuple(p): e.token_ids for p, e in zip(PROMPTS, expected)}, K,
                                          wrong_rate=0.3, seed=4)
    got = spec.generate(PROMPTS, params)
    for a, b in zip(expected, got):
        assert a.token_ids == b.token_ids
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [x.top_token_ids for x in la] == [x.top_token_ids for x in lb]
        assert [x.logprob for x in la] == pytest.approx([x.logprob for x in lb], abs=1e-4)
    assert_all_blocks_free(spec)


def exact_top3_joint(model_dir, prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """The probability of every first ``length`` tokens under temperature 1 and top-k 3, from
    transformers' logits: the distribution sampling must keep, drafts or not."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    joint = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, p in joint.items():
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            top = logits.topk(3)
            for token, q in zip(top.indices.tolist(), top.values.softmax(dim=-1).tolist()):
                grown[(*prefix, token)] = p * q
        joint = grown
    return joint


def chi_square(observed: Counter, probs: dict[tuple[int, ...], float], z: float = 3.3) -> tuple[float, float]:
    """Pearson's statistic of ``observed`` against ``probs`` (cells expected fewer than 5 times pooled),
    and its critical value at about p = 5e-4 (Wilson-Hilferty's approximation)."""
    n = sum(observed.values())
    assert set(observed) <= set(probs)
    cells, rare = [], [0, 0.0]
    for key, p in probs.items():
        if n * p < 5:
            rare[0] += observed[key]
            rare[1] += n * p
        else:
            cells.append((observed[key], n * p))
    if rare[1]:
        cells.append(tuple(rare))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_outputs_keep_their_distribution(llms, tiny_models):
    """Top-k 3 leaves three tokens per position, so the first three tokens take 27 values. 800 seeded
    samples, each drafting the likeliest second token after its first (accepted and rejected
    often; the third token is the bonus or the recovered one), follow the exact joint probabilities."""
    _, spec = llms
    prompt = PROMPTS[1]  # 5 tokens: the extra choices share its first block and decode their first token
    probs = exact_top3_joint(tiny_models("llama"), prompt, 3)
    table = {}
    for first in {key[0] for key in probs}:
        _, second = max((p, key[1]) for key, p in probs.items() if key[0] == first)
        table[(first,)] = [second]
    spec.engine.proposer = TableProposer(table)
    params = [SamplingParams(n=100, temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(8)]
    before = spec.engine.stats().spec_decode
    results = spec.generate([prompt] * len(params), params)
    observed = Counter(tuple(c.token_ids) for r in results for c in r.outputs)
    after = spec.engine.stats().spec_decode
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    proposed = after.num_draft_tokens - before.num_draft_tokens
    assert proposed == 800 and 0.1 * proposed < accepted < 0.9 * proposed
    stat, critical = chi_square(observed, probs)
    assert stat < critical, (stat, critical, observed.most_common(6))
    assert_all_blocks_free(spec)

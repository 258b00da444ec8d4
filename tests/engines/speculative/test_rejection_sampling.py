"""The speculative-sampling rule on fixed logits over a five-token vocabulary: whatever the draft, the
emitted tokens follow the target distribution (one draft: the first token's marginal, and the pair
when the draft is accepted); greedy rows accept exactly the argmax prefix."""

import math
from collections import Counter

import torch

from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.speculative.verify import verify_drafts
from xinserve.engines.worker.sampler import SamplingRow
from xinserve.kernels.references.dense import top_k_top_p

P0 = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])  # the target's first distribution
P1 = torch.tensor([0.05, 0.05, 0.3, 0.3, 0.3])  # the next one, after the draft
N = 8000


def run(draft: int, params: SamplingParams, seed: int = 0, n: int = N) -> list[list[int]]:
    torch.manual_seed(seed)
    logits = torch.stack([P0.log(), P1.log()]).repeat(n, 1)  # [2n, 5]: each sequence's two rows
    seqs = [Sequence(i, f"r{i}", [1], params) for i in range(n)]
    row = SamplingRow(params, [], [], None, [])
    out = verify_drafts(logits, seqs, [[draft]] * n, [row] * n, top_k_top_p)
    return [s.token_ids for s in out]


def chi_square_ok(counts: Counter, probs: list[float], n: int) -> bool:
    stat = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(probs))
    df = len(probs) - 1
    return stat < df * (1 - 2 / (9 * df) + 3.3 * math.sqrt(2 / (9 * df))) ** 3  # about p = 5e-4


def test_emitted_tokens_follow_the_target_for_likely_and_unlikely_drafts():
    params = SamplingParams(temperature=1.0)
    for draft in (0, 3):  # accepted half the time, or a tenth
        outputs = run(draft, params, seed=draft)
        first = Counter(tokens[0] for tokens in outputs)
        assert chi_square_ok(first, P0.tolist(), N), (draft, first)
        accepted = [tokens for tokens in outputs if len(tokens) == 2]
        assert all(tokens[0] == draft for tokens in accepted)
        assert abs(len(accepted) / N - P0[draft].item()) < 0.02
        second = Counter(tokens[1] for tokens in accepted)  # the bonus token, drawn from P1
        assert chi_square_ok(second, P1.tolist(), len(accepted)), (draft, second)


def test_greedy_accepts_the_argmax_and_then_the_next_argmax():
    greedy = SamplingParams(temperature=0)
    assert run(0, greedy, n=3) == [[0, 2]] * 3  # P1's first maximum is token 2
    assert run(1, greedy, n=3) == [[0]] * 3

"""The batched sampler against naive per-row reference implementations written here."""

import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.worker.sampler import (
    Sampler,
    SamplingRow,
    adjusted_logits,
    apply_penalties,
    filtered_probs,
)
from xinserve.kernels.references import dense as reference

VOCAB = 32


def make_row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    seed: int | None = None,
    suppress: list[int] | None = None,
    **params,
) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(
        params=SamplingParams(seed=seed, **params),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        suppress_token_ids=suppress or [],
    )


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def naive_allowed(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """Tokens one row may produce, filter by filter, with plain Python over a sorted list."""
    scaled = (logits / temperature).tolist()
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    kept = order[:top_k] if top_k > 0 else order
    weights = [math.exp(scaled[i] - scaled[kept[0]]) for i in kept]
    total = sum(weights)
    cumulative, nucleus = 0.0, []
    for token, weight in zip(kept, weights):
        nucleus.append(token)
        cumulative += weight / total
        if cumulative >= top_p:
            break
    # min-p compares each probability with the top one: the ratio needs no normalisation.
    return {token for token in nucleus if math.exp(scaled[token] - scaled[nucleus[0]]) >= min_p}


def naive_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    for r, row in enumerate(rows):
        p = row.params
        for token in set(row.prompt_token_ids) | set(row.output_token_ids):
            value = out[r, token].item()
            out[r, token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        for token in set(row.output_token_ids):
            count = row.output_token_ids.count(token)
            out[r, token] -= p.frequency_penalty * count + p.presence_penalty
    return out


def test_greedy_is_argmax_and_input_untouched() -> None:
    logits = random_logits(8)
    before = logits.clone()
    out = Sampler()(logits, [make_row(temperature=0) for _ in range(8)])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None
    assert torch.equal(logits, before)


@pytest.mark.parametrize("temperature", [0.05, 1.0, 7.0, 100.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature: float) -> None:
    logits = random_logits(16, seed=1)
    rows = [make_row(temperature=temperature, top_k=1, seed=i if i % 2 else None) for i in range(16)]
    for _ in range(5):
        assert torch.equal(Sampler()(logits, rows).token_ids, logits.argmax(dim=-1))


def test_tiny_top_p_still_keeps_the_most_likely_token() -> None:
    logits = random_logits(64, vocab=1000, seed=9)
    rows = [make_row(temperature=1.0, top_p=1e-9) for _ in range(64)]
    assert torch.equal(Sampler()(logits, rows).token_ids, logits.argmax(dim=-1))


def test_greedy_and_sampled_rows_share_a_batch() -> None:
    logits = random_logits(6, seed=2)
    rows = [make_row(temperature=0 if i % 2 == 0 else 1.5) for i in range(6)]
    tokens = Sampler()(logits, rows).token_ids
    assert torch.equal(tokens[0::2], logits[0::2].argmax(dim=-1))


@pytest.mark.parametrize(
    "settings",
    [
        {"top_k": 5},
        {"top_p": 0.6},
        {"min_p": 0.2},
        {"top_k": 8, "top_p": 0.5},
        {"top_k": 10, "top_p": 0.9, "min_p": 0.1, "temperature": 0.7},
    ],
)
def test_filters_never_select_a_filtered_token(settings: dict) -> None:
    torch.manual_seed(0)
    logits = random_logits(1, seed=3, scale=1.5)[0]
    params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **settings}
    allowed = naive_allowed(logits, **params)
    assert 1 < len(allowed) < VOCAB  # the case is not trivial
    draws = 3000
    out = Sampler()(logits.expand(draws, VOCAB), [make_row(**params) for _ in range(draws)])
    seen = set(out.token_ids.tolist())
    assert seen <= allowed
    assert seen == allowed  # and every kept token stays reachable


@pytest.mark.parametrize(
    ("top_p", "kept"), [(0.35, {2}), (0.45, {2, 0}), (0.68, {2, 0}), (0.72, {2, 0, 3}), (0.95, {0, 1, 2, 3})]
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: set[int]) -> None:
    torch.manual_seed(4)
    logits = torch.tensor([0.3, 0.1, 0.4, 0.2]).log()  # token 2 most likely, then 0, 3, 1
    draws = 2000
    tokens = Sampler()(logits.expand(draws, -1), [make_row(top_p=top_p) for _ in range(draws)]).token_ids
    assert set(tokens.tolist()) == kept


def test_mixed_filters_in_one_batch_apply_per_row() -> None:
    torch.manual_seed(1)
    logits = random_logits(4, seed=4, scale=1.5)
    settings = [
        {"top_k": 3},
        {"top_p": 0.4},
        {"min_p": 0.3},
        {},
    ]
    repeats = 500
    rows = [make_row(**s) for s in settings for _ in range(repeats)]
    tokens = Sampler()(logits.repeat_interleave(repeats, dim=0), rows).token_ids.view(4, repeats)
    for r, s in enumerate(settings):
        params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **s}
        assert set(tokens[r].tolist()) <= naive_allowed(logits[r], **params)
    assert len(set(tokens[3].tolist())) > 10  # the unfiltered row really samples the whole range


def test_penalties_follow_the_formulas() -> None:
    logits = random_logits(5, seed=5)
    rows = [
        make_row(prompt=[1, 2, 2, 3], output=[3, 4, 4, 4], repetition_penalty=1.3, temperature=0),
        make_row(prompt=[5, 6], output=[6, 7, 7], frequency_penalty=0.7, temperature=0),
        make_row(prompt=[8], output=[8, 9, 9], presence_penalty=-1.2, temperature=0),
        make_row(
            prompt=[10, 11, 11],
            output=[11, 12, 12, 13],
            repetition_penalty=0.8,
            frequency_penalty=-0.4,
            presence_penalty=1.5,
        ),
        make_row(prompt=[1, 2, 3], output=[4, 5], temperature=0),  # no penalties: untouched
    ]
    expected = naive_penalties(logits, rows)
    actual = apply_penalties(logits, rows)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(actual[:4], logits[:4])
    assert torch.equal(actual[4], logits[4])
    # Greedy rows pick the argmax of the penalised logits.
    greedy = [0, 1, 2, 4]
    tokens = Sampler()(logits, rows).token_ids
    assert torch.equal(tokens[greedy], expected[greedy].argmax(dim=-1))


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 2.0
    logits[0, 8] = 1.9
    plain = make_row(prompt=[7], temperature=0)
    penalised = make_row(prompt=[7], temperature=0, repetition_penalty=1.2)
    assert Sampler()(logits, [plain]).token_ids.tolist() == [7]
    assert Sampler()(logits, [penalised]).token_ids.tolist() == [8]  # 2.0 / 1.2 < 1.9


def _seeded_tokens(position: int, batch: int, seed: int, steps: int = 12) -> list[int]:
    """Tokens of one seeded row placed at ``position`` in a batch of other rows, over ``steps`` calls."""
    others = [
        lambda i: make_row(temperature=0.8, seed=1000 + i),
        lambda i: make_row(temperature=1.0),
        lambda i: make_row(temperature=0),
        lambda i: make_row(temperature=1.3, top_p=0.9),
    ]
    rows = [others[i % len(others)](i) for i in range(batch)]
    rows[position] = make_row(temperature=1.0, top_k=20, seed=seed)
    tokens = []
    for step in range(steps):
        logits = random_logits(batch, vocab=200, seed=step, scale=0.5)
        logits[position] = random_logits(1, vocab=200, seed=10_000 + step, scale=0.5)[0]
        tokens.append(Sampler()(logits, rows).token_ids[position].item())
    return tokens


def test_seeded_row_is_independent_of_the_batch() -> None:
    alone = _seeded_tokens(position=0, batch=1, seed=42)
    assert _seeded_tokens(position=3, batch=7, seed=42) == alone
    assert _seeded_tokens(position=1, batch=2, seed=42) == alone
    assert _seeded_tokens(position=0, batch=1, seed=43) != alone
    assert len(set(alone)) > 3  # sampling, not a constant


def test_distribution_matches_softmax() -> None:
    torch.manual_seed(123)
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature = 0.8
    draws = 40_000
    rows = [make_row(temperature=temperature) for _ in range(draws)]
    tokens = Sampler()(logits.expand(draws, -1), rows).token_ids
    observed = torch.bincount(tokens, minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * draws
    chi_square = ((observed - expected) ** 2 / expected).sum().item()
    assert chi_square < 20.5  # 99.9% quantile of chi-square with 5 degrees of freedom


def test_seeded_draws_follow_the_distribution_too() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    generator_row = make_row(seed=7)
    tokens = [Sampler()(logits, [generator_row]).token_ids.item() for _ in range(3000)]
    observed = torch.bincount(torch.tensor(tokens), minlength=3).double()
    expected = torch.softmax(logits[0].double(), dim=0) * len(tokens)
    assert ((observed - expected) ** 2 / expected).sum().item() < 13.8  # 99.9%, 2 degrees of freedom


def test_logprobs_are_raw_log_softmax_with_sorted_top_k() -> None:
    logits = random_logits(3, seed=6)
    rows = [
        make_row(temperature=0, logprobs=None, repetition_penalty=1.5, prompt=[0, 1, 2]),
        make_row(temperature=0.5, logprobs=0),
        make_row(temperature=2.0, top_k=4, logprobs=5),
    ]
    out = Sampler()(logits, rows)
    assert out.logprobs.shape == (3, 6) and out.logprob_token_ids.shape == (3, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    reference = torch.log_softmax(logits, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.token_ids)
    torch.testing.assert_close(out.logprobs[:, 0], reference.gather(1, out.token_ids[:, None])[:, 0])
    top_values, top_ids = reference.sort(dim=-1, descending=True)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids[:, :5])
    torch.testing.assert_close(out.logprobs[:, 1:], top_values[:, :5])


def test_logprobs_zero_returns_only_the_chosen_token() -> None:
    logits = random_logits(2, seed=7)
    out = Sampler()(logits, [make_row(temperature=0, logprobs=0), make_row(temperature=0)])
    assert out.logprobs.shape == (2, 1)
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(logits, -1).amax(dim=-1))


def test_suppressed_tokens_are_never_chosen() -> None:
    logits = random_logits(1, seed=8)
    best, second = logits[0].topk(2).indices.tolist()
    greedy = Sampler()(logits, [make_row(temperature=0, suppress=[best])]).token_ids
    assert greedy.tolist() == [second]

    torch.manual_seed(2)
    flat = torch.zeros(2000, VOCAB)
    banned = [0, 5, 6, 31]
    tokens = Sampler()(flat, [make_row(suppress=banned) for _ in range(2000)]).token_ids
    assert not set(tokens.tolist()) & set(banned)
    assert len(set(tokens.tolist())) == VOCAB - len(banned)


@pytest.mark.parametrize("temperature", [1e-40, 1e-6])
def test_vanishing_temperature_is_greedy(temperature: float) -> None:
    logits = random_logits(3, seed=9)
    rows = [make_row(temperature=temperature), make_row(temperature=1.0, seed=1), make_row(temperature=0)]
    tokens = Sampler()(logits, rows).token_ids
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert rows[0].params.greedy and not rows[1].params.greedy


# Values around every field's bounds and far past them; the property draws from these and from anywhere.
EDGES = [0.0, -0.0, 1e-300, 1e-45, 1e-5, 1e-5 * (1 + 1e-9), 0.01, 0.5, 1.0, 2.0, 100.0, 1e5, 3.4e38, 1e300,
         -1e-300, -2.0, -100.0, math.nan, math.inf, -math.inf]


FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


def _any_float() -> Any:
    return st.one_of(st.sampled_from(EDGES), st.floats(-200, 200), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(values=st.dictionaries(st.sampled_from(FLOAT_FIELDS), _any_float(), max_size=len(FLOAT_FIELDS)),
    top_k=st.integers(0, VOCAB + 1), bias=st.dictionaries(st.integers(0, VOCAB - 1), _any_float(), max_size=3),
    scale=st.floats(0.1, 100), seed=st.integers(0, 2**16))
def test_every_accepted_sampling_value_keeps_the_logits_finite(values, top_k, bias, scale, seed):
    """Whatever ``SamplingParams`` accepts, the sampler's logits stay finite (NaN or +inf would make
    it sample garbage: a ``repetition_penalty`` of 1e-300 once picked token 0 every time)."""
    try:
        params = SamplingParams(top_k=top_k, logit_bias=bias or None, **values)
    except ValueError:
        assume(False)
    logits = random_logits(2, seed=seed, scale=scale)
    rows = [SamplingRow(params, [1, 2, 2, 5], [5, 7, 7, 7], None, [3]),  # prior tokens, a suppressed one
            SamplingRow(params, [0], [], None, [])]
    adjusted = adjusted_logits(logits, rows)
    assert not adjusted.isnan().any() and not adjusted.isposinf().any(), adjusted
    assert adjusted.isfinite().any(dim=-1).all(), adjusted  # greedy's argmax is a real token
    greedy = [params.greedy] * 2
    probs = filtered_probs(adjusted, rows, greedy, reference.top_k_top_p)
    assert probs.isfinite().all(), (params, probs)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(2), atol=1e-4), (params, probs)

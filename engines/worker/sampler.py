"""Token sampling on the device: penalties, logit bias, grammar masks, temperature, top-k / top-p / min-p,
seeded draws, log-probs.

Batched over the rows of the logits, and nothing here copies from the device to the host: per-row
settings go host -> device as small tensors, and the runner makes the step's one device -> host copy
(the sampled ids, plus log-probs when asked). Each transform runs only when some row needs it, so
an all-greedy batch costs one argmax.
"""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.structured.bitmask import apply_grammars
from xinserve.engines.structured.compiler import OutputGrammar
from xinserve.kernels.references import dense as reference


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs about one row of the logits (one sequence); built by the runner."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # owned by the runner, one per seeded sequence, on the logits' device
    suppress_token_ids: list[int]  # e.g. EOS while fewer than min_tokens are generated
    grammar: OutputGrammar | None = None  # the sequence's grammar state when its output is constrained


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64, on the logits' device
    logprobs: torch.Tensor | None  # [N, 1 + K] float32: chosen token, then the top K of the raw logits
    logprob_token_ids: torch.Tensor | None  # [N, 1 + K] int64


def choice_seed(seed: int, index: int) -> int:
    """The generator seed of choice ``index`` of a request seeded with ``seed`` (a 64-bit value).

    Choice 0 uses the seed itself, so it matches the same request with n = 1. Other choices hash
    (seed, index): ``seed + index`` would make seed 0's choice 1 equal seed 1's choice 0.
    """
    if index == 0:
        return seed % 2**64
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    """Picks one token per row of ``logits`` ([N, V]) following each row's ``SamplingParams``.

    ``top_k_top_p``: the kernel-registry's choice for that filter (a vendor op where one exists).
    """

    def __init__(self, top_k_top_p: Callable[..., torch.Tensor] = reference.top_k_top_p) -> None:
        self.top_k_top_p = top_k_top_p

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        raw = logits.float()  # [N, V]
        logits = adjusted_logits(raw, rows)
        greedy = [row.params.greedy for row in rows]
        if all(greedy):
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = _sample(logits, rows, greedy, self.top_k_top_p)

        asked = [row.params.logprobs for row in rows if row.params.logprobs is not None]
        if not asked:
            return SamplerOutput(token_ids, None, None)
        logprobs, logprob_token_ids = gather_logprobs(raw, token_ids, max(asked))
        return SamplerOutput(token_ids, logprobs, logprob_token_ids)


def adjusted_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``logits`` ([N, V] float32) after each row's penalties, suppressed tokens, logit bias and
    grammar mask: what greedy takes the argmax of, before temperature and filters."""
    if any(row.params.has_penalties for row in rows):
        logits = apply_penalties(logits, rows)
    if any(row.suppress_token_ids for row in rows):
        logits = suppress_tokens(logits, rows)
    if any(row.params.logit_bias for row in rows):
        logits = apply_logit_bias(logits, rows)
    if any(row.grammar is not None for row in rows):
        logits = apply_grammars(logits, [row.grammar for row in rows])
    return logits


def _row_values(values: list, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A per-row parameter as a [N, 1] tensor on the logits' device (one host -> device copy)."""
    return torch.tensor(values, dtype=dtype, device=like.device).unsqueeze(1)


def token_counts(token_lists: list[list[int]], vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """[N, V] float32: how often each token id occurs in each row's list."""
    lengths = [len(tokens) for tokens in token_lists]
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=like.device)
    if sum(lengths) == 0:
        return counts
    # Row index of every token, built with numpy rather than a Python loop over tokens.
    row_index = torch.from_numpy(np.repeat(np.arange(len(token_lists)), lengths)).to(like.device)
    token_ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64, device=like.device)
    ones = torch.ones(token_ids.shape, dtype=torch.float32, device=like.device)
    return counts.index_put_((row_index, token_ids), ones, accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (positive logits divided, negative multiplied),
    then OpenAI's frequency and presence penalties over output tokens only. Returns a new tensor.

    Rows without penalties get neutral values (1, 0, 0), which leave their logits bit-identical,
    and contribute no tokens to the counts.
    """
    active = [row.params.has_penalties for row in rows]
    vocab_size = logits.shape[1]
    output_counts = token_counts(
        [row.output_token_ids if on else [] for row, on in zip(rows, active)], vocab_size, logits
    )  # [N, V]
    logits = logits.clone()
    if any(row.params.repetition_penalty != 1.0 for row in rows):
        prompt_counts = token_counts(
            [row.prompt_token_ids if on else [] for row, on in zip(rows, active)], vocab_size, logits
        )
        seen = (prompt_counts + output_counts) > 0  # [N, V]
        penalty = _row_values([row.params.repetition_penalty for row in rows], logits)  # [N, 1]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    frequency = _row_values([row.params.frequency_penalty for row in rows], logits)
    presence = _row_values([row.params.presence_penalty for row in rows], logits)
    logits -= frequency * output_counts
    logits -= presence * (output_counts > 0).float()
    return logits


def suppress_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of ``logits`` with each row's ``suppress_token_ids`` set to -inf."""
    lists = [row.suppress_token_ids for row in rows]
    row_index = torch.from_numpy(np.repeat(np.arange(len(lists)), [len(ids) for ids in lists]))
    token_ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.int64)
    logits = logits.clone()
    logits[row_index.to(logits.device), token_ids.to(logits.device)] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of ``logits`` with each row's ``logit_bias`` values added to its tokens' logits."""
    biases = [row.params.logit_bias or {} for row in rows]
    row_index = torch.from_numpy(np.repeat(np.arange(len(biases)), [len(b) for b in biases]))
    token_ids = torch.tensor(list(chain.from_iterable(biases)), dtype=torch.int64)
    values = torch.tensor(list(chain.from_iterable(b.values() for b in biases)), dtype=torch.float32)
    return logits.index_put(
        (row_index.to(logits.device), token_ids.to(logits.device)), values.to(logits.device), accumulate=True
    )


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits ([N, 1] int64, 0 = keep all); ``max_k`` = max of top_k.
    (With top-p as well, the registry's ``top_k_top_p`` kernel does both.)

    ``torch.topk`` to ``max_k`` instead of a full sort: the host already knows the largest k.
    """
    top_values = logits.topk(max_k, dim=-1).values  # [N, max_k], descending
    threshold = top_values.gather(1, (top_k - 1).clamp(min=0))  # [N, 1]: the k-th largest logit
    threshold = torch.where(top_k > 0, threshold, float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` ([N, 1]) times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = min_p * probs.amax(dim=-1, keepdim=True)  # [N, 1]; 0 for rows without min-p
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample_from_probs(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row of ``probs`` ([N, V]) by the exponential race: argmax(p / q), q ~ Exp(1).

    Rows in ``generators`` (row -> generator) draw their own uniforms, so a seeded sequence gets the
    same tokens whatever else is in the batch; the other rows share one batched draw.
    """
    uniform = torch.rand_like(probs)  # [N, V] in [0, 1)
    for row, generator in generators.items():
        uniform[row] = torch.rand(probs.shape[1], device=probs.device, generator=generator)
    # q = -log(U) is Exp(1) and lies in (0, inf]: never 0, so p / q is never NaN, and a filtered
    # token (p = 0) can never win. On CPU this is ~3x faster than Tensor.exponential_.
    q = uniform.log_().neg_()
    return (probs / q).argmax(dim=-1)


def _sample(
    logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool], top_k_top_p: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """Tokens for a batch with at least one sampled (temperature > 0) row; [N] int64."""
    token_ids = sample_from_probs(filtered_probs(logits, rows, greedy, top_k_top_p), row_generators(rows, greedy))
    if any(greedy):
        is_greedy = torch.tensor(greedy, device=logits.device)
        token_ids = torch.where(is_greedy, logits.argmax(dim=-1), token_ids)
    return token_ids


def row_generators(rows: list[SamplingRow], greedy: list[bool]) -> dict[int, torch.Generator]:
    """Row -> generator of each seeded sampled row."""
    return {i: row.generator for i, (row, g) in enumerate(zip(rows, greedy)) if row.generator is not None and not g}


def filtered_probs(
    logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool], top_k_top_p: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """[N, V] float32: each row's sampling distribution (temperature, top-k / top-p, min-p applied to
    the adjusted ``logits``); greedy rows get neutral settings (their token is the argmax anyway)."""
    vocab_size = logits.shape[1]
    params = [row.params for row in rows]
    # Greedy rows ride along with neutral settings; their token is the argmax, taken by the caller.
    temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
    top_k = [0 if g or p.top_k >= vocab_size else p.top_k for p, g in zip(params, greedy)]
    top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
    min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]

    scaled = logits / _row_values(temperature, logits)
    if any(p < 1.0 for p in top_p):
        scaled = top_k_top_p(
            scaled, _row_values(top_k, logits, torch.int64), _row_values(top_p, logits)
        )
    elif any(top_k):
        scaled = apply_top_k(scaled, _row_values(top_k, logits, torch.int64), max(top_k))
    if any(min_p):
        scaled = apply_min_p(scaled, _row_values(min_p, logits))
    return scaled.softmax(dim=-1)


def gather_logprobs(
    raw_logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the raw model distribution: the chosen token first, then the ``num_top`` most
    likely tokens in descending order. Returns ([N, 1 + K] float32, [N, 1 + K] int64)."""
    logprobs = raw_logits.log_softmax(dim=-1)  # [N, V]
    chosen_ids = token_ids.unsqueeze(1)  # [N, 1]
    chosen = logprobs.gather(1, chosen_ids)
    if num_top == 0:
        return chosen, chosen_ids
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [N, K]
    return torch.cat([chosen, top_values], dim=1), torch.cat([chosen_ids, top_ids], dim=1)

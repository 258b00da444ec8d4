"""Verification of draft tokens on the device: which drafts a step accepts, and the token after them.

A drafted sequence has 1 + k rows of logits: row j is the target's distribution p_j for the token
after draft j - 1 (row 0: after the sequence's last token). Greedy accepts the longest prefix of
drafts that equal the argmaxes, then the argmax after it. Sampled rows use the speculative-sampling
rule: draft d_j (a point mass q = δ_dj for prompt lookup) is accepted with probability
min(1, p_j(d_j) / q(d_j)) = p_j(d_j); on the first rejection the token is drawn from the recovered
distribution norm(max(0, p_j - q)), which is p_j without d_j; with every draft accepted, from p_k.
Each emitted token is then distributed exactly as p_j: P(d_j) = p_j(d_j), P(x ≠ d_j) =
(1 - p_j(d_j)) p_j(x) / (1 - p_j(d_j)). Sequences without drafts in the same batch have one row and
are sampled as usual. One device -> host copy (plus log-probs when asked), as on the normal path.
"""

from collections.abc import Callable

import numpy as np
import torch

from xinserve.engines.core.outputs import TokenLogprob
from xinserve.engines.core.scheduler import SampledTokens
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.worker.sampler import (
    SamplingRow,
    adjusted_logits,
    filtered_probs,
    gather_logprobs,
    row_generators,
    sample_from_probs,
)


def verify_drafts(
    logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], rows: list[SamplingRow],
    top_k_top_p: Callable[..., torch.Tensor],
) -> list[SampledTokens]:
    """``logits``: [R, V], each sequence's 1 + len(drafts[i]) rows in order; ``rows``: one sampling row
    per sequence. Returns each sequence's accepted drafts plus one token."""
    counts = [1 + len(d) for d in drafts]
    expanded = [row for row, c in zip(rows, counts) for _ in range(c)]  # [R]
    greedy = [row.params.greedy for row in expanded]
    # [R]: the draft each row's distribution is checked against; -1 on each sequence's last row
    draft_np = np.fromiter((t for d in drafts for t in (*d, -1)), dtype=np.int64, count=len(expanded))
    draft = torch.from_numpy(draft_np).to(logits.device)
    has_draft = draft >= 0
    raw = logits.float()
    adjusted = adjusted_logits(raw, expanded)  # [R, V]
    argmax = adjusted.argmax(dim=-1)
    if all(greedy):
        accept, token = has_draft & (argmax == draft), argmax
    else:
        accept, token = _rejection_sample(adjusted, draft, draft_np, expanded, greedy, top_k_top_p)
        is_greedy = torch.tensor(greedy, device=logits.device)
        accept = torch.where(is_greedy, has_draft & (argmax == draft), accept)
        token = torch.where(is_greedy, argmax, token)
    asked = [row.params.logprobs for row in rows if row.params.logprobs is not None]
    chosen = torch.where(accept, draft, token)  # [R]: the token each row emits if the row is reached
    accepted, tokens = torch.stack([accept.long(), chosen]).tolist()  # the step's one device -> host copy
    values = ids = None
    if asked:
        lp, lp_ids = gather_logprobs(raw, chosen, max(asked))
        values, ids = lp.tolist(), lp_ids.tolist()
    out: list[SampledTokens] = []
    first = 0
    for seq, row, count in zip(seqs, rows, counts):
        n = 0
        while n < count - 1 and accepted[first + n]:
            n += 1
        emitted = range(first, first + n + 1)  # the accepted drafts' rows and the row after them
        logprobs = None
        if values is not None and row.params.logprobs is not None:
            k = row.params.logprobs
            logprobs = [TokenLogprob(values[r][0], ids[r][1 : 1 + k], values[r][1 : 1 + k]) for r in emitted]
        out.append(SampledTokens(seq, [tokens[r] for r in emitted], logprobs))
        first += count
    return out


def draft_logits_indices(num_new: list[int], num_drafts: list[int], is_sampled: list[bool]) -> np.ndarray:
    """[R] int64: the rows of a step whose logits are needed, in order: each sampled sequence's last
    row and, for a drafted one, the k rows before it (its own last token's and its drafts but the last)."""
    ends = np.cumsum(num_new)  # [S] one past each sequence's last row
    if not any(num_drafts):
        return (ends - 1)[is_sampled]
    return np.concatenate([np.arange(end - 1 - k, end) for end, k, yes in zip(ends, num_drafts, is_sampled) if yes])


def _rejection_sample(
    adjusted: torch.Tensor, draft: torch.Tensor, draft_np: np.ndarray, rows: list[SamplingRow],
    greedy: list[bool], top_k_top_p: Callable[..., torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """([R] bool, [R] int64): whether each row accepts its draft, and the token it emits otherwise
    (drawn from the recovered distribution; from p itself on a row without a draft)."""
    has_draft = draft >= 0
    probs = filtered_probs(adjusted, rows, greedy, top_k_top_p)  # [R, V]
    safe = draft.clamp(min=0).unsqueeze(1)  # [R, 1]
    p_draft = probs.gather(1, safe).squeeze(1)  # [R]
    generators = row_generators(rows, greedy)
    uniform = torch.rand(probs.shape[0], device=probs.device)  # [R]
    for r, generator in generators.items():
        if draft_np[r] >= 0:  # a seeded sequence's own stream: the same tokens whatever the batch
            uniform[r] = torch.rand(1, device=probs.device, generator=generator)
    accept = has_draft & (uniform < p_draft)
    # max(0, p - δ_d) is p with the draft's probability removed; the race normalises it.
    recovered = torch.where(has_draft.unsqueeze(1), probs.scatter(1, safe, 0.0), probs)
    return accept, sample_from_probs(recovered, generators)


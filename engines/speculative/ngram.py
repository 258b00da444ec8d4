"""Prompt lookup (vLLM's ``ngram`` method): the draft is what followed the latest earlier occurrence of
the sequence's last n tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``. No model,
no torch: text that repeats its prompt or itself (code edits, extraction, loops) gets long drafts.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from xinserve.engines.core.sequence import Sequence
from xinserve.engines.speculative.config import SpeculativeConfig
from xinserve.engines.speculative.eligibility import may_draft


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix of
    ``token_ids`` of length n in [n_min, n_max]; [] when none matches."""
    tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # [L - n, n]: every window that starts before the suffix itself does
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the latest match (at most the last token)
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, running: list[Sequence]) -> None:
        """Set ``draft_token_ids`` of each running sequence about to decode; none while more than
        ``disable_by_batch_size`` sequences run (a big batch is compute-bound: drafts only cost)."""
        if len(running) > self.config.disable_by_batch_size:
            return
        c = self.config
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens == 1 and may_draft(seq):
                seq.draft_token_ids = propose_ngram(seq.token_ids, c.num_speculative_tokens, c.prompt_lookup_min,
                                                    c.prompt_lookup_max)

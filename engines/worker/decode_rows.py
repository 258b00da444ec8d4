"""The decode part of a step, one row per new token: a plain decode's one token, or a drafted
sequence's last token followed by its k drafts (speculative decoding's verification).

Every row is a decode query of its own: row j of a sequence whose first new token sits at position p
has the context length p + j + 1 and the sequence's block table, so it attends to positions [0, p + j]
— causal within the drafts, as k + 1 ordinary decode steps would be (all the step's keys are written
before attention runs). So the decode attention kernels (dense, MLA's absorbed path, the DSA indexer's
per-row ranking) and the padded decode buckets (engines/worker/decode_buckets.py) serve verification
unchanged: a bucket is keyed by its total rows, whatever mix of drafting and non-drafting sequences
fills it. The cost is that a drafted sequence's context is read once per row (1 + k times), where a
kernel taking q_len > 1 queries per sequence would read it once; none of ours does yet.
"""

from dataclasses import dataclass

import numpy as np

from xinserve.engines.core.scheduler import ScheduledSeq


@dataclass(slots=True)
class DecodeRows:
    """R rows of D decoding sequences, each sequence's rows together and in order."""

    token_ids: list[int]  # [R] a sequence's last token, then its drafts
    positions: np.ndarray  # [R] int64
    slot_mapping: np.ndarray  # [R] int64
    block_tables: np.ndarray  # [R, W] int32: each row its sequence's table
    seq_lens: np.ndarray  # [R] int32: each row's context length, position + 1


def decode_rows(decodes: list[ScheduledSeq], starts: list[int], tables: np.ndarray, block_size: int) -> DecodeRows:
    """``decodes``: D sequences each computing its last token (``num_new_tokens`` = 1 + its drafts);
    ``starts``: [D] their computed tokens; ``tables``: [D, W] int32, their padded block tables."""
    token_ids = [s.seq.token_ids[start] for s, start in zip(decodes, starts)]
    counts = [s.num_new_tokens for s in decodes]  # [D] 1 + k
    if counts.count(1) == len(counts):
        # No drafts: one row per sequence, in Python over D ints. On the loop thread, which prepares a
        # step right after it wakes, each numpy call costs tens of microseconds (cold code), a
        # comprehension a few (measured on the loop thread's CPU time per step).
        slots = [s.seq.block_table[p // block_size] * block_size + p % block_size for s, p in zip(decodes, starts)]
        return DecodeRows(token_ids, np.array(starts, dtype=np.int64), np.array(slots, dtype=np.int64), tables,
                          np.array([p + 1 for p in starts], dtype=np.int32))
    counts = np.array(counts, dtype=np.int64)
    token_ids = [t for s, first in zip(decodes, token_ids) for t in (first, *s.draft_token_ids)]
    owner = np.repeat(np.arange(len(decodes)), counts)  # [R] each row's sequence
    first_row = np.repeat(np.cumsum(counts) - counts, counts)  # [R] its sequence's first row
    positions = np.array(starts, dtype=np.int64)[owner] + np.arange(len(owner)) - first_row
    blocks = tables[owner, positions // block_size].astype(np.int64)  # [R] the block each row writes
    return DecodeRows(token_ids, positions, blocks * block_size + positions % block_size, tables[owner],
                      (positions + 1).astype(np.int32))

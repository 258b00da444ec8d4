"""What rank 0 of a tensor-parallel group tells its other ranks about the MTP layer's work in a step, so
that every rank runs the same MTP forwards (each one holds collectives: the split attention's and
experts' all-reduces, the vocabulary-parallel embedding and the draft logits' all-gather) and keeps the
same draft seeds. Flat int64 tensors, sent with the step message's broadcast (engines/parallel/tp_runner.py);
the kinds do not collide with engines/parallel/step_message.py's.

- CHAIN, before the step's message: the sequences whose drafts 2..k the MTP layer computes, with
  ``[MTP_CHAIN, C, W, seq_ids [C], lengths [C] (k of each), num_tokens [C], block_tables [C * W]]``.
- CATCH_UP, after rank 0 sampled: ``[MTP_CATCH_UP, T, S, R, next_ids [T] (the token after each row),
  last_rows [S] (each seeded sequence's last verified row), seq_ids [S], released [R]]``, ``released``
  being the sequences rank 0 let go of since its last message (the other ranks drop their seeds).
"""

from dataclasses import dataclass

import numpy as np
import torch

MTP_CHAIN, MTP_CATCH_UP = 21, 22
KINDS = (MTP_CHAIN, MTP_CATCH_UP)


@dataclass(slots=True)
class Chain:
    seq_ids: np.ndarray  # [C]
    lengths: np.ndarray  # [C] the number of drafts of each
    num_tokens: np.ndarray  # [C] each sequence's tokens (its last at position num_tokens - 1)
    block_tables: np.ndarray  # [C, W] int32, zero-padded


@dataclass(slots=True)
class CatchUp:
    next_ids: np.ndarray  # [T]
    last_rows: np.ndarray  # [S]
    seq_ids: np.ndarray  # [S]
    released: np.ndarray  # [R]


def encode_chain(chain: Chain) -> torch.Tensor:
    c, w = chain.block_tables.shape
    parts = [np.array([MTP_CHAIN, c, w]), chain.seq_ids, chain.lengths, chain.num_tokens, chain.block_tables.reshape(-1)]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64))


def encode_catch_up(catch_up: CatchUp) -> torch.Tensor:
    header = [MTP_CATCH_UP, len(catch_up.next_ids), len(catch_up.last_rows), len(catch_up.released)]
    parts = [np.array(header), catch_up.next_ids, catch_up.last_rows, catch_up.seq_ids, catch_up.released]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64))


def decode(message: torch.Tensor) -> Chain | CatchUp:
    values = message.numpy()
    if values[0] == MTP_CHAIN:
        c, w = int(values[1]), int(values[2])
        seq_ids, lengths, num_tokens, tables = np.split(values[3:], [c, 2 * c, 3 * c])
        return Chain(seq_ids, lengths, num_tokens, tables.reshape(c, w).astype(np.int32))
    t, s = int(values[1]), int(values[2])
    next_ids, last_rows, seq_ids, released = np.split(values[4:], [t, t + s, t + 2 * s])
    return CatchUp(next_ids, last_rows, seq_ids, released)

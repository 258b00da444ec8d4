"""Split one step's varlen batch into micro-batches of whole sequences, for pipeline parallelism.

Each micro-batch is a contiguous run of the step's sequences (still decode-first) with its own
``AttentionMetadata``, cut from the step's by slicing only: no tensor is copied to or from the host,
so every rank of a pipeline cuts the same micro-batches from the same step without talking.
"""

from dataclasses import dataclass
from itertools import pairwise

import torch

from xinserve.kernels.attention_metadata import AttentionMetadata, DecodeGather


@dataclass(slots=True)
class MicroBatch:
    input_ids: torch.Tensor  # [t] int64
    positions: torch.Tensor  # [t] int64
    metadata: AttentionMetadata
    rows: tuple[int, int]  # its token rows [start, end) in the step's batch


def token_starts(metadata: AttentionMetadata) -> list[int]:
    """[S + 1]: the first token row of each sequence, then the step's token count."""
    d = metadata.num_decode_seqs
    return list(range(d)) + [d + q for q in metadata.prefill_query_start_loc]


def split_point(starts: list[int]) -> int:
    """The sequence that starts the second half: the one that leaves the two token counts closest."""
    total = starts[-1]
    return min(range(1, len(starts) - 1), key=lambda s: abs(total - 2 * starts[s]))


def micro_batches(input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                  count: int = 2) -> list[MicroBatch]:
    """Up to ``count`` micro-batches (fewer when the step has fewer sequences), halving the largest
    token run until there are enough."""
    starts = token_starts(metadata)
    cuts = [0, len(starts) - 1]  # sequence boundaries
    while len(cuts) - 1 < count:
        spans = [(starts[b] - starts[a], i) for i, (a, b) in enumerate(pairwise(cuts)) if b - a > 1]
        if not spans:
            break
        _, i = max(spans)
        a, b = cuts[i], cuts[i + 1]
        cuts.insert(i + 1, a + split_point([x - starts[a] for x in starts[a : b + 1]]))
    return [_cut(input_ids, positions, metadata, starts, a, b) for a, b in pairwise(cuts)]


def _cut(input_ids: torch.Tensor, positions: torch.Tensor, m: AttentionMetadata, starts: list[int], a: int,
         b: int) -> MicroBatch:
    """Sequences [a, b) of the step."""
    d = m.num_decode_seqs
    t0, t1 = starts[a], starts[b]
    p0, p1 = max(a - d, 0), max(b - d, 0)  # its prefill sequences, over the step's prefills
    qsl = m.prefill_query_start_loc[p0 : p1 + 1]
    gather = None
    if a < d and m.decode_gather is not None:
        gather = _cut_gather(m.decode_gather, a, min(b, d), d)
    metadata = AttentionMetadata(
        slot_mapping=m.slot_mapping[t0:t1],
        block_tables=m.block_tables[a:b],
        seq_lens=m.seq_lens[a:b],
        num_decode_seqs=max(min(b, d) - a, 0),
        prefill_query_start_loc=[q - qsl[0] for q in qsl] if p1 > p0 else [0],
        prefill_seq_lens=m.prefill_seq_lens[p0:p1],
        decode_gather=gather,
        prefill_prompt_lens=None if m.prefill_prompt_lens is None else m.prefill_prompt_lens[p0:p1],
    )
    return MicroBatch(input_ids[t0:t1], positions[t0:t1], metadata, (t0, t1))


def _cut_gather(g: DecodeGather, a: int, b: int, d: int) -> DecodeGather:
    """Decode sequences [a, b) of a gather over ``d``: each sequence's blocks are one run of
    ``block_ids``; the context length stays the step's longest (the mask hides the rest)."""
    per_seq = len(g.block_ids) // d
    mask = None if g.mask is None else g.mask[a:b]
    host = None if g.host_seq_lens is None else g.host_seq_lens[a:b]
    return DecodeGather(g.block_ids[a * per_seq : b * per_seq], g.context_len, mask, host)

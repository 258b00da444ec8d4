"""What one step's attention needs, built by the runner and passed explicitly to the model."""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class DecodeGather:
    """What the reference decode attention derives from ``block_tables`` and ``seq_lens`` before it
    can attend: which blocks to gather and which gathered positions hold context. It depends only on
    the step, so the runner builds it once per step (from host copies, without a device sync) and
    every layer reuses it. Kernels that read the cache in place ignore it, except ``host_seq_lens``,
    which kernels that take the lengths on the host read (Ascend's paged attention, the reference DSA
    indexer).

    Shapes: S = decode sequences, Bg = blocks gathered per sequence, Lc = context_len <= Bg * BS.
    """

    block_ids: torch.Tensor  # [S * Bg] int64: each sequence's first Bg block ids, row by row
    context_len: int  # Lc: the first Lc gathered positions are attended (the longest context)
    mask: torch.Tensor | None  # [S, 1, 1, Lc] bool, True where a position holds context; None: all do
    host_seq_lens: torch.Tensor | None = None  # [S] int32 on the host: each context length

    def contexts(self, cache: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """cache [N, BS, ...] -> [S, Lc, ...]: each sequence's first Lc cached positions. Whole
        blocks are copied (index_select over rows of BS * ... values copies contiguous runs, several
        times faster than advanced indexing), then cut to the longest context."""
        num_blocks = cache.shape[0]
        rows = cache.view(num_blocks, -1).index_select(0, self.block_ids)  # [S * Bg, BS * ...]
        return rows.view(num_seqs, -1, *cache.shape[2:])[:, : self.context_len]

    def live(self, num_seqs: int, block_size: int) -> "DecodeGather":
        """This plan cut to the longest context ``host_seq_lens`` holds. A decode bucket's plan
        (engines/worker/decode_buckets.py) spans max_model_len so that its shapes never change; the reference
        decode kernels, opaque ops inside a compiled bucket, gather only the live blocks through this."""
        context_len = int(self.host_seq_lens.max())
        width = self.block_ids.numel() // num_seqs  # Bg
        block_ids = self.block_ids.view(num_seqs, width)[:, : -(-context_len // block_size)].reshape(-1)
        mask = None if self.mask is None else self.mask[..., :context_len]
        return DecodeGather(block_ids, context_len, mask, self.host_seq_lens)


def build_decode_gather(
    block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int, device: torch.device
) -> DecodeGather:
    """The gather plan from host copies ([S, B] block tables, [S] lengths): only the blocks that the
    longest context needs, and no mask when every context has the same length."""
    context_len = int(seq_lens.max())
    num_blocks = -(-context_len // block_size)
    mask = None
    if seq_lens.min() < context_len:
        visible = np.arange(context_len)[None, :] < seq_lens[:, None]  # [S, Lc]
        mask = torch.from_numpy(visible.reshape(len(seq_lens), 1, 1, context_len)).to(device, non_blocking=True)
    block_ids = np.ascontiguousarray(block_tables[:, :num_blocks], dtype=np.int64).reshape(-1)
    host_seq_lens = torch.from_numpy(np.array(seq_lens, dtype=np.int32))  # a copy, not a view
    block_ids_device = torch.from_numpy(block_ids).to(device, non_blocking=True)
    return DecodeGather(block_ids_device, context_len, mask, host_seq_lens)


@dataclass(slots=True)
class AttentionMetadata:
    """One varlen batch. Sequences are ordered decode-first: the first ``num_decode_seqs``
    sequences have exactly one new token each, and those are tokens ``[0, num_decode_seqs)``
    (a sequence verifying k drafts is 1 + k of them, one per row with its own context length and the
    same block table: engines/worker/decode_rows.py). The remaining sequences (prefills, possibly chunked,
    possibly after a cached prefix) follow.

    Shapes: T = new tokens this step, S = sequences this step, B = max blocks per sequence.
    """

    slot_mapping: torch.Tensor  # [T] int64: KV slot of each new token = block_id * block_size + offset
    block_tables: torch.Tensor  # [S, B] int32, padded with 0 past each sequence's blocks
    seq_lens: torch.Tensor  # [S] int32: context length after this step (cached + new tokens)
    num_decode_seqs: int  # D: sequences (and tokens) [0, D) are single-token decodes
    # Host copies for the prefill part, for per-sequence loops and for vendor kernels that take
    # host lists (e.g. Ascend's actual_seq_lengths). Indexed over the prefill sequences only.
    prefill_query_start_loc: list[int]  # [P + 1] cumulative new-token counts, from 0 (= token D)
    prefill_seq_lens: list[int]  # [P] context lengths after this step
    # The decode part's gather plan (see DecodeGather); None when there is no decode part.
    decode_gather: DecodeGather | None = None
    # [P] each prefill sequence's prompt length (the DSA indexer ranks a prompt token's row over the
    # whole prompt, as transformers does); None: as long as its context after this step.
    prefill_prompt_lens: list[int] | None = None

    @property
    def num_prefill_seqs(self) -> int:
        return len(self.prefill_seq_lens)

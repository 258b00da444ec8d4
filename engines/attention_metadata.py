"""What one step's attention needs, built by the runner and passed explicitly to the model."""

from dataclasses import dataclass

import torch

from kernels.reference import DecodeGather


@dataclass(slots=True)
class AttentionMetadata:
    """One varlen batch. Sequences are ordered decode-first: the first ``num_decode_seqs``
    sequences have exactly one new token each, and those are tokens ``[0, num_decode_seqs)``.
    The remaining sequences (prefills, possibly chunked, possibly after a cached prefix) follow.

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
    # Optional: the decode part's gather index and mask, built once per step from host copies so
    # that the reference decode kernel does not rebuild them in every layer. None: derived per call.
    decode_gather: DecodeGather | None = None

    @property
    def num_prefill_seqs(self) -> int:
        return len(self.prefill_seq_lens)

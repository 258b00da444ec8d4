"""Padded decode buckets: a pure-decode step's inputs copied into preallocated static-shaped
buffers, so a compiled or graph-captured decode forward sees the same shapes and addresses every
step.

A step of n decoding sequences runs in the smallest bucket (1, 2, 4, 8, ... up to max_num_seqs)
that holds n. Rows [n, bucket) are padding: token 0 at position 0, a context of one token, whose
key/value go to a scratch KV block that the block manager never hands out (the runner allocates it
past the pool), so they never touch a real sequence's cache; their logits are dropped.
"""

import torch

from kernels.attention_metadata import AttentionMetadata, DecodeGather


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself: 1, 2, 4, ..., max."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest bucket that holds ``num_seqs`` rows; None when none does."""
    return next((size for size in sizes if size >= num_seqs), None)


class DecodeBuffers:
    """The static inputs of every bucket: tensors of the largest bucket whose first rows each bucket
    views. ``fill`` copies one step's decode inputs in place and pads the rest of the bucket.

    Shapes: Bmax = largest bucket, W = blocks of the longest possible context (max_model_len).
    """

    def __init__(self, sizes: list[int], max_model_len: int, block_size: int, scratch_block: int,
                 device: torch.device) -> None:
        self.sizes = sizes
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.width = -(-max_model_len // block_size)  # W
        rows = sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)  # [Bmax]
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)  # [Bmax]
        self.slot_mapping = torch.zeros(rows, dtype=torch.int64, device=device)  # [Bmax]
        self.block_tables = torch.zeros(rows, self.width, dtype=torch.int32, device=device)  # [Bmax, W]
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)  # [Bmax]
        # What the reference kernel's gather plan needs, kept static: every row gathers all W blocks
        # and masks the positions past its length (kernels reading the cache in place ignore these).
        self.block_ids = torch.zeros(rows * self.width, dtype=torch.int64, device=device)  # [Bmax * W]
        self.mask = torch.zeros(rows, 1, 1, self.width * block_size, dtype=torch.bool, device=device)
        self.host_seq_lens = torch.ones(rows, dtype=torch.int32)  # [Bmax] on the host (Ascend)
        self._arange = torch.arange(self.width * block_size, device=device)
        # One metadata object per bucket, of views that never move: a compiled function's guards
        # and a captured graph's addresses stay valid from step to step.
        self.metadata = {size: self._metadata(size) for size in sizes}

    def _metadata(self, size: int) -> AttentionMetadata:
        gather = DecodeGather(
            block_ids=self.block_ids[: size * self.width],
            context_len=self.width * self.block_size,
            mask=self.mask[:size],
            host_seq_lens=self.host_seq_lens[:size],
        )
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            num_decode_seqs=size,
            prefill_query_start_loc=[0],
            prefill_seq_lens=[],
            decode_gather=gather,
        )

    def fill(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Copy a pure-decode step (n rows) into the buffers and pad up to ``size``, its bucket
        (``bucket_for``); False when the step does not fit (a block table wider than W), and the
        caller runs it eagerly."""
        n = input_ids.shape[0]
        tables = metadata.block_tables  # [n, w] int32
        if tables.shape[1] > self.width or metadata.decode_gather is None:
            return False
        w = tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:size].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:size].zero_()
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:size].fill_(self.scratch_block * self.block_size)
        self.block_tables[:n, :w].copy_(tables)
        self.block_tables[:n, w:].zero_()
        self.block_tables[n:size].fill_(self.scratch_block)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:size].fill_(1)
        self.host_seq_lens[:n].copy_(metadata.decode_gather.host_seq_lens)
        self.host_seq_lens[n:size].fill_(1)
        self.block_ids[: size * self.width].copy_(self.block_tables[:size].reshape(-1))
        torch.lt(self._arange, self.seq_lens[:size, None], out=self.mask[:size, 0, 0])
        return True

    def pad(self, size: int) -> None:
        """Make rows [0, size) all padding: what compiling, capturing and timing a bucket run on."""
        self.input_ids[:size].zero_()
        self.positions[:size].zero_()
        self.slot_mapping[:size].fill_(self.scratch_block * self.block_size)
        self.block_tables[:size].fill_(self.scratch_block)
        self.seq_lens[:size].fill_(1)
        self.host_seq_lens[:size].fill_(1)
        self.block_ids[: size * self.width].fill_(self.scratch_block)
        torch.lt(self._arange, self.seq_lens[:size, None], out=self.mask[:size, 0, 0])

    def inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [size], positions [size], metadata) of a bucket: views of the buffers."""
        return self.input_ids[:size], self.positions[:size], self.metadata[size]

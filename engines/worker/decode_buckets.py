"""Padded decode buckets: a pure-decode step's inputs copied into preallocated static-shaped
buffers, so a compiled or graph-captured decode forward sees the same shapes and addresses every
step.

A step of n decode rows runs in the smallest bucket (1, 2, 4, 8, ... up to the most rows a step can
have, ``max_decode_rows``) that holds n. A row is one decode query (engines/worker/decode_rows.py): a plain
decode is one row, a sequence verifying k drafts is 1 + k rows with their own context lengths. Buckets
are keyed by total rows rather than (sequences, rows per sequence): a step mixing drafting and
non-drafting sequences, or sequences with fewer drafts than k (prompt lookup often finds fewer), then
pads only up to the next bucket (less than half its rows), never each sequence up to 1 + k rows, and
speculation needs no bucket shapes of its own while its rows fit the plain buckets (8 drafting
sequences x 4 rows = 32 rows, below the default 64 sequences). Rows [n, bucket) are padding: token 0 at position 0, a context of one token, whose
key/value go to a scratch KV block that the block manager never hands out (the runner allocates it
past the pool), so they never touch a real sequence's cache; their logits are dropped.
"""

import numpy as np
import torch

from xinserve.engines.config import EngineConfig
from xinserve.engines.platforms import is_host
from xinserve.engines.speculative.config import parse_speculative_config
from xinserve.kernels.attention_metadata import AttentionMetadata, DecodeGather


def max_decode_rows(config: EngineConfig) -> int:
    """The most rows a pure-decode step can have: one per sequence, or 1 + k per drafted sequence
    while at most ``disable_by_batch_size`` sequences run (engines/speculative/proposer.py), within
    the step's token budget."""
    if config.speculative_config is None:
        return config.max_num_seqs
    spec = parse_speculative_config(config.speculative_config)
    drafting = min(config.max_num_seqs, spec.disable_by_batch_size)
    return max(config.max_num_seqs, min(drafting * (1 + spec.num_speculative_tokens), config.max_num_batched_tokens))


def bucket_sizes(max_rows: int) -> list[int]:
    """Powers of two below ``max_rows``, then ``max_rows`` itself: 1, 2, 4, ..., max."""
    sizes = []
    size = 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return [*sizes, max_rows]


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
        # What ``fill`` writes through: on the CPU numpy views of the same memory (a numpy slice
        # assignment costs ~1 us where a torch op on a small tensor costs ~3-5 us), else the tensors.
        self._xp = np if is_host(self.input_ids.device) else torch
        names = ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "block_ids", "mask", "_arange")
        self._views = {name: _host_view(getattr(self, name), self._xp) for name in names}
        self._host_seq_lens = self.host_seq_lens.numpy()  # on the host on every device
        # A number written into a slice: a torch ``view[...] = 0`` first makes a 0-dim tensor of it (an
        # allocation per step); ``fill_`` takes the number as it is.
        self._fill = _fill_array if self._xp is np else torch.Tensor.fill_

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

    def fill(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
             host_seq_lens: np.ndarray) -> bool:
        """Copy a pure-decode step (n rows) into the buffers and pad up to ``size``, its bucket
        (``bucket_for``); False when the step does not fit (a block table wider than W), and the
        caller runs it eagerly. ``host_seq_lens``: [n] int32, the rows' context lengths on the host
        (the step's ``HostInputs``): nothing here reads a device value back, so a fill never waits for
        the device (async scheduling fills step N+1 while N runs) and allocates nothing.

        Padding rows do no real work: a context of one token in the scratch block (their table is the
        scratch block only), so a kernel that splits each context by its own length reads one block
        for them whatever the bucket's table width (max_model_len) is."""
        n = input_ids.shape[0]
        tables = metadata.block_tables  # [n, w] int32
        if tables.shape[1] > self.width:
            return False
        w = tables.shape[1]
        v, xp, fill = self._views, self._xp, self._fill
        v["input_ids"][:n] = _host_view(input_ids, xp)
        fill(v["input_ids"][n:size], 0)
        v["positions"][:n] = _host_view(positions, xp)
        fill(v["positions"][n:size], 0)
        v["slot_mapping"][:n] = _host_view(metadata.slot_mapping, xp)
        fill(v["slot_mapping"][n:size], self.scratch_block * self.block_size)
        v["block_tables"][:n, :w] = _host_view(tables, xp)
        fill(v["block_tables"][:n, w:], 0)
        fill(v["block_tables"][n:size], self.scratch_block)
        v["seq_lens"][:n] = _host_view(metadata.seq_lens, xp)
        fill(v["seq_lens"][n:size], 1)
        self._host_seq_lens[:n] = host_seq_lens
        self._host_seq_lens[n:size] = 1
        v["block_ids"][: size * self.width] = v["block_tables"][:size].reshape(-1)
        xp.less(v["_arange"], v["seq_lens"][:size, None], out=v["mask"][:size, 0, 0])
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


def _host_view(tensor: torch.Tensor, xp) -> "np.ndarray | torch.Tensor":
    """``tensor`` as ``fill`` writes or reads it: a numpy view of its memory on the CPU, else itself."""
    return tensor.numpy() if xp is np else tensor


def _fill_array(view: np.ndarray, value: int) -> None:
    view.fill(value)

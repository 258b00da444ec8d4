"""A step's inputs (``StepBatch``): the scheduled sequences flattened decode-first into token rows, on
the host and on the device.

Built on the loop thread for every step (with async scheduling while the step before runs, engines/
async_scheduling.py), so its Python per sequence is kept small: the block tables are kept from step to
step (``BlockTables``: a steady decode step rewrites only the rows whose table changed), the decode rows
are a few numpy operations over all sequences (engines/worker/decode_rows.py), and on the CPU the arrays
become tensors without a copy.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from xinserve.engines.core.scheduler import ScheduledSeq
from xinserve.engines.core.sequence import Sequence, needs_prompt_logits
from xinserve.engines.lora.rows import lora_rows
from xinserve.engines.platforms import is_host
from xinserve.engines.speculative.verify import draft_logits_indices
from xinserve.engines.worker.decode_rows import decode_rows
from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather


@dataclass(slots=True)
class HostInputs:
    """The host arrays a step's device inputs were copied from: a tensor-parallel rank 0 sends these
    to its other ranks (engines/parallel/rank_messages.py) without copying anything back from the device."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [S, B] int32
    seq_lens: np.ndarray  # [S] int32
    logits_indices: np.ndarray | None  # [N] int64


@dataclass(slots=True)
class StepBatch:
    """Device inputs of one step plus which sequences get a new token from it.

    Rows are decode-first: the single-token sequences form the vectorized decode part of attention,
    the multi-token ones end the batch. ``seqs``, ``starts`` and ``num_new`` say whose rows are
    whose, in that order (empty in a batch a tensor-parallel follower rebuilt)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    # [N] int64: flat index of the last token of each sampled sequence; None when that is every token
    logits_indices: torch.Tensor | None
    sampled: list[Sequence]  # N sequences whose computed tokens reach their end this step
    host: HostInputs | None = None  # set by ``StepInputs.prepare``; None in a batch rebuilt by a follower
    seqs: list[Sequence] = field(default_factory=list)  # S, in row order
    starts: list[int] = field(default_factory=list)  # [S] the position of each one's first row
    num_new: list[int] = field(default_factory=list)  # [S] its row count
    # [N] each sampled sequence's draft tokens (its last 1 + k rows all have logits); empty without drafts
    drafts: list[list[int]] = field(default_factory=list)
    # LoRA (engines/lora/rows.py): [T] int64 each row's adapter slot (-1: base model), None without LoRA;
    # the (slot, adapter id) pairs the step's rows read
    lora_slots: np.ndarray | None = None
    lora_pairs: list[tuple[int, int]] = field(default_factory=list)

    def spans(self) -> Iterator[tuple[Sequence, int, int, int]]:
        """(sequence, its first position, its first row, its row count), in row order."""
        row = 0
        for seq, start, count in zip(self.seqs, self.starts, self.num_new):
            yield seq, start, row, count
            row += count

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether a sequence asks for its prompt's log-probs (echo with logprobs) in this step."""
        return any(needs_prompt_logits(seq) for seq in self.seqs)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``; on the CPU a view of it (``Tensor.to`` would return the same
    tensor, after parsing its arguments: a few microseconds per input per step)."""
    tensor = torch.from_numpy(array)
    return tensor if is_host(device) else tensor.to(device, non_blocking=True)


class BlockTables:
    """The step's block tables, [S, W] int32 padded with 0, kept from step to step: row i is written
    again only when sequence i's table differs from the one written there the step before (a decoding
    sequence takes a new block every ``block_size`` steps; another sequence moved into that row). So a
    steady decode step of S sequences compares S lists and writes a few rows, instead of padding S
    lists and converting them."""

    def __init__(self) -> None:
        self._array = np.zeros((0, 0), dtype=np.int32)  # [rows, columns]: the capacity so far
        self._written: list[list[int]] = []  # [rows] each row's table as written (copies)

    def __call__(self, seqs: list[Sequence]) -> np.ndarray:
        """[len(seqs), W] int32, W the longest table: a new array, which the step keeps while later
        steps are prepared."""
        tables = [seq.block_table for seq in seqs]
        width = max(map(len, tables))
        if len(tables) > self._array.shape[0] or width > self._array.shape[1]:
            self._grow(len(tables), width)
        array, written = self._array, self._written
        for i in [i for i, (table, old) in enumerate(zip(tables, written)) if table != old]:
            table = tables[i]
            array[i, : len(table)] = table
            array[i, len(table) :] = 0
            written[i] = table.copy()
        return array[: len(tables), :width].copy()

    def _grow(self, rows: int, columns: int) -> None:
        old = self._array
        rows, columns = max(rows, old.shape[0]), max(2 * columns, old.shape[1])  # columns: room to grow
        self._array = np.zeros((rows, columns), dtype=np.int32)
        self._array[: old.shape[0], : old.shape[1]] = old
        self._written += [[] for _ in range(rows - len(self._written))]  # an empty table: a row of zeros


class StepInputs:
    """Builds each step's ``StepBatch`` on one device, with blocks of ``block_size`` tokens."""

    def __init__(self, block_size: int, device: torch.device, with_lora: bool = False) -> None:
        self.block_size = block_size
        self.device = device
        self.with_lora = with_lora  # each row's adapter slot is a step input
        self.block_tables = BlockTables()

    def prepare(self, scheduled: list[ScheduledSeq], with_gather: bool = True) -> StepBatch:
        """The step's inputs, decode-first (``StepBatch``), on the device and on the host. ``with_gather``
        False (on the CPU): the decode part's gather plan is left out, for ``plan_gather`` to add when
        the step runs eagerly (a compiled decode bucket does not read it: engines/worker/decode_buckets.py)."""
        bs, device = self.block_size, self.device
        # Decode rows first: plain decodes and drafted sequences' 1 + k rows (engines/worker/decode_rows.py).
        num_new = [s.num_new_tokens for s in scheduled]
        plain = num_new.count(1) == len(num_new)  # the usual step: only decodes, without drafts
        if plain:
            decodes, prefills = scheduled, []
        else:
            decodes = [s for s in scheduled if s.num_new_tokens == 1 + len(s.draft_token_ids)]
            prefills = [s for s in scheduled if s.num_new_tokens != 1 + len(s.draft_token_ids)]
            num_new = [s.num_new_tokens for s in decodes + prefills]
        ordered = decodes + prefills if prefills else decodes
        seqs = [s.seq for s in ordered]
        starts = [seq.num_computed_tokens for seq in seqs]
        block_tables = self.block_tables(seqs)  # [S, W]
        rows = decode_rows(decodes, starts[: len(decodes)], block_tables[: len(decodes)], bs)
        num_decode = len(rows.positions)  # decode rows, each its own decode query
        ids, positions, slot_mapping, seq_lens = rows.token_ids, rows.positions, rows.slot_mapping, rows.seq_lens
        query_start_loc = [0]
        prefill_lens = [start + n for start, n in zip(starts[len(decodes) :], num_new[len(decodes) :])]
        if prefills:
            pos_parts, slot_parts = [positions], [slot_mapping]
            for s, start, n in zip(prefills, starts[len(decodes) :], num_new[len(decodes) :]):
                seq = s.seq
                ids.extend(seq.token_ids[start : start + n])
                pos = np.arange(start, start + n, dtype=np.int64)
                pos_parts.append(pos)
                slot_parts.append(np.asarray(seq.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs)
                query_start_loc.append(query_start_loc[-1] + n)
            positions, slot_mapping = np.concatenate(pos_parts), np.concatenate(slot_parts)
            block_tables = np.concatenate([rows.block_tables, block_tables[len(decodes) :]])
            seq_lens = np.concatenate([rows.seq_lens, np.array(prefill_lens, dtype=np.int32)])
        else:
            block_tables = rows.block_tables
        decode_gather = None if not num_decode or not with_gather else build_decode_gather(
            block_tables[:num_decode], seq_lens[:num_decode], bs, device)
        metadata = AttentionMetadata(
            slot_mapping=to_device(slot_mapping, device),
            block_tables=to_device(block_tables, device),
            seq_lens=to_device(seq_lens, device),
            num_decode_seqs=num_decode,
            prefill_query_start_loc=query_start_loc,
            prefill_seq_lens=prefill_lens,
            decode_gather=decode_gather,
            prefill_prompt_lens=[s.seq.num_prompt_tokens for s in prefills],
        )
        # A sequence gets a token when this step's tokens reach its end (not mid-prompt chunks).
        num_drafts = [0] * len(seqs) if plain else [len(s.draft_token_ids) for s in ordered]
        is_sampled = [start + n == len(seq.token_ids) + k
                      for start, n, seq, k in zip(starts, num_new, seqs, num_drafts)]
        logits_indices = None  # None: every token is sampled, in order, so no gather is needed
        if prefills or not all(is_sampled):
            logits_indices = draft_logits_indices(num_new, num_drafts, is_sampled)
        host = HostInputs(np.array(ids, dtype=np.int64), positions, slot_mapping, block_tables, seq_lens,
                          logits_indices)
        lora_slots, lora_pairs = lora_rows(seqs, num_new) if self.with_lora else (None, [])
        return StepBatch(
            input_ids=to_device(host.input_ids, device),
            positions=to_device(host.positions, device),
            metadata=metadata,
            logits_indices=None if logits_indices is None else to_device(logits_indices, device),
            sampled=seqs if logits_indices is None else [seq for seq, yes in zip(seqs, is_sampled) if yes],
            host=host,
            seqs=seqs,
            starts=starts,
            num_new=num_new,
            drafts=[s.draft_token_ids for s, yes in zip(ordered, is_sampled) if yes] if any(num_drafts) else [],
            lora_slots=lora_slots,
            lora_pairs=lora_pairs,
        )

    def plan_gather(self, batch: StepBatch) -> None:
        """Add the decode part's gather plan to a batch prepared without it (``prepare``)."""
        metadata, host = batch.metadata, batch.host
        d = metadata.num_decode_seqs
        if d and metadata.decode_gather is None:
            metadata.decode_gather = build_decode_gather(host.block_tables[:d], host.seq_lens[:d], self.block_size,
                                                         self.device)

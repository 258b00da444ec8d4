"""What rank 0 of a tensor / pipeline-parallel group sends its other ranks, one message per broadcast:
every kind in one enum, one dataclass per message, ``pack`` and ``unpack`` between them and the wire.

The wire is a flat int64 host tensor (engines/parallel/distributed.py's ``broadcast_message``):
``[kind, ...]``, then the message's own fields:

- STEP, before every forward: a ``StepHeader``, then input_ids [T], positions [T], slot_mapping [T],
  block_tables [S * B], seq_lens [S], prefill_query_start_loc [P + 1], prefill_prompt_lens [P],
  logits_indices [N] (when present) and R (row, count) pairs: the rows of the prompts whose log-probs
  rank 0 computes this step, in the order it computes them, and with LoRA each row's adapter slot [T] and
  L (slot, adapter id) pairs. A follower rebuilds the same ``StepBatch``.
- LORA_LOAD ``[adapter_id, path as UTF-8 bytes...]``: read an adapter's host copy; LORA_DROP ``[adapter_id]``:
  let it go (engines/lora/registry.py decides both on rank 0).
- ALLOCATE ``[num_blocks]``: allocate the KV pool. PROFILE ``[fraction * 1e9]``: measure how many KV
  blocks fit in that fraction of the free memory. STOP ``[]``: leave the group.
- MTP_CHAIN, before a step of speculative method ``mtp``: the sequences whose drafts 2..k the MTP layer
  computes, ``[C, W, seq_ids [C], lengths [C], num_tokens [C], block_tables [C * W]]``.
- MTP_CATCH_UP, after rank 0 sampled: ``[T, S, R, next_ids [T], last_rows [S], seq_ids [S], released [R]]``.
  Every rank runs the same MTP forwards (each holds collectives) and keeps the same draft seeds
  (engines/speculative/mtp_runner.py).
"""

from dataclasses import dataclass
from enum import IntEnum, unique
from typing import NamedTuple

import numpy as np
import torch

from xinserve.engines.worker.step_inputs import StepBatch
from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather

PROFILE_SCALE = 1e9  # PROFILE's fraction travels as an int of this many parts


@unique
class Kind(IntEnum):
    STEP = 1
    ALLOCATE = 2
    PROFILE = 3
    STOP = 4
    MTP_CHAIN = 5
    MTP_CATCH_UP = 6
    LORA_LOAD = 7
    LORA_DROP = 8


@dataclass(slots=True)
class Step:
    """``batch``: as ``ModelRunner._prepare`` built it (rank 0 sends its host arrays, so nothing is copied
    back from the device); unpacked, its ``sampled`` holds N placeholders. ``prompt_rows``: None on the
    normal path; else the (first row, count) of each prompt log-probs logits computation."""

    batch: StepBatch
    prompt_rows: list[tuple[int, int]] | None


@dataclass(slots=True)
class Allocate:
    num_blocks: int


@dataclass(slots=True)
class Profile:
    fraction: float  # of the free memory the KV pool may take


@dataclass(slots=True)
class Stop:
    pass


@dataclass(slots=True)
class Chain:
    seq_ids: np.ndarray  # [C]
    lengths: np.ndarray  # [C] the number of drafts of each
    num_tokens: np.ndarray  # [C] each sequence's tokens (its last at position num_tokens - 1)
    block_tables: np.ndarray  # [C, W] int32, zero-padded


@dataclass(slots=True)
class CatchUp:
    next_ids: np.ndarray  # [T] the token after each row's
    last_rows: np.ndarray  # [S] each seeded sequence's last verified row
    seq_ids: np.ndarray  # [S]
    released: np.ndarray  # [R] the sequences rank 0 let go of since its last message (drop their seeds)


@dataclass(slots=True)
class LoraLoad:
    adapter_id: int
    path: str


@dataclass(slots=True)
class LoraDrop:
    adapter_id: int


RankMessage = Step | Allocate | Profile | Stop | Chain | CatchUp | LoraLoad | LoraDrop


class StepHeader(NamedTuple):
    num_tokens: int  # T
    num_seqs: int  # S
    table_width: int  # B
    num_decode_seqs: int  # D
    num_prefill_seqs: int  # P
    num_sampled: int  # N
    has_logits_indices: int  # 0 or 1
    prompt_mode: int  # 1: the step computes prompt log-probs (prompt_rows is not None)
    num_prompt_rows: int  # R
    has_lora: int  # 0 or 1: each row's adapter slot follows
    num_lora_pairs: int  # L


def pack(message: RankMessage) -> torch.Tensor:
    """The message as the flat int64 tensor that is broadcast."""
    match message:
        case Step():
            kind, parts = Kind.STEP, _step_parts(message)
        case Allocate(num_blocks):
            kind, parts = Kind.ALLOCATE, [np.array([num_blocks])]
        case Profile(fraction):
            kind, parts = Kind.PROFILE, [np.array([round(fraction * PROFILE_SCALE)])]
        case Stop():
            kind, parts = Kind.STOP, []
        case Chain(seq_ids, lengths, num_tokens, block_tables):
            kind, parts = Kind.MTP_CHAIN, [np.array(block_tables.shape), seq_ids, lengths, num_tokens,
                                           block_tables.reshape(-1)]
        case CatchUp(next_ids, last_rows, seq_ids, released):
            kind, parts = Kind.MTP_CATCH_UP, [np.array([len(next_ids), len(last_rows), len(released)]), next_ids,
                                              last_rows, seq_ids, released]
        case LoraLoad(adapter_id, path):
            kind, parts = Kind.LORA_LOAD, [np.array([adapter_id]), np.frombuffer(path.encode(), dtype=np.uint8)]
        case LoraDrop(adapter_id):
            kind, parts = Kind.LORA_DROP, [np.array([adapter_id])]
        case _:
            raise TypeError(f"not a rank message: {message!r}")
    return torch.from_numpy(np.concatenate([np.array([kind]), *parts]).astype(np.int64, copy=False))


def unpack(message: torch.Tensor, device: torch.device, block_size: int) -> RankMessage:
    """The message ``pack`` made; a STEP's tensors land on ``device`` (its decode gather plan for
    ``block_size``). An unknown kind raises ValueError."""
    kind, body = int(message[0]), message[1:]
    if kind == Kind.STEP:
        return _unpack_step(body, device, block_size)
    if kind == Kind.ALLOCATE:
        return Allocate(int(body[0]))
    if kind == Kind.PROFILE:
        return Profile(int(body[0]) / PROFILE_SCALE)
    if kind == Kind.STOP:
        return Stop()
    if kind == Kind.MTP_CHAIN:
        return _unpack_chain(body.numpy())
    if kind == Kind.MTP_CATCH_UP:
        return _unpack_catch_up(body.numpy())
    if kind == Kind.LORA_LOAD:
        return LoraLoad(int(body[0]), body[1:].numpy().astype(np.uint8).tobytes().decode())
    if kind == Kind.LORA_DROP:
        return LoraDrop(int(body[0]))
    raise ValueError(f"unknown rank message kind {kind}")


def _step_parts(step: Step) -> list[np.ndarray]:
    batch, prompt_rows = step.batch, step.prompt_rows
    m, host = batch.metadata, batch.host
    num_seqs, width = host.block_tables.shape
    rows = prompt_rows or []
    header = StepHeader(
        num_tokens=len(host.input_ids), num_seqs=num_seqs, table_width=width, num_decode_seqs=m.num_decode_seqs,
        num_prefill_seqs=m.num_prefill_seqs,
        num_sampled=len(batch.sampled) if host.logits_indices is None else len(host.logits_indices),
        has_logits_indices=int(host.logits_indices is not None), prompt_mode=int(prompt_rows is not None),
        num_prompt_rows=len(rows), has_lora=int(batch.lora_slots is not None), num_lora_pairs=len(batch.lora_pairs),
    )
    parts = [np.array(header), host.input_ids, host.positions, host.slot_mapping, host.block_tables.reshape(-1),
             host.seq_lens, np.array(m.prefill_query_start_loc, dtype=np.int64),
             np.array(m.prefill_prompt_lens or m.prefill_seq_lens, dtype=np.int64)]
    if host.logits_indices is not None:
        parts.append(host.logits_indices)
    parts.append(np.array(rows, dtype=np.int64).reshape(-1))
    if batch.lora_slots is not None:
        parts += [batch.lora_slots, np.array(batch.lora_pairs, dtype=np.int64).reshape(-1)]
    return parts


def _unpack_step(body: torch.Tensor, device: torch.device, block_size: int) -> Step:
    h = StepHeader(*body[: len(StepHeader._fields)].tolist())
    t, s, d, p = h.num_tokens, h.num_seqs, h.num_decode_seqs, h.num_prefill_seqs
    sizes = [t, t, t, s * h.table_width, s, p + 1, p, h.num_sampled if h.has_logits_indices else 0,
             2 * h.num_prompt_rows, t if h.has_lora else 0, 2 * h.num_lora_pairs]
    ids, pos, slots, tables, lens, qsl, prompt_lens, indices, rows, lora_slots, lora_pairs = body[
        len(StepHeader._fields) :].split(sizes)
    tables_np = tables.reshape(s, h.table_width).numpy().astype(np.int32)
    lens_np = lens.numpy().astype(np.int32)
    metadata = AttentionMetadata(
        slot_mapping=slots.to(device),
        block_tables=torch.from_numpy(tables_np).to(device),
        seq_lens=torch.from_numpy(lens_np).to(device),
        num_decode_seqs=d,
        prefill_query_start_loc=qsl.tolist(),
        prefill_seq_lens=lens_np[d:].tolist(),
        decode_gather=build_decode_gather(tables_np[:d], lens_np[:d], block_size, device) if d else None,
        prefill_prompt_lens=prompt_lens.tolist(),
    )
    batch = StepBatch(ids.to(device), pos.to(device), metadata, indices.to(device) if h.has_logits_indices else None,
                      sampled=[None] * h.num_sampled, lora_slots=lora_slots.numpy() if h.has_lora else None,
                      lora_pairs=[(slot, adapter) for slot, adapter in lora_pairs.reshape(-1, 2).tolist()])
    pairs = [(row, count) for row, count in rows.reshape(-1, 2).tolist()]
    return Step(batch, pairs if h.prompt_mode else None)


def _unpack_chain(values: np.ndarray) -> Chain:
    c, w = int(values[0]), int(values[1])
    seq_ids, lengths, num_tokens, tables = np.split(values[2:], [c, 2 * c, 3 * c])
    return Chain(seq_ids, lengths, num_tokens, tables.reshape(c, w).astype(np.int32))


def _unpack_catch_up(values: np.ndarray) -> CatchUp:
    t, s = int(values[0]), int(values[1])
    next_ids, last_rows, seq_ids, released = np.split(values[3:], [t, t + s, t + 2 * s])
    return CatchUp(next_ids, last_rows, seq_ids, released)

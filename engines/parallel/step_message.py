"""Rank 0's one message per step to the other ranks of a tensor-parallel group: a flat int64 tensor.

Layout: an 11-int header ``[kind, value, T, S, B, D, P, N, has_logits_indices, prompt_mode, R]``, then
input_ids [T], positions [T], slot_mapping [T], block_tables [S * B], seq_lens [S],
prefill_query_start_loc [P + 1], prefill_prompt_lens [P], logits_indices [N] (when present) and R
(row, count) pairs: the rows of the prompts whose log-probs rank 0 computes this step, in the order it
computes them. ``kind`` is STEP, or a command (ALLOCATE: ``value`` KV blocks; PROFILE: measure the KV pool with
``value`` / 1e9 of the free memory; STOP). A follower rebuilds the same ``StepBatch`` from it.
"""

import numpy as np
import torch

from xinserve.engines.worker.runner import StepBatch
from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather

STEP, ALLOCATE, PROFILE, STOP = 1, 2, 3, 4
HEADER = 11


def encode_command(kind: int, value: int = 0) -> torch.Tensor:
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0], header[1] = kind, value
    return header


def encode_step(batch: StepBatch, prompt_rows: list[tuple[int, int]] | None) -> torch.Tensor:
    """``batch``: as ``ModelRunner._prepare`` built it (its host arrays are sent, so nothing is copied
    back from the device). ``prompt_rows``: None on the normal path; else the step computes prompt
    log-probs too."""
    m, host = batch.metadata, batch.host
    num_seqs, width = host.block_tables.shape
    rows = prompt_rows or []
    header = [STEP, 0, len(host.input_ids), num_seqs, width, m.num_decode_seqs, m.num_prefill_seqs,
              len(batch.sampled) if host.logits_indices is None else len(host.logits_indices),
              host.logits_indices is not None, prompt_rows is not None, len(rows)]
    parts = [np.array(header, dtype=np.int64), host.input_ids, host.positions, host.slot_mapping,
             host.block_tables.reshape(-1), host.seq_lens, np.array(m.prefill_query_start_loc, dtype=np.int64),
             np.array(m.prefill_prompt_lens or m.prefill_seq_lens, dtype=np.int64)]
    if host.logits_indices is not None:
        parts.append(host.logits_indices)
    parts.append(np.array(rows, dtype=np.int64).reshape(-1))
    return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))


def decode_header(message: torch.Tensor) -> tuple[int, int]:
    """(kind, value) of any message."""
    return int(message[0]), int(message[1])


def decode_step(
    message: torch.Tensor, device: torch.device, block_size: int
) -> tuple[StepBatch, list[tuple[int, int]] | None]:
    """The ``StepBatch`` rank 0 built (its ``sampled`` holds N placeholders) and its prompt rows."""
    _, _, t, s, b, d, p, n, has_indices, prompt_mode, r = message[:HEADER].tolist()
    sizes = [t, t, t, s * b, s, p + 1, p, n if has_indices else 0, 2 * r]
    ids, pos, slots, tables, lens, qsl, prompt_lens, indices, rows = message[HEADER:].split(sizes)
    tables_np = tables.reshape(s, b).numpy().astype(np.int32)
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
    batch = StepBatch(ids.to(device), pos.to(device), metadata, indices.to(device) if has_indices else None,
                      sampled=[None] * n)
    pairs = rows.reshape(-1, 2).tolist()
    return batch, [(row, count) for row, count in pairs] if prompt_mode else None

"""How the Triton decode attention splits contexts (kernels/triton/decode_attention.py), under Triton's
interpreter: the split count comes from the table width and the batch, the split length from each
sequence's own context on the device. So in a captured decode bucket, whose block table spans
max_model_len, a padding row (a context of one token) loads one tile in one program and a real
context is spread over the splits as in an eager step, instead of one program walking it all."""

import os
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.triton is imported

import numpy as np
import pytest
import torch
import triton.language as tl

import xinserve.kernels.triton as triton_ops
from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.references import dense as reference
from xinserve.kernels.triton import decode_attention

HEAD_DIM, KV_HEADS, HEADS, BS = 8, 2, 6, 16
WIDTH = 8192 // BS  # a bucket's table: blocks of the longest context the engine allows


def bucket_like(seq_lens: list[int]) -> tuple[torch.Tensor, ...]:
    """(query, key cache, value cache, block tables [S, WIDTH] as a bucket holds them, lengths): real
    rows own distinct blocks, padding rows (length 1) point every entry at the last, scratch, block."""
    used = sum(-(-n // BS) for n in seq_lens)
    scratch = used
    tables = np.full((len(seq_lens), WIDTH), scratch, np.int32)
    start = 0
    for i, n in enumerate(seq_lens):
        if n > 1:
            blocks = -(-n // BS)
            tables[i, :blocks] = np.arange(start, start + blocks)
            tables[i, blocks:] = 0
            start += blocks
    cache = (used + 1, BS, KV_HEADS, HEAD_DIM)
    return (torch.randn(len(seq_lens), HEADS, HEAD_DIM), torch.randn(cache), torch.randn(cache),
            torch.from_numpy(tables), torch.tensor(seq_lens, dtype=torch.int32))


@pytest.fixture
def tiles_per_program(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """(sequence, KV head, split) -> K/V tiles that program loaded, for every launch while the test runs."""
    loads: Counter = Counter()
    real = decode_attention.load_kv_tile

    def counted(*args, **kwargs):
        loads[int(tl.program_id(0)), int(tl.program_id(1)), int(tl.program_id(2))] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_attention, "load_kv_tile", counted)
    return loads


def test_a_bucket_wide_table_matches_the_reference(tiles_per_program: Counter) -> None:
    torch.manual_seed(0)
    lens = [300, 1, 70, 1]  # two real rows, two padding rows
    query, key_cache, value_cache, tables, seq_lens = bucket_like(lens)
    got = triton_ops.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, HEAD_DIM**-0.5)
    gather = build_decode_gather(tables.numpy(), seq_lens.numpy(), BS, torch.device("cpu"))
    want = reference.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, HEAD_DIM**-0.5, gather)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_padding_rows_load_one_tile_and_real_contexts_spread_over_the_splits(tiles_per_program: Counter) -> None:
    lens = [300, 1, 70, 1]
    triton_ops.paged_decode_attention(*bucket_like(lens)[:5], HEAD_DIM**-0.5)
    tile = decode_attention.TOKENS_TILE
    splits = decode_attention.default_num_splits(WIDTH * BS, len(lens), KV_HEADS)
    assert splits > 1
    for seq, n in enumerate(lens):
        for head in range(KV_HEADS):
            programs = {split: count for (s, h, split), count in tiles_per_program.items() if (s, h) == (seq, head)}
            # every tile of the context loaded once, none past it
            assert sum(programs.values()) == -(-n // tile)
            # the longest program walks its share of this context, not a share of the table's width
            share = -(-n // splits)  # this context's tokens per split
            assert max(programs.values()) == -(-share // tile)
    assert {split for (s, _, split) in tiles_per_program if s in (1, 3)} == {0}  # padding: one program


def test_a_fixed_split_length_still_splits_by_the_table(tiles_per_program: Counter) -> None:
    lens = [300, 1]
    query, key_cache, value_cache, tables, seq_lens = bucket_like(lens)
    triton_ops.paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.3, split_len=WIDTH * BS)
    assert {split for (_, _, split) in tiles_per_program} == {0}  # one split: one program per sequence and head
    assert tiles_per_program[0, 0, 0] == -(-300 // decode_attention.TOKENS_TILE)

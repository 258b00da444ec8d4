"""The Triton prefill attention's launch never depends on the batch's sequence count through a pointer's
alignment (kernels/triton/prefill_attention.py): Triton compiles one variant per pointer that is or is not
16-byte aligned, and the context lengths' pointer, a view after the P + 1 offsets, was aligned only for
P = 3, 7, 11... — a compile of about a second on the first such batch (the slow 'bucket 4' of issue 42:
the graphs-on engine met P = 3 first and paid for it)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels.triton is imported

import pytest
import torch

import xinserve.kernels.triton as triton_ops
from xinserve.kernels.triton import prefill_attention

HEAD_DIM, KV_HEADS, HEADS, BS = 8, 2, 4, 16


def test_the_lengths_pointer_is_aligned_for_every_sequence_count(monkeypatch: pytest.MonkeyPatch) -> None:
    launches = []
    real = prefill_attention._prefill_kernel

    class Spy:  # records each launch's arguments, then launches it
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(args)
                return real[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(prefill_attention, "_prefill_kernel", Spy())
    torch.manual_seed(0)
    key_cache, value_cache = torch.randn(40, BS, KV_HEADS, HEAD_DIM), torch.randn(40, BS, KV_HEADS, HEAD_DIM)
    for count in range(1, 9):
        q_lens = [2 + i % 3 for i in range(count)]
        starts = [sum(q_lens[:i]) for i in range(count + 1)]
        tables = torch.arange(count * 2, dtype=torch.int32).view(count, 2)
        query = torch.randn(starts[-1], HEADS, HEAD_DIM)
        triton_ops.paged_prefill_attention(query, key_cache, value_cache, tables, starts, q_lens, 0.3)
        query_start, seq_lens = launches[-1][4], launches[-1][5]
        assert seq_lens.data_ptr() % 16 == 0 and query_start.data_ptr() % 16 == 0, count
        assert seq_lens[:count].tolist() == q_lens and query_start[: count + 1].tolist() == starts

"""The reference decode kernels over a verification step's decode rows (engines/worker/decode_rows.py) and
over a decode bucket's padded plan (engines/worker/decode_buckets.py):
- MLA's absorbed decode over 1 + k rows of one sequence (row j: context p + j + 1) equals the causal
  up-projected prefill of the same rows; the DSA indexer ranks each row over its own context only;
- the opaque ops a compiled bucket calls (``xinserve::live_*``) cut the max_model_len-wide plan to
  the live blocks and equal the eager kernels over the step's own plan."""

import numpy as np
import torch

from xinserve.kernels.attention_metadata import AttentionMetadata, DecodeGather, build_decode_gather
from xinserve.kernels.references import dense as reference
from xinserve.kernels.references import mla as mla_reference

BS, R, DR, DN, DV, H = 4, 16, 8, 8, 8, 4  # block size, latent rank, rope / nope / value dims, heads
TABLE = [6, 2, 9, 0, 4]  # one sequence's blocks, scrambled
PREFIX, K = 11, 3  # the verified context before the step; drafts verified in it


def rows_metadata(lens: list[int], tables: np.ndarray) -> AttentionMetadata:
    """A pure-decode step of len(lens) rows (each its own decode query)."""
    lens_np = np.array(lens, dtype=np.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64), block_tables=torch.from_numpy(tables),
        seq_lens=torch.from_numpy(lens_np), num_decode_seqs=len(lens), prefill_query_start_loc=[0],
        prefill_seq_lens=[], decode_gather=build_decode_gather(tables, lens_np, BS, torch.device("cpu")),
    )


def bucket_plan(tables: np.ndarray, lens: list[int], width: int) -> DecodeGather:
    """A bucket's plan (engines/worker/decode_buckets.py): every row gathers ``width`` blocks, masked past its length."""
    padded = np.zeros((len(lens), width), dtype=np.int64)
    padded[:, : tables.shape[1]] = tables
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    mask = (torch.arange(width * BS)[None, :] < seq_lens[:, None]).view(len(lens), 1, 1, -1)
    return DecodeGather(torch.from_numpy(padded.reshape(-1)), width * BS, mask, seq_lens.clone())


def test_mla_absorbed_decode_over_drafted_rows_equals_the_causal_prefill():
    torch.manual_seed(0)
    cache = torch.randn(10, BS, R + DR)
    up = torch.randn(H, DN + DV, R) / R**0.5  # kv_b_proj per head: W_UK rows, then W_UV rows
    query = torch.randn(1 + K, H, DN + DR)  # the sequence's last token, then its K drafts
    lens = [PREFIX + 1 + j for j in range(1 + K)]  # row j sees positions [0, PREFIX + j]
    tables = np.array([TABLE] * (1 + K), dtype=np.int32)
    metadata = rows_metadata(lens, tables)
    w_uk, w_uv = up[:, :DN], up[:, DN:]
    absorbed = torch.cat((torch.einsum("shn,hnr->shr", query[..., :DN], w_uk), query[..., DN:]), dim=-1)
    scale = (DN + DR) ** -0.5
    attended = mla_reference.mla_decode_attention(absorbed, cache, R, metadata.block_tables, metadata.seq_lens,
                                                  scale, metadata.decode_gather)  # [1 + K, H, R]
    got = torch.einsum("shr,hvr->shv", attended, w_uv)
    want = mla_reference.mla_prefill_attention(query, cache, up, torch.tensor([TABLE], dtype=torch.int32),
                                               [0, 1 + K], [lens[-1]], scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the live op a compiled bucket calls, over a 32-block plan, gives the same
    plan = bucket_plan(tables, lens, 32)
    live = torch.ops.xinserve.live_mla_decode(absorbed, cache, R, scale, plan.block_ids, plan.context_len, plan.mask,
                                              plan.host_seq_lens, None)
    torch.testing.assert_close(live, attended, atol=1e-6, rtol=1e-6)


def test_the_dsa_indexer_ranks_each_drafted_row_over_its_own_context():
    torch.manual_seed(1)
    hi, di, topk = 2, 8, 5
    index_cache = torch.randn(10, BS, di)
    query, weights = torch.randn(1 + K, hi, di), torch.rand(1 + K, hi)
    lens = [PREFIX + 1 + j for j in range(1 + K)]
    tables = np.array([TABLE] * (1 + K), dtype=np.int32)
    got = mla_reference.indexer_topk(query, weights, index_cache, rows_metadata(lens, tables), topk, 0.5)
    for j, n in enumerate(lens):  # each row as the lone decode that generated it
        alone = mla_reference.indexer_topk(query[j : j + 1], weights[j : j + 1], index_cache,
                                           rows_metadata([n], tables[:1]), topk, 0.5)
        assert got[j].tolist() == alone[0].tolist()
        assert got[j].max() <= PREFIX + j  # never a position after the row's own
    plan = bucket_plan(tables, lens, 32)
    live = torch.ops.xinserve.live_decode_topk(query, weights, index_cache, plan.block_ids, plan.context_len,
                                               plan.mask, plan.host_seq_lens, topk, 0.5)
    assert live.tolist() == got.tolist()


def test_the_live_decode_attention_gathers_only_the_live_blocks_of_a_bucket_plan(monkeypatch):
    torch.manual_seed(2)
    kvh, group, d = 2, 2, 8
    key_cache, value_cache = torch.randn(10, BS, kvh, d), torch.randn(10, BS, kvh, d)
    lens = [PREFIX + 1 + j for j in range(1 + K)] + [3]  # a drafted sequence's rows and a short decode
    tables = np.array([TABLE] * (1 + K) + [[7, 0, 0, 0, 0]], dtype=np.int32)
    query = torch.randn(len(lens), kvh * group, d)
    eager = rows_metadata(lens, tables)
    want = reference.paged_decode_attention(query, key_cache, value_cache, eager.block_tables, eager.seq_lens, 0.3,
                                            eager.decode_gather)
    plan = bucket_plan(tables, lens, 64)  # max_model_len 256: 64 blocks per row
    blocks: list[int] = []
    contexts = DecodeGather.contexts

    def counting(self, cache, num_seqs):
        blocks.append(self.block_ids.numel())
        return contexts(self, cache, num_seqs)

    monkeypatch.setattr(DecodeGather, "contexts", counting)
    got = torch.ops.xinserve.live_decode_attention(query, key_cache, value_cache, eager.seq_lens, 0.3,
                                                   plan.block_ids, plan.context_len, plan.mask, plan.host_seq_lens,
                                                   None)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert blocks == [len(lens) * 4] * 2  # K and V: 4 live blocks per row (15 positions), not 64

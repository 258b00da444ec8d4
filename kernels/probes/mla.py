"""Probes of the multi-head latent attention and DSA ops (see kernels/probes/checks.py): each candidate on
the worker's device and dtype against kernels/references/mla.py in float32 on the host, on inputs
shaped like the model's (latent width, heads, block size, indexer heads and top-k), with contexts
that cross blocks, a decode batch of uneven lengths, a DSA selection, and a step that mixes a
decode with a chunked prefill for the indexer."""

from collections.abc import Callable

import numpy as np
import torch

from xinserve.kernels.attention_metadata import AttentionMetadata, build_decode_gather
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.inputs import ProbeInputs, max_error, pool_size, scrambled_block_tables
from xinserve.kernels.references import mla as mla_reference


def probe_write_latent(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    bs, width = shapes.block_size, shapes.kv_lora_rank + shapes.qk_rope_head_dim
    cache = x.randn(4, bs, width)
    slots = torch.tensor([0, bs - 1, bs, 2 * bs + 3, 4 * bs - 1], dtype=torch.int64, device=x.device)
    values = x.randn(len(slots), width)
    got, want = cache.clone(), cache.clone()
    fn["write_latent"](values, got, slots)
    mla_reference.write_latent(values, want, slots)
    return max_error(got, want)


def probe_mla_decode_attention(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    bs, rank = shapes.block_size, shapes.kv_lora_rank
    lens = [1, bs + 1, 2 * bs + 3]  # one token, just past a block, deep into the third
    num_blocks = pool_size(lens, bs)
    cache = x.randn(num_blocks, bs, rank + shapes.qk_rope_head_dim)
    tables_np, lens_np = scrambled_block_tables(lens, bs, num_blocks, seed=3), np.array(lens, np.int32)
    tables, seq_lens = torch.from_numpy(tables_np).to(x.device), torch.from_numpy(lens_np).to(x.device)
    query = x.randn(len(lens), shapes.num_heads, rank + shapes.qk_rope_head_dim)
    scale = (rank + shapes.qk_rope_head_dim) ** -0.5
    errors = []
    selections = [None]
    if shapes.index_topk:  # a DSA model's decode also attends over a selection
        gen = torch.Generator().manual_seed(4)
        rows = [torch.randperm(n, generator=gen)[: shapes.index_topk] for n in lens]
        selections.append(torch.stack([torch.cat((r, torch.full((shapes.index_topk - len(r),), -1)))
                                       for r in rows]).to(x.device))
    host_gather = build_decode_gather(tables_np, lens_np, bs, torch.device("cpu"))
    for selected in selections:
        got = fn["mla_decode_attention"](query, cache, rank, tables, seq_lens, scale,
                                         build_decode_gather(tables_np, lens_np, bs, x.device), selected)
        want = mla_reference.mla_decode_attention(
            query.cpu().float(), cache.cpu().float(), rank, tables.cpu(), seq_lens.cpu(), scale, host_gather,
            None if selected is None else selected.cpu(),
        )
        errors.append(max_error(got, want))
    return max(errors)


def probe_mla_prefill_attention(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    """A whole 7-token prompt, then a 5-token chunk after a cached prefix that ends mid-block; for a
    DSA model also over a selection."""
    bs, rank, heads = shapes.block_size, shapes.kv_lora_rank, shapes.num_heads
    (nope, value), rope = shapes.mla_up_head_dims, shapes.qk_rope_head_dim
    q_lens, lens = [7, 5], [7, bs + 8]
    num_blocks = max(8, sum(-(-n // bs) for n in lens))
    cache = x.randn(num_blocks, bs, rank + rope)
    tables = torch.from_numpy(scrambled_block_tables(lens, bs, num_blocks, seed=6)).to(x.device)
    query = x.randn(sum(q_lens), heads, nope + rope)
    weight = x.randn(heads, nope + value, rank) * rank**-0.5  # keys and values of order one
    query_start_loc, scale = [0, q_lens[0], sum(q_lens)], (nope + rope) ** -0.5
    selections = [None]
    if shapes.index_topk:
        gen = torch.Generator().manual_seed(7)
        rows = [torch.randperm(n - q + j + 1, generator=gen)[: shapes.index_topk]
                for n, q in zip(lens, q_lens) for j in range(q)]
        selections.append(torch.stack([torch.cat((r, torch.full((shapes.index_topk - len(r),), -1)))
                                       for r in rows]).to(x.device))
    host = [t.cpu().float() for t in (query, cache, weight)]
    errors = []
    for selected in selections:
        got = fn["mla_prefill_attention"](query, cache, weight, tables, query_start_loc, lens, scale, selected)
        want = mla_reference.mla_prefill_attention(*host, tables.cpu(), query_start_loc, lens, scale,
                                                   None if selected is None else selected.cpu())
        errors.append(max_error(got, want))
    return max(errors)


def probe_indexer_topk(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    """A decode and a 3-token chunk after a cached prefix. Positions are compared by score (two
    positions with equal scores are interchangeable): the error is the largest difference between the
    sorted float32 scores of the candidate's picks and of the reference's."""
    bs, heads, dim, topk = shapes.block_size, shapes.index_n_heads, shapes.index_head_dim, shapes.index_topk
    lens = [topk // 2 + 1, topk + bs + 3]  # shorter than top-k (padding), longer (selection)
    num_blocks = pool_size(lens, bs)
    cache = x.randn(num_blocks, bs, dim)
    tables_np, lens_np = scrambled_block_tables(lens, bs, num_blocks, seed=5), np.array(lens, np.int32)
    query = x.randn(4, heads, dim)
    weights = x.randn(4, heads, dtype=torch.float32)
    scale = dim**-0.5

    def metadata(device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.zeros(4, dtype=torch.int64, device=device),
            block_tables=torch.from_numpy(tables_np).to(device), seq_lens=torch.from_numpy(lens_np).to(device),
            num_decode_seqs=1, prefill_query_start_loc=[0, 3], prefill_seq_lens=[lens[1]],
            decode_gather=build_decode_gather(tables_np[:1], lens_np[:1], bs, device),
        )

    got = fn["indexer_topk"](query, weights, cache, metadata(x.device), topk, scale).cpu()
    host_query, host_cache = query.cpu().float(), cache.cpu().float()
    want = mla_reference.indexer_topk(host_query, weights.cpu(), host_cache, metadata(torch.device("cpu")), topk,
                                      scale)
    if got.shape != want.shape or not torch.equal(got < 0, want < 0):
        return float("inf")
    worst = 0.0
    for row, (seq, position) in enumerate([(0, lens[0] - 1), (1, lens[1] - 3), (1, lens[1] - 2), (1, lens[1] - 1)]):
        keys = host_cache[torch.from_numpy(tables_np[seq]).long()].reshape(-1, dim)[: position + 1]
        scores = (torch.relu(host_query[row] @ keys.T * scale) * weights[row].cpu()[:, None]).sum(0)
        picked = [scores[p[p >= 0]].sort().values for p in (got[row], want[row])]
        if int(got[row].max()) > position:
            return float("inf")
        worst = max(worst, float((picked[0] - picked[1]).abs().max()))
    return worst


PROBES = {
    "write_latent": probe_write_latent,
    "mla_decode_attention": probe_mla_decode_attention,
    "mla_prefill_attention": probe_mla_prefill_attention,
    "indexer_topk": probe_indexer_topk,
}

"""A compact copy of the KV blocks one step reads, for vendor attention operators that cannot read the
pool's rows where they lie.

The pool keeps an 8-bit head's scale inside its row (kernels/kv_quant.py: [N, BS, KVH, D + 4]), one
layout for every kernel, so the registry may choose each op from a different implementation and the
host tier and prefix cache move a block's codes and scales together. Ascend's fused attention wants the
int8 codes and their float32 scales as two separate contiguous tensors, and MATE and Ascend's prefill
read only half-precision caches; for those, the blocks of the step's sequences are gathered once per
layer into a small pool of their own, in the form the operator takes, with block tables renumbered
over it. The price is one read and one write of the step's context bytes before the operator reads
them; what the 8-bit pool buys is capacity (about twice the tokens of a 16-bit pool).

Shapes: S sequences, W blocks gathered per sequence (its table's first W), M = S * W.
"""

import torch

from xinserve.kernels import kv_quant


def step_blocks(block_tables: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids [S * W] int64: each table row's first W blocks, row by row; tables [S, W] int32 numbering
    them 0..M-1 in that order), from block_tables [S, B] int32 with B >= W."""
    block_ids = block_tables[:, :width].reshape(-1).long()
    return block_ids, compact_tables(block_tables.shape[0], width, block_tables.device)


def compact_tables(num_seqs: int, width: int, device: torch.device) -> torch.Tensor:
    """[S, W] int32 tables over blocks gathered row by row (``DecodeGather.block_ids`` order)."""
    return torch.arange(num_seqs * width, dtype=torch.int32, device=device).view(num_seqs, width)


def read_back(cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """cache [N, BS, KVH, D (+ 4)] -> [M, BS, KVH, D] in ``dtype``: the blocks' values (8-bit codes times
    their scales, computed in float32)."""
    return kv_quant.dequantize(cache.index_select(0, block_ids), head_dim, dtype)


def codes_and_scales(cache: torch.Tensor, block_ids: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit cache [N, BS, KVH, D + 4] -> (codes [M, BS, KVH, D], scales [M, KVH, BS] float32), both
    contiguous: the blocks' codes, and each token's scale per KV head laid out as pages beside them."""
    rows = cache.view(torch.int8).index_select(0, block_ids)  # [M, BS, KVH, D + 4] bytes
    codes = rows[..., :head_dim].contiguous().view(cache.dtype)
    scales = rows[..., head_dim:].contiguous().view(torch.float32).squeeze(-1)  # [M, BS, KVH]
    return codes, scales.transpose(1, 2).contiguous()

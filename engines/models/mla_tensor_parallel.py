"""Tensor parallelism for multi-head latent attention (DeepSeek-V3/V3.2, GLM-5): the heads split over
the ranks, the latent and the DSA indexer replicated.

Per rank, with H / tp consecutive heads starting at head ``h0``:
- ``q_proj`` / ``q_b_proj`` and ``kv_b_proj`` are column-parallel per head (rows ``[h0 * w, (h0 + H/tp)
  * w)`` with w = dn + dr for q and dn + dv for kv_b, the checkpoint's per-head row blocks), so the
  prefill's up-projection and the decode's absorbed ``W_UK`` / ``W_UV`` cover exactly this rank's
  heads; ``o_proj`` is row-parallel (one all-reduce per layer, as a dense attention).
- ``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms are replicated: their outputs (the query latent
  and the compressed KV ``c`` with the shared rotary key) are what every head reads.
- The latent cache is replicated: a cached latent has no head dimension (every head of every rank
  attends over all R + dr values of it), so splitting heads cannot split it; each rank writes and
  keeps the same latents (vLLM keeps its MLA cache replicated per rank for the same reason). The KV
  bytes per token per device therefore do not shrink with TP.
- The DSA indexer is replicated, with its key cache: its score sums over its heads before the top-k, so
  a head split would need an all-reduce of a [tokens, context] score matrix per indexer layer (growing
  with the context) and a different summation order could pick other positions at a tie; replicated,
  every rank computes the same selection from the same (all-reduced) inputs, at the cost of its
  small weights (GLM-5: about 9M parameters per layer against 9B).
"""

from torch import nn

from engines.models.mla import MLAAttention
from engines.models.tensor_parallel import Collectives, ColumnParallelMerged, RowParallelLinear


def _head_rows(linear: nn.Linear, first_head: int, heads: int, per_head: int) -> ColumnParallelMerged:
    """This rank's heads' rows of ``linear`` ([H * per_head, in]), read from the checkpoint alone."""
    full = linear.out_features
    return ColumnParallelMerged(linear.in_features, [full], [(first_head * per_head, heads * per_head)],
                                bias=linear.bias is not None)


def shard_mla_attention(attn: MLAAttention, rank: int, tp: int, group: Collectives) -> None:
    """Replace ``attn``'s per-head projections with rank ``rank``'s heads, in place (on the meta
    device). ``load_model`` checked that the heads divide by ``tp``."""
    heads = attn.num_heads // tp
    first = rank * heads
    qk_dim = attn.nope_dim + attn.rope_dim
    if attn.q_lora_rank is None:
        attn.q_proj = _head_rows(attn.q_proj, first, heads, qk_dim)
    else:
        attn.q_b_proj = _head_rows(attn.q_b_proj, first, heads, qk_dim)
    attn.kv_b_proj = _head_rows(attn.kv_b_proj, first, heads, attn.nope_dim + attn.v_dim)
    o = attn.o_proj
    attn.o_proj = RowParallelLinear(heads * attn.v_dim, o.out_features, o.bias is not None, first * attn.v_dim, group)
    attn.num_heads = heads

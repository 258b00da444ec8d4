"""FAKE of Moore Threads' MATE (``mate``), for tests only: the one function xinserve calls,
``flash_attn_with_kvcache``, with MATE's signature (``mate/mha_interface.py``, v0.1 to v0.2.2),
computing the same attention on CPU tensors in float32 and casting back, as a flash kernel does.

What it checks, as MATE's own asserts do (``mate/jit/attention/fmha/fmha_fwd.py``): q, k_cache and
v_cache float16 or bfloat16 and of one dtype; q shaped (batch, seqlen, heads, head_dim); a paged
cache (num_pages, page_size, kv_heads, head_dim) with a contiguous last dim; ``page_table`` int32
(batch, pages per sequence) with a contiguous last dim; ``cache_seqlens`` int32 (batch,); heads a
multiple of kv heads; a head dim MATE has a kernel for (it rounds up to 64, 128, 192, 256, ...,
and has no 192/192 kernel). Where the real kernel would read past a table or a pool, the fake
raises. Any page size is accepted, as MATE's tests run pages of 1 to 111 tokens (FlashAttention-2's
multiple-of-256 rule does not apply). ``causal`` aligns the triangle to the bottom right
(FlashAttention >= 2.1): the last query sees the whole cache.

What it does not model, and refuses loudly rather than compute wrong: appending k/v, rotary,
varlen queries (``cu_seqlens_q``), sliding windows, softcap, sinks, fp8 descales, context
parallelism, returning the LSE. Scheduling knobs (``scheduler_metadata``, ``num_splits``,
``pack_gqa``, ``sm_margin``) do not change the result and are ignored. The real function wants
MUSA tensors; no MUSA tensor can exist on a test machine, so the fake takes CPU ones.
"""

import torch

__version__ = "0.2.2+fake"

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIM_STEPS = (64, 128, 192, 256, 384, 512)  # MATE rounds a head dim up to the next of these


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    rotary_seqlens: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple = (-1, -1),
    learnable_sink: torch.Tensor | None = None,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_tot_seqused_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q over a paged cache; returns (batch, seqlen, heads, head_dim) in q's dtype."""
    unmodelled = {
        "k": k is not None, "v": v is not None, "qv": qv is not None, "rotary_cos": rotary_cos is not None,
        "rotary_sin": rotary_sin is not None, "cache_batch_idx": cache_batch_idx is not None,
        "cache_leftpad": cache_leftpad is not None, "cu_seqlens_q": cu_seqlens_q is not None,
        "cu_seqlens_k_new": cu_seqlens_k_new is not None, "rotary_seqlens": rotary_seqlens is not None,
        "descales": any(t is not None for t in (q_descale, k_descale, v_descale)),
        "window_size": tuple(window_size) != (-1, -1), "learnable_sink": learnable_sink is not None,
        "attention_chunk": attention_chunk != 0, "softcap": softcap != 0.0,
        "return_softmax_lse": return_softmax_lse, "context parallelism": cp_world_size != 1,
    }
    used = [name for name, on in unmodelled.items() if on]
    if used:
        raise NotImplementedError(f"fake mate does not model {', '.join(used)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise AssertionError("k_cache and v_cache must have contiguous last dimension")
    if q.dtype not in _FLASH_DTYPES:
        raise AssertionError("inputs must be float16 or bfloat16")
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise AssertionError("inputs must have the same dtype")
    if page_table is None:
        raise NotImplementedError("fake mate models the paged cache only: pass page_table")
    if q.dim() != 4:
        raise AssertionError(f"q must be (batch_size, seqlen, nheads, headdim) without cu_seqlens_q, got {tuple(q.shape)}")
    batch, seqlen_q, num_heads, head_dim = q.shape
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[-1] != head_dim:
        raise AssertionError(
            f"paged k_cache / v_cache must be (num_blocks, page_block_size, nheads_k, {head_dim}), "
            f"got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    num_pages, page_size, num_kv_heads = k_cache.shape[:3]
    if page_table.dtype != torch.int32 or page_table.stride(-1) != 1:
        raise AssertionError("page_table must be int32 and contiguous")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise AssertionError(f"page_table must be (batch_size={batch}, max_num_blocks_per_seq), "
                             f"got {tuple(page_table.shape)}")
    if isinstance(cache_seqlens, int):  # as MATE does: one length for every sequence
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32)
    if cache_seqlens is None or cache_seqlens.dtype != torch.int32 or cache_seqlens.stride(0) != 1:
        raise AssertionError("cache_seqlens must be a contiguous int32 tensor")
    if cache_seqlens.shape != (batch,):
        raise AssertionError(f"cache_seqlens must have shape (batch_size={batch},), got {tuple(cache_seqlens.shape)}")
    if num_heads % num_kv_heads:
        raise AssertionError("num_head must be divisible by num_head_kv")
    rounded = next((step for step in _HEAD_DIM_STEPS if head_dim <= step), None)
    if rounded is None or rounded == 192:
        raise AssertionError(f"Add config for headdim {rounded}-{rounded}")
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b in range(batch):
        seq_len = int(cache_seqlens[b])
        num_used = -(-seq_len // page_size)
        if not 0 < seq_len <= page_table.shape[1] * page_size:
            raise IndexError(f"cache_seqlens[{b}] = {seq_len} is outside the page table's "
                             f"{page_table.shape[1]} pages of {page_size}")
        pages = page_table[b, :num_used].long()
        if pages.min() < 0 or pages.max() >= num_pages:
            raise IndexError(f"page_table[{b}] points outside the {num_pages} cache pages")
        # keys, values: [L, KVH, D] -> [H, L, D], each kv head serving its group of query heads
        keys = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        values = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)
        values = values.transpose(0, 1).repeat_interleave(group, dim=0)
        scores = scale * q[b].float().transpose(0, 1) @ keys.transpose(1, 2)  # [H, seqlen_q, L]
        if causal:  # bottom-right: query i sits at position seq_len - seqlen_q + i
            visible = torch.ones(seqlen_q, seq_len, dtype=torch.bool).tril(seq_len - seqlen_q)
            scores = scores.masked_fill(~visible, float("-inf"))
        out[b] = (scores.softmax(dim=-1) @ values).transpose(0, 1).to(q.dtype)
    return out

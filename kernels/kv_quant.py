"""The KV cache's storage dtypes (``--kv-cache-dtype``): how a key or value head is stored in the paged
cache and read back. The one layout every kernel that writes or reads the cache agrees on.

Half precision (bfloat16, float16): the cache tensor is simply in that dtype, [N, BS, KVH, D]; a
kernel widens what it reads to float32 (or to the query's dtype) before it accumulates.

8-bit (int8, fp8_e4m3): each token's head is stored as D codes followed by its float32 scale, in one
row of the cache: [N, BS, KVH, D + 4] in int8 / float8_e4m3fn, the last 4 bytes of a row the scale's
bit pattern. The value is ``code * scale``.

Why a scale per token and head (not per block, not static per head): a block fills a token at a time
(decode steps, prefill chunks), so a per-block scale would have to grow, re-quantizing the tokens
already there, and a block's bytes would depend on how it was written (chunked or not, recomputed
after preemption or not, shared through the prefix cache or not). A static per-head scale needs
calibration data a checkpoint does not carry. Per token, a head's codes are a pure function of its
own K/V: every write path (whole prompt, chunk, recompute, draft) stores the same bytes, and prefix
blocks, the host tier and preemption copy or recompute them exactly. The scale sits in the row, so
every block copy (host tier, gather) moves codes and scales together. Cost: 4 bytes per head and
token (6% at D = 64, 3% at D = 128).

The write rounds ``x / scale`` (scale = absmax / 127 for int8, absmax / 448 for fp8), a deterministic
function of the token's values, so two runs over the same prompt store the same bytes.
"""

import torch

SCALE_BYTES = 4  # a float32 scale after each head's codes
# --kv-cache-dtype spelling -> storage dtype (None: the model's dtype). "fp8" is vLLM's alias of fp8_e4m3.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}
QUANTIZED = (torch.int8, torch.float8_e4m3fn)
_CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}


def storage_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a ``--kv-cache-dtype`` spelling (None or auto: the model's)."""
    if name is not None and name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES.get(name or "auto") or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED


def head_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one stored head row: D, or D codes + the scale's 4 bytes for the 8-bit kinds."""
    if not is_quantized(dtype):
        return head_dim
    if head_dim % SCALE_BYTES:
        raise ValueError(f"an 8-bit KV cache needs a head dim divisible by {SCALE_BYTES}, got {head_dim}")
    return head_dim + SCALE_BYTES


def head_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one stored head row of one token."""
    return head_width(head_dim, dtype) * dtype.itemsize


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [..., D] float -> the stored rows [..., D (+ 4)] in ``dtype``."""
    if not is_quantized(dtype):
        return x.to(dtype)
    x = x.float()
    absmax = x.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    # an all-zero head keeps scale 1 (codes 0), so no division by zero
    scale = torch.where(absmax > 0, absmax / _CODE_MAX[dtype], torch.ones_like(absmax))
    scaled = x / scale
    codes = scaled.round().clamp(-127, 127).to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    return torch.cat((codes.view(torch.int8), scale.view(torch.int8)), dim=-1).view(dtype)


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., D (+ 4)] -> [..., D] in ``dtype`` (half precision widened; codes * scale,
    computed in float32). Rows already in ``dtype`` are returned as they are."""
    if not is_quantized(rows.dtype):
        return rows if rows.dtype == dtype else rows.to(dtype)
    rows = rows.contiguous()
    scale = rows[..., head_dim:].view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)

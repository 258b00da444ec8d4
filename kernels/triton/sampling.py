"""Triton top-k / top-p filtering without sorting the vocabulary: one program per row finds the row's
thresholds by searching on the logit value, a few passes over the row each.

Logits are compared as order-preserving int32 keys (a float's bits, the magnitude bits flipped for
negatives). A search keeps an interval of keys and each pass over the row tests PIVOTS keys inside it
at once (a [tile, PIVOTS] comparison), so the interval shrinks PIVOTS-fold per pass: about eight passes
for 32-bit keys.

- top-k: the largest key u with count(key >= u) >= k is the k-th largest logit; every logit at or
  above it stays, ties with it included (as the reference keeps them).
- top-p: the reference sorts the kept logits ascending and drops the low ones whose cumulative
  probability is at most 1 - p. Here: the largest key u whose kept logits below it weigh at most
  (1 - p) of the kept mass is the cut; logits at or above it stay. The row's largest logit always stays.

Ties: a group of equal logits stays or goes whole. The reference agrees whenever the group is not
split by its own cut (top-k: it keeps the whole group too); at a top-p cut inside a group the
reference keeps the part its sort order happens to put last, and this keeps the whole group.

Nothing reads a value back on the host and the output is allocated by shape: graph-capturable.
"""

import torch

import triton
import triton.language as tl
from xinserve.kernels.triton.common import interpreted

PIVOTS = 16  # keys tested per pass
ROW_TILE = 1024  # logits per step of a pass ([ROW_TILE, PIVOTS] comparisons at once)
# Triton's interpreter pays per step, not per element (numpy does the tile): its steps are larger
INTERPRETED_ROW_TILE = 8192


@triton.jit
def _keys(x):
    """float32 -> int32 keys in the same order (-inf lowest; NaN is never asked for)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _tile(base, start, offsets, vocab_size):
    """Logits [start, start + ROW_TILE) of a row (-inf past its end), their keys (int64) and which are real."""
    valid = start + offsets < vocab_size
    x = tl.load(base + start + offsets, mask=valid, other=float("-inf"))
    return x, _keys(x).to(tl.int64), valid


@triton.jit
def _pivots(lo, hi, PIVOTS: tl.constexpr):
    """PIVOTS keys spread over (lo, hi], the last one hi (int64, no overflow for int32 keys)."""
    j = tl.arange(1, PIVOTS + 1).to(tl.int64)
    return lo + ((hi - lo) * j + PIVOTS - 1) // PIVOTS


@triton.jit
def _narrow(lo, hi, pivots, holds, PIVOTS: tl.constexpr):
    """The next search interval: ``holds`` [PIVOTS] says where the predicate (true up to the answer,
    false past it) holds at ``pivots``; the answer lies in [last pivot that holds, first that fails - 1]."""
    new_lo = tl.max(tl.where(holds, pivots, lo), axis=0)
    new_hi = tl.min(tl.where(holds, hi, pivots - 1), axis=0)
    return new_lo, new_hi


@triton.jit
def _top_k_top_p_kernel(
    logits_ptr, out_ptr, top_k_ptr, top_p_ptr,
    vocab_size, logits_stride, top_k_stride, top_p_stride,
    PIVOTS: tl.constexpr, ROW_TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_stride
    k = tl.load(top_k_ptr + row * top_k_stride)
    p = tl.load(top_p_ptr + row * top_p_stride).to(tl.float32)
    offsets = tl.arange(0, ROW_TILE)

    # pass: the row's largest logit
    row_max = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab_size, ROW_TILE):
        x, _, _ = _tile(base, start, offsets, vocab_size)
        row_max = tl.maximum(row_max, tl.max(x, axis=0))
    max_key = _keys(row_max).to(tl.int64)

    # top-k cut: the largest u with count(key >= u) >= k; INT32_MIN keeps all (k = 0 or k >= V)
    lo = tl.full((), -2147483648, tl.int64)
    if (k > 0) & (k < vocab_size):
        hi = max_key
        while lo < hi:
            pivots = _pivots(lo, hi, PIVOTS)
            counts = tl.zeros((PIVOTS,), tl.int64)
            for start in range(0, vocab_size, ROW_TILE):
                _, key, valid = _tile(base, start, offsets, vocab_size)
                above = valid[:, None] & (key[:, None] >= pivots[None, :])  # [ROW_TILE, PIVOTS]
                counts += tl.sum(above.to(tl.int64), axis=0)
            lo, hi = _narrow(lo, hi, pivots, counts >= k, PIVOTS)
    top_k_cut = lo

    # pass: the kept logits' mass (exp relative to the row's max, which top-k always keeps)
    mass = tl.zeros((), tl.float32)
    for start in range(0, vocab_size, ROW_TILE):
        x, key, valid = _tile(base, start, offsets, vocab_size)
        kept = valid & (key >= top_k_cut)
        mass += tl.sum(tl.where(kept, tl.exp(x - row_max), 0.0), axis=0)

    # top-p cut: the largest u in [top-k cut, max] whose kept logits below it weigh <= (1 - p) of the mass
    budget = (1.0 - p) * mass
    lo = top_k_cut
    hi = max_key
    while lo < hi:
        pivots = _pivots(lo, hi, PIVOTS)
        below = tl.zeros((PIVOTS,), tl.float32)
        for start in range(0, vocab_size, ROW_TILE):
            x, key, valid = _tile(base, start, offsets, vocab_size)
            weight = tl.where(valid & (key >= top_k_cut), tl.exp(x - row_max), 0.0)
            below += tl.sum(tl.where(key[:, None] < pivots[None, :], weight[:, None], 0.0), axis=0)
        lo, hi = _narrow(lo, hi, pivots, below <= budget, PIVOTS)  # p > 1: no pivot holds, all of top-k stays
    cut = lo

    # pass: the filtered row
    out_base = out_ptr + row * vocab_size
    for start in range(0, vocab_size, ROW_TILE):
        x, key, valid = _tile(base, start, offsets, vocab_size)
        tl.store(out_base + start + offsets, tl.where(key >= cut, x, float("-inf")), mask=valid)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``xinserve.kernels.references.dense.top_k_top_p`` in Triton. logits: [N, V] float32 (other float
    dtypes are widened); top_k: [N, 1] int64, 0 = keep all; top_p: [N, 1] float32, 1 = keep all.
    Returns the logits with the filtered-out ones at -inf, [N, V] in logits' dtype."""
    rows = logits.float()
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=logits.device)
    if rows.numel():
        _top_k_top_p_kernel[(rows.shape[0],)](
            rows, out, top_k, top_p,
            rows.shape[1], rows.stride(0), top_k.stride(0), top_p.stride(0),
            PIVOTS=PIVOTS, ROW_TILE=INTERPRETED_ROW_TILE if interpreted(_top_k_top_p_kernel) else ROW_TILE,
            num_warps=8,
        )
    return out.to(logits.dtype)

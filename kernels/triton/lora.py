"""Multi-LoRA's shrink and expand in Triton, drop-in for kernels/references/lora.py (its contract: a row's
adapter slot in ``slots``, -1 for the base model only; scaling folded into B; ranks zero-padded).

Both ops are one gathered matmul, ``y[t] (+)= x[t] @ W[slots[t]]^T`` with W a per-slot stack [S, N, K]:
shrink writes y = h [T, R] from x [T, in] and A [S, R, in]; expand adds into y = out [T, O] from h [T, R]
and B [S, O, R]. Two kernels, chosen by the row count T (a shape, so a captured graph keeps its choice):

- bgmv (T <= BGMV_MAX_ROWS, a decode step): program (t, n-tile) reads row t's slot and multiplies the row
  vector with that slot's [n-tile, K] matrix. Row t's program returns at once when its slot is -1.
- grouped (more rows, a prefill): the rows sorted by slot on the device (a stable argsort, per-slot counts
  by scatter_add: no host sync, no data-dependent shape); program (m-tile, n-tile, slot) takes the next
  BLOCK_M rows of its slot as one ``tl.dot`` tile, so a slot's matrix is read once per BLOCK_M rows rather
  than once per row. The grid covers every slot as if it held all T rows; the programs past their slot's
  rows return at once (vLLM's punica layout of the same problem).

Neither kernel reads or writes a -1 row: expand leaves it bit-unchanged, shrink leaves its zeros. Nothing
here syncs with the host, so a decode step that calls them can be captured in a graph. Products
accumulate in float32; the interpreter (TRITON_INTERPRET=1, the CPU tests) gets float32 dot operands, as
its tl.dot mishandles bfloat16 (kernels/triton/common.py).
"""

import torch

import triton
import triton.language as tl
from xinserve.kernels.triton.common import interpreted, tile

BGMV_MAX_ROWS = 32  # up to a decode batch of this size, one program per row; above, rows grouped by slot
BLOCK_M = 16  # rows of one slot per grouped program (tl.dot's smallest side)
MAX_BLOCK_N, MAX_BLOCK_K = 64, 128


@triton.jit
def _bgmv_kernel(x_ptr, w_ptr, slots_ptr, y_ptr, N, K,
                 stride_xt, stride_xk, stride_ws, stride_wn, stride_wk, stride_yt, stride_yn,
                 ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    if slot < 0:  # the base model only: the row is not touched
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + slot * stride_ws + offs_n[:, None] * stride_wn  # [BLOCK_N, 1] of W[slot]
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + row * stride_xt + offs_k * stride_xk, mask=k_mask, other=0.0).to(tl.float32)  # [BK]
        w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [BN, BK]
        acc += tl.sum(w * x[None, :], axis=1)
    y_ptrs = y_ptr + row * stride_yt + offs_n * stride_yn
    if ADD:
        acc += tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, order_ptr, starts_ptr, counts_ptr, y_ptr, N, K,
                    stride_xt, stride_xk, stride_ws, stride_wn, stride_wk, stride_yt, stride_yn,
                    ADD: tl.constexpr, DOT_F32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + slot)  # rows of this slot
    if pid_m * BLOCK_M >= count:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    # [BLOCK_M] the rows: this slot's run of the slot-sorted row order
    rows = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr + slot.to(tl.int64) * stride_ws + offs_n[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        # [BM, BN]; "ieee" keeps float32 out of TF32 (16-bit operands ignore it)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    if ADD:
        acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def _rows_by_slot(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows ordered by slot (-1 rows first, then slot 0's, ...), and each slot's start in that order
    and row count ([S] each, the -1 rows left out). All on the device, without a host sync."""
    order = torch.argsort(slots, stable=True)  # [T] int64
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, slots + 1, torch.ones_like(slots))  # [S + 1]: index 0 counts the -1 rows
    starts = torch.cumsum(counts, 0) - counts
    return order, starts[1:], counts[1:]


def _gathered_matmul(x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                     add: bool) -> None:
    """y[t] = x[t] @ weights[slots[t]]^T, or += with ``add``, for every row whose slot is not -1.
    x: [T, K]; weights: [S, N, K]; slots: [T]; y: [T, N]."""
    rows, (num_slots, n, k) = x.shape[0], weights.shape
    if rows == 0 or num_slots == 0:
        return
    slots = slots.to(torch.int64)
    strides = (*x.stride(), *weights.stride(), *y.stride())
    block_n, block_k = min(MAX_BLOCK_N, tile(n)), min(MAX_BLOCK_K, tile(k))
    if rows <= BGMV_MAX_ROWS:
        grid = (rows, triton.cdiv(n, block_n))
        _bgmv_kernel[grid](x, weights, slots.contiguous(), y, n, k, *strides, ADD=add, BLOCK_N=block_n,
                           BLOCK_K=block_k)
        return
    order, starts, counts = _rows_by_slot(slots, num_slots)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, block_n), num_slots)
    _grouped_kernel[grid](x, weights, order, starts, counts, y, n, k, *strides, ADD=add,
                          DOT_F32=interpreted(_grouped_kernel), BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                          BLOCK_K=min(64, block_k))


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x: [T, in]; a_stack: [S, R, in]; slots: [T] int64 in [-1, S). Returns [T, R] in x's dtype: row t is
    x[t] @ A[slot]^T, zeros where the slot is -1."""
    out = x.new_zeros(x.shape[0], a_stack.shape[1])
    _gathered_matmul(x, a_stack, slots, out, add=False)
    return out


def lora_expand(out: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """out: [T, O]; h: [T, R]; b_stack: [S, O, R]. Adds h[t] @ B[slot]^T to out[t] in place and returns out
    (rows whose slot is -1 bit-unchanged)."""
    _gathered_matmul(h, b_stack, slots, out, add=True)
    return out

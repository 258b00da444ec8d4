"""Triton RMSNorm with the residual add fused in: one program per row reads x (and the residual) once,
writes the sum and the normed row, instead of the reference's five elementwise passes.

Rounding follows the reference (kernels/references/dense.py): the sum is rounded to x's dtype first and
stored as the new residual, the statistics are taken in float32 over that rounded sum, the normed row
is rounded to x's dtype before the weight multiply. Out of place like the reference.
"""

import torch

import triton
import triton.language as tl
from xinserve.kernels.triton.common import rounded, warps_for


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    inner, x_stride_a, x_stride_b, r_stride_a, r_stride_b,
    size, eps,
    HAS_RESIDUAL: tl.constexpr, SIZE_TILE: tl.constexpr,
):
    # row = a * inner + b over x viewed as [A, inner, size] (strided: Qwen3's q/k norm gets heads of a
    # fused projection); out and sum are contiguous [A * inner, size]
    row = tl.program_id(0).to(tl.int64)
    a, b = row // inner, row % inner
    cols = tl.arange(0, SIZE_TILE)
    mask = cols < size
    x = tl.load(x_ptr + a * x_stride_a + b * x_stride_b + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + a * r_stride_a + b * r_stride_b + cols, mask=mask, other=0.0)
        x = rounded(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)  # x + residual, in x's dtype
        tl.store(sum_ptr + row * size + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / size
    normed = rounded(x32 * tl.rsqrt(mean_square + eps), x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * size + cols, rounded(out, out_ptr.dtype.element_ty), mask=mask)


MAX_SIZE = 32768  # one row lives in a program's registers: past this it would spill


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [A, inner, size] with unit stride on the last dim, a view where its strides allow."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t if t.dim() == 3 else t.reshape(-1, t.shape[-2], t.shape[-1])


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``xinserve.kernels.references.dense.rms_norm`` in Triton. x: [..., H] (any strides), weight: [H],
    residual: like x or None. Returns norm(x) [..., H], or (norm(x + residual), x + residual)."""
    size = x.shape[-1]
    rows = _rows(x)
    res = _rows(residual) if residual is not None else rows
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    added = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    size_tile = triton.next_power_of_2(size)
    if x.numel():
        _rms_norm_kernel[(rows.shape[0] * rows.shape[1],)](
            rows, res, weight.contiguous(), out, added,
            rows.shape[1], rows.stride(0), rows.stride(1), res.stride(0), res.stride(1),
            size, eps,
            HAS_RESIDUAL=residual is not None, SIZE_TILE=size_tile, num_warps=warps_for(size_tile),
        )
    return out if residual is None else (out, added)

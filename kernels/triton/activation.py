"""Triton SiLU-and-mul (the SwiGLU gate): [T, 2I] -> [T, I] in one pass, instead of the reference's
silu, multiply and the temporaries between them. The silu is rounded to the input dtype before the
multiply, as ``F.silu(gate) * up`` rounds (kernels/references/dense.py)."""

import torch

import triton
import triton.language as tl
from xinserve.kernels.triton.common import rounded

COLUMNS_TILE = 1024  # output columns per program


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride_t, inner, COLUMNS_TILE: tl.constexpr):
    # grid: (T, cdiv(I, COLUMNS_TILE)); x row: gate [0, I) then up [I, 2I); out: contiguous [T, I]
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * COLUMNS_TILE + tl.arange(0, COLUMNS_TILE)
    mask = cols < inner
    row = x_ptr + token * x_stride_t
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inner + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = rounded(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    tl.store(out_ptr + token * inner + cols, rounded(silu * up, dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``xinserve.kernels.references.dense.silu_and_mul`` in Triton: x [..., 2I] (gate then up) -> [..., I]."""
    inner = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], inner, dtype=x.dtype, device=x.device)
    if out.numel():
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inner, COLUMNS_TILE))](
            rows, out, rows.stride(0), inner, COLUMNS_TILE=COLUMNS_TILE,
        )
    return out

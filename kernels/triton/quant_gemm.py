"""``quant_linear`` in Triton: one GEMM that dequantizes the weight tile by tile as it multiplies, for
every stored type of kernels/quantized_weight.py (int8, FP8 e4m3 read as bytes and bitcast, int4
nibble pairs) with any scale grid, partial edge blocks included, and zero points: block FP8
(DeepSeek-V3), W4A16 / W8A16 groups, per-channel and per-tensor scales. The activation scheme, when
there is one, is applied to ``x`` first (kernels/quantized_weight.py's ``quantize_activation``), so
the result is the reference's, with the weights never expanded in memory.

    y[m, n] = sum_k act(x)[m, k] * (q[n, k] - zero[n // br, k // bc]) * scale[n // br, k // bc]
"""

import torch

import triton
import triton.language as tl
from xinserve.kernels.quantized_weight import QuantizedWeight, quantize_activation

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _quant_gemm(x_ptr, q_ptr, scale_ptr, zero_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                BR: tl.constexpr, BC: tl.constexpr, BITS: tl.constexpr, IS_FP8: tl.constexpr,
                HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & mask_k[None, :], other=0.0).to(tl.float32)  # [BM, BK]
        mask_w = (offs_n[:, None] < N) & mask_k[None, :]
        if BITS == 4:  # column 2j in the low nibble, 2j + 1 in the high one, each value + 8
            byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] // 2, mask=mask_w, other=8)
            nibble = tl.where(offs_k[None, :] % 2 == 0, byte & 0x0F, byte >> 4)
            q = nibble.to(tl.float32) - 8.0
        elif IS_FP8:
            byte = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=mask_w, other=0)
            q = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=mask_w, other=0).to(tl.float32)
        grid = (offs_n[:, None] // BR) * stride_sn + offs_k[None, :] // BC  # [BN, BK] into the scale grid
        if HAS_ZERO:
            q = q - tl.load(zero_ptr + grid, mask=mask_w, other=0.0)
        w = q * tl.load(scale_ptr + grid, mask=mask_w, other=0.0)  # [BN, BK]
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc,
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def prepare_quant_weight(weight: QuantizedWeight, dtype: torch.dtype) -> QuantizedWeight:
    """The record as it is, its tensors contiguous (the kernel reads rows by stride)."""
    zero = None if weight.zero is None else weight.zero.float().contiguous()
    return QuantizedWeight(weight.qweight.contiguous(), weight.bits, weight.scale.float().contiguous(), weight.block,
                           weight.in_features, weight.out_features, zero=zero, activation=weight.activation,
                           input_scale=weight.input_scale, input_offset=weight.input_offset)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, in] -> [T, out] in x's dtype (accumulated in float32)."""
    x = quantize_activation(x, weight).contiguous()
    rows, cols = x.shape[0], weight.in_features
    out = torch.empty(rows, weight.out_features, dtype=torch.float32, device=x.device)
    if rows:
        is_fp8 = weight.qweight.dtype == torch.float8_e4m3fn
        q = weight.qweight.view(torch.uint8) if is_fp8 else weight.qweight
        zero = weight.zero if weight.zero is not None else weight.scale  # unread without zero points
        grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(weight.out_features, BLOCK_N))
        _quant_gemm[grid](x, q, weight.scale, zero, out, rows, weight.out_features, cols, x.stride(0), q.stride(0),
                          weight.scale.stride(0), out.stride(0), BR=weight.block[0], BC=weight.block[1],
                          BITS=weight.bits, IS_FP8=is_fp8, HAS_ZERO=weight.zero is not None,
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    out = out.to(x.dtype)
    return out if bias is None else out + bias

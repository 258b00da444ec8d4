"""How a quantized linear layer's weight is held in device memory: the contract between the
checkpoint readers (``engines/quantization/``) and the ``quant_linear`` / quantized ``fused_moe``
kernels.

Every checkpoint format (block FP8, compressed-tensors, msModelSlim, GPTQ, AWQ) is converted at load
into this one layout, so a kernel implements a few schemes, not a dozen formats. What every kernel
must compute (``dequantize`` and ``quantize_activation`` below are the reference):

    W[r, c] = (q[r, c] - zero[r // block_rows, c // block_cols]) * scale[r // block_rows, c // block_cols]
    y = act(x) @ W.T + bias

``q`` is the stored value as a signed number: int8, float8_e4m3fn, or a signed 4-bit value packed two
per byte. ``act(x)`` is ``x`` itself for weight-only schemes, else ``x`` quantized and dequantized as
``activation`` says. The scale grid covers the weight in blocks of ``block`` = (block_rows,
block_cols), the last block of each dimension possibly partial (DeepSeek's 576-row
``kv_a_proj_with_mqa`` is 4.5 blocks of 128): per output channel is ``(1, in_features)``, per group
of g inputs ``(1, g)``, DeepSeek's blocks ``(128, 128)``, one scale for the whole tensor
``(out_features, in_features)``.

MoE experts stacked in one record carry a leading experts dimension on ``qweight``, ``scale``,
``zero`` (``[E, ...]``); everything else is shared by the experts.
"""

from dataclasses import dataclass, replace
from typing import Literal

import torch

# How the activations are quantized before the matmul:
#   "none": weight-only (W8A16, W4A16, block FP8 computed as dequant + matmul)
#   "int8_per_token" / "fp8_per_token": dynamic, one scale per token (row of x), symmetric
#   "int8_static": one scale and offset for the tensor, from calibration (msModelSlim W8A8, asymmetric)
#   "fp8_static": one calibrated scale for the tensor (compressed-tensors FP8 static)
Activation = Literal["none", "int8_per_token", "fp8_per_token", "int8_static", "fp8_static"]
PER_TOKEN = ("int8_per_token", "fp8_per_token")

INT8_RANGE = (-128, 127)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """One quantized linear weight (or a stack of experts' weights), canonical layout."""

    # [out, in] int8 or float8_e4m3fn (bits 8); [out, ceil(in / 2)] uint8 (bits 4): column 2j in the
    # low nibble, 2j + 1 in the high nibble, each nibble the signed value + 8 (0..15 stands for -8..7)
    qweight: torch.Tensor
    bits: int  # 8 or 4
    # float32 [ceil(out / block_rows), ceil(in / block_cols)]
    scale: torch.Tensor
    block: tuple[int, int]
    in_features: int
    out_features: int
    # Zero points in q's signed domain, float32, same grid as ``scale``; None: symmetric (zero 0)
    zero: torch.Tensor | None = None
    activation: Activation = "none"
    input_scale: torch.Tensor | None = None  # static activations: float32 scalar
    input_offset: torch.Tensor | None = None  # "int8_static": the zero point of x_q, float32 scalar

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quantized weights have 4 or 8 bits, not {self.bits}")
        if self.activation in ("int8_static", "fp8_static") and self.input_scale is None:
            raise ValueError(f"activation {self.activation!r} needs input_scale")

    @property
    def nbytes(self) -> int:
        """Bytes this weight occupies in memory (the KV pool is sized after them)."""
        tensors = (self.qweight, self.scale, self.zero, self.input_scale, self.input_offset)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """[..., ceil(in / 2)] uint8 of nibble pairs -> [..., in] int8 signed values in -8..7."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)[..., :in_features]


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[..., in] signed values in -8..7 (any integer dtype) -> [..., ceil(in / 2)] uint8, the inverse
    of ``unpack_int4`` (an odd last column pairs with a zero nibble)."""
    if values.numel() and (values.min() < -8 or values.max() > 7):
        raise ValueError("4-bit values must lie in -8..7")
    unsigned = (values.to(torch.int16) + 8).to(torch.uint8)
    if unsigned.shape[-1] % 2:
        unsigned = torch.nn.functional.pad(unsigned, (0, 1), value=8)
    return unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)


def expand_grid(grid: torch.Tensor, block: tuple[int, int], rows: int, cols: int) -> torch.Tensor:
    """[..., ceil(rows / br), ceil(cols / bc)] -> [..., rows, cols]: each block's value repeated over
    the block, the partial last blocks cut to size."""
    block_rows, block_cols = block
    full = grid.repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return full[..., :rows, :cols]


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight in ``dtype``: [out, in] (or [E, out, in] for stacked experts). Computed in float32
    and rounded once to ``dtype``."""
    rows, cols = weight.out_features, weight.in_features
    if weight.bits == 4:
        q = unpack_int4(weight.qweight, cols).float()
    else:
        q = weight.qweight.float()
    if weight.zero is not None:
        q = q - expand_grid(weight.zero.float(), weight.block, rows, cols)
    return (q * expand_grid(weight.scale.float(), weight.block, rows, cols)).to(dtype)


def quantize_activation(x: torch.Tensor, weight: QuantizedWeight, amax: torch.Tensor | None = None) -> torch.Tensor:
    """``act(x)`` of the module docstring: ``x`` [T, in] quantized as the weight's scheme says and
    dequantized back to x's dtype (the reference computes the matmul in floating point). ``amax``
    [T, 1] float32: the per-token schemes' largest magnitude per row, when x is part of a longer row
    (a row-parallel rank's columns); default x's own."""
    kind = weight.activation
    if kind == "none":
        return x
    xf = x.float()
    if amax is None and kind in PER_TOKEN:
        amax = xf.abs().amax(dim=-1, keepdim=True)
    if kind == "int8_per_token":
        scale = amax.clamp(min=1e-10) / INT8_RANGE[1]
        return (torch.round(xf / scale).clamp(*INT8_RANGE) * scale).to(x.dtype)
    if kind == "fp8_per_token":
        scale = amax.clamp(min=1e-12) / FP8_MAX
        return ((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
    scale = weight.input_scale.float()
    if kind == "int8_static":
        offset = weight.input_offset.float() if weight.input_offset is not None else torch.zeros(())
        q = (torch.round(xf / scale) + offset).clamp(*INT8_RANGE)
        return ((q - offset) * scale).to(x.dtype)
    return ((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


@dataclass(frozen=True, slots=True)
class QuantShape:
    """What a quant kernel sees of one quantized weight (the registry probes and times candidates on
    these, as ``ModelShapes.quant_shapes``): the stored type, the scale grid's block, the activation
    scheme, whether there are zero points, the matrix and, for stacked experts, how many."""

    qtype: Literal["int8", "fp8", "int4"]
    block: tuple[int, int]
    activation: Activation
    asymmetric: bool
    out_features: int
    in_features: int
    experts: int = 0  # 0: one linear weight; E: a stacked [E, ...] experts record


def quant_shape(weight: QuantizedWeight) -> QuantShape:
    qtype = "int4" if weight.bits == 4 else ("fp8" if weight.qweight.dtype == torch.float8_e4m3fn else "int8")
    experts = weight.qweight.shape[0] if weight.qweight.dim() == 3 else 0
    return QuantShape(qtype, weight.block, weight.activation, weight.zero is not None, weight.out_features,
                      weight.in_features, experts)


def weight_to(weight: QuantizedWeight, device: torch.device | str) -> QuantizedWeight:
    """The same record with every tensor on ``device``."""
    moved = {name: getattr(weight, name) for name in ("qweight", "scale", "zero", "input_scale", "input_offset")}
    return replace(weight, **{name: t.to(device) for name, t in moved.items() if t is not None})

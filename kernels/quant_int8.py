"""int8 GEMMs for symmetric int8 weights with one scale per output channel (the common W8A8 and
W8A16 checkpoints, and on-the-fly ``w8a8``):

- W8A8 with per-token dynamic activations: ``torch._int_mm`` (int8 x int8 -> int32, exact), then the
  token's and the channel's scales: y[t, o] = acc[t, o] * sx[t] * sw[o];
- weight-only (W8A16): ``torch.ops.aten._weight_int8pack_mm`` (x in the compute dtype times the int8
  weight, scaled per channel).

Any other scheme in the model makes the whole candidate unsupported (``unsupported``), so the
registry keeps the next one.
"""

from dataclasses import dataclass

import torch

from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.quantized_weight import INT8_RANGE, QuantizedWeight


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    for shape in shapes.quant_shapes:
        per_channel = shape.block == (1, shape.in_features)
        if not shape.experts and not (shape.qtype == "int8" and per_channel and not shape.asymmetric
                                      and shape.activation in ("int8_per_token", "none")):
            return (f"{shape.qtype} weights in {shape.block[0]} x {shape.block[1]} blocks with activation "
                    f"{shape.activation!r}: only symmetric per-channel int8, activations per-token int8 or none")
    return None


@dataclass(frozen=True, slots=True)
class Int8Weight:
    qweight: torch.Tensor  # W8A8: [in, out] int8 (as _int_mm takes it); W8A16: [out, in] int8
    scale: torch.Tensor  # [out]: float32 (W8A8), the compute dtype (W8A16)
    per_token: bool  # W8A8 with per-token dynamic activations


def prepare_quant_weight(weight: QuantizedWeight, dtype: torch.dtype) -> Int8Weight:
    scale = weight.scale.reshape(-1)
    if weight.activation == "int8_per_token":
        return Int8Weight(weight.qweight.t().contiguous(), scale.float(), True)
    return Int8Weight(weight.qweight.contiguous(), scale.to(dtype), False)


def quant_linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, in] -> [T, out] in x's dtype."""
    if weight.per_token:
        xf = x.float()
        x_scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / INT8_RANGE[1]  # [T, 1]
        xq = torch.round(xf / x_scale).clamp(*INT8_RANGE).to(torch.int8)
        out = (torch._int_mm(xq, weight.qweight).float() * x_scale * weight.scale).to(x.dtype)
    else:
        out = torch.ops.aten._weight_int8pack_mm(x, weight.qweight, weight.scale)
    return out if bias is None else out + bias


OPS = {fn.__name__: fn for fn in (prepare_quant_weight, quant_linear)}

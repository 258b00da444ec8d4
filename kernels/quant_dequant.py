"""Dequant-on-load: each quantized weight dequantized once, at load, to the compute dtype and kept so;
a step is then one plain matmul (after the activation quantization the scheme asks for, which keeps
the math the reference's). A memory trade: the weights take the compute dtype's bytes (4x an int8
weight's in float32, measured as the process's peak resident memory); the registry takes it only where it
times faster and the operator accepts the memory (it is last but the reference in preference).
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from xinserve.kernels.quantized_weight import QuantizedWeight, dequantize, quantize_activation
from xinserve.kernels.references.quant import dense_experts


@dataclass(frozen=True, slots=True)
class DenseWeight:
    weight: torch.Tensor  # [out, in] (or [E, out, in]) in the compute dtype
    # the record without its weight, for its activation scheme only (input scale and offset)
    activation: QuantizedWeight


def _activation_only(weight: QuantizedWeight) -> QuantizedWeight:
    empty = torch.empty(0, device=weight.scale.device)
    return replace(weight, qweight=empty.to(weight.qweight.dtype), scale=empty, zero=None)


def prepare_quant_weight(weight: QuantizedWeight, dtype: torch.dtype) -> DenseWeight:
    return DenseWeight(dequantize(weight, dtype), _activation_only(weight))


def quant_linear(x: torch.Tensor, weight: DenseWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(quantize_activation(x, weight.activation), weight.weight, bias)


def prepare_quant_experts(w13: QuantizedWeight, w2: QuantizedWeight, dtype: torch.dtype
                          ) -> tuple[DenseWeight, DenseWeight]:
    return prepare_quant_weight(w13, dtype), prepare_quant_weight(w2, dtype)


def quant_fused_moe(hidden: torch.Tensor, experts: tuple[DenseWeight, DenseWeight], topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """As kernels/references/quant.py's, on the weights dequantized at load."""
    w13, w2 = experts
    return dense_experts(hidden, w13.weight, w2.weight, w13.activation, w2.activation, topk_weights, topk_ids)


quant_fused_moe.graph_capturable = False

OPS = {fn.__name__: fn for fn in (prepare_quant_weight, quant_linear, prepare_quant_experts, quant_fused_moe)}

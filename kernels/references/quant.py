"""The reference of the quantized ops: ``quant_linear`` and the quantized ``fused_moe``, computed as
kernels/quantized_weight.py defines them (dequantize to the compute dtype, quantize-dequantize the
activations as the scheme says, matmul in floating point).

Each op is two functions: ``prepare_*`` runs once at load on the record (a candidate may repack it,
dequantize it, or move its scales: whatever it returns is what the model keeps in memory and passes
back at every step), the other runs every step. The reference keeps the record as it is, so the
weights stay quantized in memory and are dequantized per call.
"""

import torch
import torch.nn.functional as F

from xinserve.kernels.quantized_weight import QuantizedWeight, dequantize, quantize_activation


def prepare_quant_weight(weight: QuantizedWeight, dtype: torch.dtype) -> QuantizedWeight:
    """What the model keeps for one quantized linear weight; the reference keeps the record."""
    return weight


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, in] -> act(x) @ W.T + bias: [T, out] in x's dtype (``weight`` as prepared)."""
    return F.linear(quantize_activation(x, weight), dequantize(weight, x.dtype), bias)


def prepare_quant_experts(
    w13: QuantizedWeight, w2: QuantizedWeight, dtype: torch.dtype
) -> tuple[QuantizedWeight, QuantizedWeight]:
    """What the model keeps for the stacked experts: w13 [E, 2I, Hd] and w2 [E, Hd, I] records."""
    return w13, w2


def quant_fused_moe(
    hidden: torch.Tensor, experts: tuple[QuantizedWeight, QuantizedWeight], topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``fused_moe`` (kernels/references/dense.py) over quantized experts, as prepared: hidden [T, Hd],
    topk_weights [T, K] float32, topk_ids [T, K] -> [T, Hd]. Each expert's input rows are quantized
    as w13's scheme says and its SwiGLU output as w2's (per row: per token and expert)."""
    w13, w2 = experts
    return dense_experts(hidden, dequantize(w13, hidden.dtype), dequantize(w2, hidden.dtype), w13, w2,
                         topk_weights, topk_ids)


def dense_experts(hidden: torch.Tensor, gate_up_all: torch.Tensor, down_all: torch.Tensor, act13: QuantizedWeight,
                  act2: QuantizedWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' SwiGLU on dense weights, gate_up_all [E, 2I, Hd] and down_all [E, Hd, I], with the
    activation quantization of ``act13`` / ``act2`` (records read for their activation scheme only)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in topk_ids.unique().tolist():
        tokens, slot = torch.where(topk_ids == expert)
        gate_up = F.linear(quantize_activation(hidden[tokens], act13), gate_up_all[expert])  # [n, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        down = F.linear(quantize_activation(F.silu(gate) * up, act2), down_all[expert])  # [n, Hd]
        out.index_add_(0, tokens, down.float() * topk_weights[tokens, slot, None])
    return out.to(hidden.dtype)


# It reads the routed experts on the host, which a captured graph would freeze.
quant_fused_moe.graph_capturable = False

OPS = {fn.__name__: fn for fn in (prepare_quant_weight, quant_linear, prepare_quant_experts, quant_fused_moe)}

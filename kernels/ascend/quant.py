"""Ascend implementations of the quantized ops (``quant_linear``, ``quant_fused_moe``; the reference is
kernels/references/quant.py) through torch_npu, as vllm-ascend's W8A8 / W8A8_DYNAMIC / W8A16 / W4A16
methods call the operators:

  int8 weight, static activations (msModelSlim W8A8)   npu_quantize + npu_quant_matmul (int32 bias)
  int8 weight, per-token activations (W8A8_DYNAMIC)    npu_dynamic_quant + npu_quant_matmul (pertoken_scale)
  int8 / int4 weight only (W8A16, W4A16, GPTQ, AWQ)    npu_weight_quant_batchmatmul (antiquant scale/offset)
  int8 experts, per-token activations                  npu_dynamic_quant + npu_grouped_matmul (per_token_scale)

Dtype rules the operators impose (torch_npu documentation, Atlas A2 / A3), which ``prepare_*`` meets
once at load: npu_quant_matmul takes the weight as [in, out] int8; for a float16 output without
per-token scales its scale is int64 (npu_trans_quant_param: the float32's bits), for bfloat16 float32;
its int32 bias is added to the integer accumulator before the scale. npu_weight_quant_batchmatmul takes
the antiquant scale and offset in the activations' dtype, W = (weight + offset) * scale (so offset =
-zero), groups of a multiple of 32 inputs, and int4 weights as int32 words of eight values
(npu_convert_weight_to_int4pack). Every operator here computes in float16 / bfloat16 only.

What a record needs to be taken (``LIMITS``, checked on the model's ``quant_shapes``): per-output-channel
scales (or groups of inputs for weight-only), symmetric weights where activations are quantized, no
FP8, and int8 experts (the int4 W4A8 grouped matmul with its scale_bias is not implemented here: such
a model keeps the reference). Importing this module raises ImportError where torch_npu is missing.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch_npu

from xinserve.kernels.ascend.mla import half_precision_only
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.quantized_weight import QuantizedWeight, unpack_int4

if TYPE_CHECKING:
    from xinserve.kernels.quantized_weight import QuantShape

GROUP_MULTIPLE = 32  # npu_weight_quant_batchmatmul: antiquant_group_size a multiple of 32


@dataclass(frozen=True, slots=True)
class AscendQuantLinear:
    """One linear weight as the Ascend operators take it."""

    kind: str  # "static" | "dynamic" | "weight_only"
    weight: torch.Tensor  # [in, out] int8, or [in, out / 8] int32 (int4 packed)
    scale: torch.Tensor  # static: deq_scale [out] (int64 or float32); dynamic: [out] float32;
    # weight_only: antiquant scale [out] or [groups, out] in the compute dtype
    offset: torch.Tensor | None = None  # weight_only: antiquant offset (= -zero), like scale
    group_size: int = 0  # weight_only: 0 per channel, else the group of inputs
    input_scale: torch.Tensor | None = None  # static: [in] float32 (npu_quantize, axis -1, x / scale)
    input_offset: torch.Tensor | None = None  # static: [in] float32, rounded to an integer
    correction: torch.Tensor | None = None  # static: [out] int32, -input_offset * sum_i Wq[o, i]
    dequant: torch.Tensor | None = None  # static: deq_scale [out] float32 (for the bias)


def _unsupported_linear(shape: "QuantShape") -> str | None:
    if shape.qtype == "fp8":
        return "fp8 weights unsupported (no Ascend FP8 matmul)"
    if shape.block[0] != 1:
        return f"scale block {shape.block} unsupported (per output channel or per group of inputs only)"
    if shape.activation == "none":
        group = shape.block[1]
        if group < shape.in_features and (group % GROUP_MULTIPLE or shape.in_features % group):
            return f"group of {group} inputs unsupported (a multiple of {GROUP_MULTIPLE} dividing the inputs)"
        if shape.qtype == "int4" and shape.out_features % 8:
            return f"int4 with {shape.out_features} outputs unsupported (int32 packing: a multiple of 8)"
        return None
    if shape.qtype != "int8" or shape.activation not in ("int8_static", "int8_per_token"):
        return f"{shape.qtype} weights with {shape.activation} activations unsupported"
    if shape.asymmetric or shape.block[1] < shape.in_features:
        return "int8 activations need symmetric per-channel weight scales (npu_quant_matmul)"
    return None


def _unsupported_experts(shape: "QuantShape") -> str | None:
    if shape.qtype != "int8" or shape.activation != "int8_per_token" or shape.asymmetric:
        return (f"{shape.qtype} experts with {shape.activation} activations unsupported (int8 per-token "
                "grouped matmul only)")
    if shape.block != (1, shape.in_features):
        return f"expert scale block {shape.block} unsupported (per output channel only)"
    return None


def quant_limits(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    """Why ``op`` cannot take one of the model's quantized weights here; None when it takes them all."""
    experts = op == "quant_fused_moe"
    for shape in getattr(shapes, "quant_shapes", ()):
        if bool(shape.experts) == experts:
            reason = _unsupported_experts(shape) if experts else _unsupported_linear(shape)
            if reason is not None:
                return reason
    return half_precision_only(shapes, dtype)


def prepare_quant_weight(weight: QuantizedWeight, dtype: torch.dtype) -> AscendQuantLinear:
    out_features = weight.out_features
    scale = weight.scale.float()  # [out, groups]
    if weight.activation == "int8_static":
        # y = deq_scale * (x_q @ Wq.T + correction) with x_q = round(x / s_x) + o_x: the offset's
        # contribution o_x * sum_i Wq[o, i] taken back out in the int32 bias (the float bias is added
        # after, in quant_linear), and deq_scale = s_x * weight scale.
        q = weight.qweight
        deq_scale = weight.input_scale.float() * scale.view(out_features)
        offset = torch.round(weight.input_offset.float()) if weight.input_offset is not None else None
        correction = torch.zeros(out_features, dtype=torch.int32, device=q.device)
        if offset is not None:
            correction = (-offset * q.float().sum(dim=1)).round().to(torch.int32)
        in_features = weight.in_features
        return AscendQuantLinear(
            "static", q.T.contiguous(),
            torch_npu.npu_trans_quant_param(deq_scale) if dtype == torch.float16 else deq_scale,
            input_scale=weight.input_scale.float().expand(in_features).contiguous(),
            input_offset=(offset if offset is not None else torch.zeros((), device=q.device)).float()
            .expand(in_features).contiguous(),
            correction=correction, dequant=deq_scale)
    if weight.activation == "int8_per_token":
        return AscendQuantLinear("dynamic", weight.qweight.T.contiguous(), scale.view(out_features).contiguous())
    # weight only: W = (q - zero) * scale = (q + offset) * scale with offset = -zero
    group = weight.block[1] if weight.block[1] < weight.in_features else 0
    per_group = (lambda t: t.T.contiguous()) if group else (lambda t: t.view(out_features).contiguous())
    offset = None if weight.zero is None else per_group(-weight.zero.float()).to(dtype)
    if weight.bits == 4:
        values = unpack_int4(weight.qweight, weight.in_features).T.to(torch.int32).contiguous()  # [in, out]
        packed = torch_npu.npu_convert_weight_to_int4pack(values)
    else:
        packed = weight.qweight.T.contiguous()
    return AscendQuantLinear("weight_only", packed, per_group(scale).to(dtype), offset=offset, group_size=group)


def quant_linear(x: torch.Tensor, weight: AscendQuantLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, in] float16 / bfloat16 -> [T, out] in x's dtype."""
    # The bias goes into the operator, so the output is rounded to x's dtype once.
    if weight.kind == "static":
        # in deq_scale units into the int32 bias, as msModelSlim's quant_bias holds it (error at most
        # deq_scale / 2, far below the output's rounding)
        int_bias = weight.correction
        if bias is not None:
            int_bias = int_bias + torch.round(bias.float() / weight.dequant).to(torch.int32)
        x_q = torch_npu.npu_quantize(x, weight.input_scale, weight.input_offset, torch.qint8, -1, True)
        return torch_npu.npu_quant_matmul(x_q, weight.weight, weight.scale, bias=int_bias, output_dtype=x.dtype)
    if weight.kind == "dynamic":
        x_q, token_scale = torch_npu.npu_dynamic_quant(x)  # [T, in] int8, [T] float32
        return torch_npu.npu_quant_matmul(x_q, weight.weight, weight.scale, pertoken_scale=token_scale,
                                          bias=None if bias is None else bias.float(), output_dtype=x.dtype)
    # the operator's bias: float16 for float16 activations, float32 for bfloat16 ones
    bias = None if bias is None else bias.to(torch.float16 if x.dtype == torch.float16 else torch.float32)
    return torch_npu.npu_weight_quant_batchmatmul(x, weight.weight, weight.scale, antiquant_offset=weight.offset,
                                                  bias=bias, antiquant_group_size=weight.group_size)


def prepare_quant_experts(w13: QuantizedWeight, w2: QuantizedWeight, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w13 [E, Hd, 2I] int8, its scale [E, 2I] float32, w2 [E, I, Hd] int8, its scale [E, Hd]
    float32): the grouped matmul's [E, K, N] weights."""
    def scales(weight: QuantizedWeight) -> torch.Tensor:
        return weight.scale.float().reshape(weight.scale.shape[0], -1).contiguous()

    return (w13.qweight.transpose(1, 2).contiguous(), scales(w13),
            w2.qweight.transpose(1, 2).contiguous(), scales(w2))


def quant_fused_moe(hidden: torch.Tensor, experts: tuple[torch.Tensor, ...], topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """hidden: [T, Hd]; topk_weights [T, K] float32; topk_ids [T, K] -> [T, Hd]."""
    w13, w13_scale, w2, w2_scale = experts
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    # expanded: [T * K, Hd] sorted by expert; row_map [T * K] int32; counts [E] (see kernels/ascend/ops.py)
    expanded, row_map, counts, _ = torch_npu.npu_moe_init_routing_v2(
        hidden, topk_ids.to(torch.int32), active_num=num_tokens * top_k, expert_num=num_experts,
        expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[0, num_experts],
        quant_mode=-1)
    grouped = {"split_item": 2, "group_type": 0, "group_list_type": 1, "group_list": counts.to(torch.int64),
               "output_dtype": hidden.dtype}
    x_q, token_scale = torch_npu.npu_dynamic_quant(expanded)
    gate_up = torch_npu.npu_grouped_matmul([x_q], [w13], scale=[w13_scale], per_token_scale=[token_scale],
                                           **grouped)[0]  # [T * K, 2I]
    act_q, act_scale = torch_npu.npu_dynamic_quant(torch_npu.npu_swiglu(gate_up))
    down = torch_npu.npu_grouped_matmul([act_q], [w2], scale=[w2_scale], per_token_scale=[act_scale],
                                        **grouped)[0]  # [T * K, Hd]
    return torch_npu.npu_moe_token_unpermute(permuted_tokens=down, sorted_indices=row_map,
                                             probs=topk_weights.to(down.dtype))

OPS = {fn.__name__: fn for fn in (prepare_quant_weight, quant_linear, prepare_quant_experts, quant_fused_moe)}
LIMITS = {
    "quant_linear": lambda shapes, dtype: quant_limits("quant_linear", shapes, dtype),
    "quant_fused_moe": lambda shapes, dtype: quant_limits("quant_fused_moe", shapes, dtype),
}

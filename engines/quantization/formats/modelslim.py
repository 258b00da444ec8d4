"""msModelSlim checkpoints (Ascend, the "ascendv1" layout) -> the canonical record.

A directory with ``quant_model_description.json`` (tensor name -> its scheme, plus
``model_quant_type``, ``version``, ``group_size``) and ``quant_model_weight*.safetensors``. Per linear
``<m>`` whose ``<m>.weight`` has scheme:
  FLOAT         float tensors, loaded as they are (norms carry the smoothing factors already folded in)
  W8A8          static: weight int8 [out, in]; input_scale, input_offset [1] (x_q = round(x / s) + o,
                asymmetric, per tensor); deq_scale [out] (float32, or for float16 models the float32's
                bits in an int64); quant_bias int32 [out]; weight_scale / weight_offset unused by the
                kernel and ignored
  W8A8_DYNAMIC  weight int8 [out, in]; weight_scale [out, 1] (or [out, in / group_size]); offsets 0;
                activations quantized per token
  W8A16         weight int8 [out, in]; weight_scale, weight_offset [out, groups]: W = (q + offset) * scale,
                as npu_weight_quant_batchmatmul's antiquant offset is added
  W4A8_DYNAMIC  weight int8 [ceil(out / 2), in]: two signed 4-bit values a byte along the OUTPUT rows,
                row 2r in the low nibble, 2r + 1 in the high one (two's complement); weight_scale
                [out, 1]; scale_bias (a precomputed correction for the grouped-matmul kernel, derived
                from the weight) ignored; MoE experts each their own linear, per channel only
Any other scheme (W4A4, W8A8_MIX, MXFP, kv-cache C8, ...) is refused by name.
"""

import glob
import json
import os
from collections.abc import Iterable, Iterator

import torch

from xinserve.kernels.quantized_weight import QuantizedWeight, pack_int4

DESCRIPTION = "quant_model_description.json"
WEIGHTS_GLOB = "quant_model_weight*.safetensors"
SCHEMES = ("W8A8", "W8A8_DYNAMIC", "W8A16", "W4A8_DYNAMIC")
FLOAT = "FLOAT"
# Each quantized linear's tensors the conversion needs (the description lists every one written).
REQUIRED = {
    "W8A8": {"weight", "input_scale", "input_offset", "deq_scale", "quant_bias"},
    "W8A8_DYNAMIC": {"weight", "weight_scale"},
    "W8A16": {"weight", "weight_scale", "weight_offset"},
    "W4A8_DYNAMIC": {"weight", "weight_scale"},
}


def detect(path: str, config: object) -> bool:
    return os.path.isfile(os.path.join(path, DESCRIPTION)) and bool(glob.glob(os.path.join(path, WEIGHTS_GLOB)))


def read_description(path: str) -> dict:
    with open(os.path.join(path, DESCRIPTION)) as f:
        return json.load(f)


def read(path: str, config: object, tensors: Iterable[tuple[str, torch.Tensor]]
         ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    description = read_description(path)
    _check_description(description)
    group_size = int(description.get("group_size", 0) or 0)
    # module -> its scheme; members: module -> the parts to gather before converting it
    modules = {name[: -len(".weight")]: scheme for name, scheme in description.items()
               if name.endswith(".weight") and scheme in SCHEMES}
    listed: dict[str, set[str]] = {}
    for name in description:
        module, _, part = name.rpartition(".")
        listed.setdefault(module, set()).add(part)
    # A float bias beside a W8A8 weight is gathered (the derived one replaces it); elsewhere it loads as is.
    members = {module: (listed[module] | REQUIRED[scheme]) - ({"bias"} if scheme != "W8A8" else set())
               for module, scheme in modules.items()}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if module not in modules or part == "bias" and modules[module] != "W8A8":
            yield from _float_tensor(name, tensor, description)
            continue
        got = pending.setdefault(module, {})
        got[part] = tensor
        if got.keys() >= members[module]:
            yield from _convert(module, modules[module], pending.pop(module), group_size)
    for module, got in pending.items():
        raise ValueError(f"{module}: msModelSlim {modules[module]} tensors missing: "
                         f"{sorted(members[module] - got.keys())}")


def _check_description(description: dict) -> None:
    """Refuse a checkpoint any of whose tensors uses a scheme we do not implement, naming it."""
    unknown = {}
    for name, scheme in description.items():
        if isinstance(scheme, str) and "." in name and scheme not in (*SCHEMES, FLOAT):
            unknown.setdefault(scheme, name)
    if unknown:
        examples = ", ".join(f"{s} (e.g. {n})" for s, n in sorted(unknown.items()))
        raise ValueError(f"msModelSlim scheme not implemented: {examples}; implemented: {', '.join(SCHEMES)}, FLOAT")
    for key in ("kv_quant_type", "fa_quant_type", "reduce_quant_type"):
        if description.get(key):
            raise ValueError(f"msModelSlim {key} {description[key]!r} is not implemented")


def _float_tensor(name: str, tensor: torch.Tensor, description: dict
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    scheme = description.get(name, FLOAT)
    if scheme != FLOAT:
        raise ValueError(f"{name}: msModelSlim scheme {scheme!r} outside a quantized linear is not implemented")
    module, _, part = name.rpartition(".")
    # Anti-outlier "norm bias" (m2/m4 smoothing): an RMSNorm with an added bias, which our norms lack.
    if module.endswith("norm") and part == "bias":
        if tensor.any():
            raise ValueError(f"{name}: msModelSlim anti-outlier norm bias is not implemented")
        return
    if module.endswith("norm.module") and part == "weight":  # the wrapped norm of the same anti-outlier
        name = f"{module.rpartition('.')[0]}.weight"
    yield name, tensor


def _deq_scale(value: torch.Tensor) -> torch.Tensor:
    """deq_scale as float32 [out]: float16 models store each float32's bit pattern in an int64."""
    if value.dtype == torch.int64:
        return value.to(torch.int32).view(torch.float32)
    return value.float()


def _convert(module: str, scheme: str, parts: dict[str, torch.Tensor], group_size: int
             ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    weight = parts["weight"]
    if scheme == "W8A8":
        yield from _w8a8_static(module, parts)
        return
    scale = parts["weight_scale"].float().reshape(parts["weight_scale"].shape[0], -1)  # [out, groups]
    out_features = scale.shape[0]
    if scheme == "W4A8_DYNAMIC":
        if scale.shape[1] != 1 or group_size > 0:
            raise ValueError(f"{module}: msModelSlim W4A8_DYNAMIC per group is not implemented (per channel is)")
        values = _unpack_output_nibbles(weight, out_features)
        yield f"{module}.weight", QuantizedWeight(
            qweight=pack_int4(values), bits=4, scale=scale, block=(1, values.shape[1]),
            in_features=values.shape[1], out_features=out_features, activation="int8_per_token")
        return
    in_features = weight.shape[1]
    block_cols = _group_columns(module, in_features, scale.shape[1], group_size)
    zero = None
    if scheme == "W8A16" and parts["weight_offset"].any():
        zero = -parts["weight_offset"].float().reshape(scale.shape)  # W = (q + offset) * scale
    activation = "int8_per_token" if scheme == "W8A8_DYNAMIC" else "none"
    yield f"{module}.weight", QuantizedWeight(
        qweight=weight.to(torch.int8).contiguous(), bits=8, scale=scale.contiguous(), block=(1, block_cols),
        in_features=in_features, out_features=out_features, zero=zero, activation=activation)


def _w8a8_static(module: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The Ascend kernel computes, per output row o (Wq the int8 weight, x_q = round(x / s_x) + o_x):
        y[o] = deq_scale[o] * (sum_i x_q[i] * Wq[o, i] + quant_bias[o])
    Writing x_q = (x_q - o_x) + o_x:
        y[o] = deq_scale[o] * sum_i (x_q[i] - o_x) * Wq[o, i]
             + deq_scale[o] * (quant_bias[o] + o_x * sum_i Wq[o, i])
    and (x_q - o_x) * s_x is act(x) of the canonical record, so with
        weight scale[o] = deq_scale[o] / s_x      (msModelSlim wrote deq_scale = s_x * weight_scale)
        bias[o]         = deq_scale[o] * (quant_bias[o] + o_x * sum_i Wq[o, i])
    y = act(x) @ (Wq * scale).T + bias exactly: the quant_bias the kernel adds already holds the float
    bias (rounded to deq_scale units) minus the offset's correction, so it is the truth, and a float
    ``.bias`` stored beside it (unrounded) is not used, as the Ascend kernel does not use it."""
    weight = parts["weight"].to(torch.int8)
    out_features, in_features = weight.shape
    deq_scale = _deq_scale(parts["deq_scale"]).reshape(out_features).double()
    input_scale = parts["input_scale"].double().reshape(-1)[0]
    input_offset = parts["input_offset"].double().reshape(-1)[0]
    row_sums = weight.double().sum(dim=1)
    bias = deq_scale * (parts["quant_bias"].double().reshape(out_features) + input_offset * row_sums)
    yield f"{module}.weight", QuantizedWeight(
        qweight=weight.contiguous(), bits=8, scale=(deq_scale / input_scale).float().reshape(out_features, 1),
        block=(1, in_features), in_features=in_features, out_features=out_features, activation="int8_static",
        input_scale=input_scale.float(), input_offset=input_offset.float())
    # A model without linear biases (Llama) gets quant_bias = -o_x * row sums exactly, so bias 0.
    if "bias" in parts or bias.any():
        yield f"{module}.bias", bias.float()


def _unpack_output_nibbles(weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """W4A8 weight -> [out, in] int8 signed values. Older exports keep one value a byte ([out, in])."""
    if weight.shape[0] == out_features:
        return weight.to(torch.int8)
    packed = weight.to(torch.int8)
    low = torch.bitwise_left_shift(packed, 4) >> 4  # arithmetic shifts: sign-extends the low nibble
    high = packed >> 4
    return torch.stack((low, high), dim=1).reshape(-1, packed.shape[1])[:out_features]


def _group_columns(module: str, in_features: int, groups: int, group_size: int) -> int:
    if groups == 1:
        return in_features
    if group_size <= 0 or -(-in_features // group_size) != groups:
        raise ValueError(f"{module}: {groups} weight scale groups do not fit {in_features} inputs with "
                         f"group_size {group_size}")
    return group_size

"""AWQ checkpoints (``quantization_config.quant_method: awq``, AutoAWQ's GEMM version) -> the
canonical record.

Per quantized linear ``<m>`` (in inputs, out outputs, g the group size):
  <m>.qweight  int32 [in, out / 8]: packed along the output columns, eight 4-bit unsigned values a
               word in AutoAWQ's interleaved order: nibble k (bits 4k .. 4k + 3) holds column
               AWQ_ORDER[k] = 0, 2, 4, 6, 1, 3, 5, 7 of the word's eight
  <m>.qzeros   int32 [in / g, out / 8]: the zero points, packed the same way (no "- 1" as in GPTQ)
  <m>.scales   float16 [in / g, out]
  W[o, i] = (q[i, o] - zero[i // g, o]) * scales[i // g, o]
The GEMV version packs differently and is refused, as is AWQ without zero points.
"""

from collections.abc import Iterable, Iterator

import torch

from xinserve.engines.quantization.formats.hf_quant_config import by_module, quantization_config
from xinserve.engines.quantization.formats.packed_int32 import (
    AWQ_REVERSE_ORDER,
    grouped_record,
    unpack_columns,
)
from xinserve.kernels.quantized_weight import QuantizedWeight

PARTS = frozenset({"qweight", "qzeros", "scales"})


def detect(path: str, config: object) -> bool:
    return str(quantization_config(path, config).get("quant_method", "")).lower() == "awq"


def read(path: str, config: object, tensors: Iterable[tuple[str, torch.Tensor]]
         ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    settings = quantization_config(path, config)
    version = str(settings.get("version", "gemm")).lower()
    bits = int(settings.get("bits", settings.get("w_bit", 4)))
    if version != "gemm" or bits != 4 or not settings.get("zero_point", True):
        raise ValueError(f"AWQ version {version!r} with {bits} bits, zero_point {settings.get('zero_point')} "
                         "is not implemented (implemented: GEMM, 4 bits, with zero points)")
    group_size = int(settings.get("group_size", settings.get("q_group_size", 128)))
    for name, value in by_module(tensors, PARTS, PARTS):
        if isinstance(value, dict):
            yield f"{name}.weight", _record(name, value, group_size)
        else:
            yield name, value


def _record(module: str, parts: dict[str, torch.Tensor], group_size: int) -> QuantizedWeight:
    q = unpack_columns(parts["qweight"], 4, AWQ_REVERSE_ORDER).T  # [out, in]
    zero = unpack_columns(parts["qzeros"], 4, AWQ_REVERSE_ORDER)  # [groups, out]
    scale = parts["scales"]
    out_features, in_features = q.shape
    group_size = in_features if group_size <= 0 else group_size
    if scale.shape != zero.shape or scale.shape != (-(-in_features // group_size), out_features):
        raise ValueError(f"{module}: AWQ scales {tuple(scale.shape)} / qzeros {tuple(zero.shape)} do not fit "
                         f"{out_features} outputs x {in_features} inputs in groups of {group_size}")
    return grouped_record(q, zero.T, scale.T, 4, group_size)

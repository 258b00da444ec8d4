"""GPTQ checkpoints (``quantization_config.quant_method: gptq``, AutoGPTQ / GPTQModel layout) -> the
canonical record.

Per quantized linear ``<m>`` (in inputs, out outputs, g the group size, p = 32 / bits values a word):
  <m>.qweight  int32 [in / p, out]: packed along the input rows, row r * p + j at bit j * bits,
               unsigned values 0 .. 2^bits - 1
  <m>.qzeros   int32 [groups, out / p]: packed along the output columns likewise; the v1 format
               (``checkpoint_format`` gptq, the default) stores zero - 1, gptq_v2 the zero itself
  <m>.scales   float16 [groups, out]
  <m>.g_idx    int32 [in]: the group of each input row
  W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o]
With ``desc_act`` false the groups are the contiguous runs i // g and g_idx is ignored (as vLLM does).
With act-order (``desc_act`` true) g_idx may send the rows of one group anywhere: the canonical layout's
contiguous groups cannot express that, so such a checkpoint is refused unless its g_idx happens to be
the contiguous one.
"""

from collections.abc import Iterable, Iterator

import torch

from xinserve.engines.quantization.formats.hf_quant_config import by_module, quantization_config
from xinserve.engines.quantization.formats.packed_int32 import grouped_record, unpack_columns, unpack_rows
from xinserve.kernels.quantized_weight import QuantizedWeight

PARTS = frozenset({"qweight", "qzeros", "scales", "g_idx"})
BITS = (4, 8)


def detect(path: str, config: object) -> bool:
    return str(quantization_config(path, config).get("quant_method", "")).lower() == "gptq"


def read(path: str, config: object, tensors: Iterable[tuple[str, torch.Tensor]]
         ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    settings = quantization_config(path, config)
    bits = int(settings.get("bits", 4))
    if bits not in BITS:
        raise ValueError(f"GPTQ with {bits} bits is not implemented (implemented: 4, 8)")
    checkpoint_format = str(settings.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {checkpoint_format!r} is not implemented (gptq, gptq_v2)")
    desc_act = bool(settings.get("desc_act", False))
    required = frozenset({"qweight", "qzeros", "scales"} | ({"g_idx"} if desc_act else set()))
    for name, value in by_module(tensors, PARTS, required):
        if isinstance(value, dict):
            yield f"{name}.weight", _record(name, value, bits, int(settings.get("group_size", -1)),
                                            zero_minus_one=checkpoint_format == "gptq", desc_act=desc_act)
        else:
            yield name, value


def _record(module: str, parts: dict[str, torch.Tensor], bits: int, group_size: int, zero_minus_one: bool,
            desc_act: bool) -> QuantizedWeight:
    q = unpack_rows(parts["qweight"], bits).T  # [out, in]
    in_features = q.shape[1]
    group_size = in_features if group_size <= 0 else group_size
    if desc_act:
        contiguous = torch.arange(in_features) // group_size
        if not torch.equal(parts["g_idx"].long(), contiguous):
            raise ValueError(f"{module}: GPTQ act-order (desc_act with a permuted g_idx) is not implemented; "
                             "re-quantize with desc_act false")
    zero = unpack_columns(parts["qzeros"], bits) + (1 if zero_minus_one else 0)  # [groups, out]
    scale = parts["scales"]  # [groups, out]
    if scale.shape != zero.shape or scale.shape != (-(-in_features // group_size), q.shape[0]):
        raise ValueError(f"{module}: GPTQ scales {tuple(scale.shape)} / qzeros {tuple(zero.shape)} do not fit "
                         f"{q.shape[0]} outputs x {in_features} inputs in groups of {group_size}")
    return grouped_record(q, zero.T, scale.T, bits, group_size)

"""The checkpoint formats, and the detection that picks one (or none) for a checkpoint.

Each format module exposes ``detect(path, config) -> bool`` and ``read(path, config, tensors)``: the
checkpoint's (name, tensor) stream turned into the model's float tensors plus one
``("<hf module>.weight", QuantizedWeight)`` per quantized linear (HF names as in the checkpoint; MoE
experts one record per expert), raising ValueError naming any scheme it does not implement. The keys
of ``FORMATS`` are vLLM's ``--quantization`` names.
"""

from types import ModuleType
from typing import Any

from xinserve.engines.quantization.config import quant_method
from xinserve.engines.quantization.formats import awq, compressed_tensors, fp8, gptq, modelslim

FORMATS: dict[str, ModuleType] = {
    "fp8": fp8,
    "compressed-tensors": compressed_tensors,
    "ascend": modelslim, "gptq": gptq, "awq": awq,  # msModelSlim's "ascendv1" layout as vllm-ascend names it
}


def detect_format(path: str, config: Any) -> str | None:
    """The name of the checkpoint's format, None for a float checkpoint. Raises ValueError for a
    ``quantization_config`` no format here implements (such a checkpoint is never read as floats)."""
    for name, module in FORMATS.items():
        if module.detect(path, config):
            return name
    method = quant_method(config)
    if method is not None:
        raise ValueError(f"the checkpoint at {path!r} is quantized with quant_method {method!r}, which is not "
                         f"implemented (implemented: {', '.join(FORMATS)})")
    return None

"""FP8 checkpoints (``quant_method: fp8``): float8_e4m3fn weights with float32 scales.

Block FP8 (DeepSeek-V3, GLM-5-FP8, Qwen3-FP8): ``weight_block_size`` [br, bc] and one
``<module>.weight_scale_inv`` per block, [ceil(out / br), ceil(in / bc)], the last block of each side
possibly partial (DeepSeek's 576-row ``kv_a_proj_with_mqa``): W = q * scale_inv of its block. The
activations are not quantized here: the matmul runs in the model's dtype on the dequantized weight
(vLLM's GPU kernels quantize them per 1 x bc group to FP8; computing without that is more exact).

Per-tensor FP8 (no ``weight_block_size``, vLLM's serialized fp8): one ``weight_scale`` per tensor,
and with ``activation_scheme: static`` one calibrated ``input_scale`` (else per-token dynamic).
Layers the config leaves out (``ignored_layers`` / ``modules_to_not_convert``) are stored in floats
and pass through as they are.
"""

from collections.abc import Iterator
from typing import Any

import torch

from xinserve.engines.quantization.config import quant_config, quant_method
from xinserve.kernels.quantized_weight import QuantizedWeight

SCHEMES = ("dynamic", "static")


def detect(path: str, config: Any) -> bool:
    return quant_method(config) == "fp8"


def read(path: str, config: Any, tensors: Iterator[tuple[str, torch.Tensor]]
         ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    settings = quant_config(config)
    scheme = settings.get("activation_scheme", "dynamic")
    if scheme not in SCHEMES:
        raise ValueError(f"fp8 activation_scheme {scheme!r} is not implemented (implemented: {', '.join(SCHEMES)})")
    block = settings.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"fp8 weight_block_size {block!r} is not [rows, cols]")
    # A module's tensors can sit in different shards: hold each part until its module is complete.
    pending: dict[str, dict[str, torch.Tensor]] = {}
    parts = ("weight", "weight_scale_inv") if block else ("weight", "weight_scale", "input_scale")
    needed = parts[:2] if block or scheme == "dynamic" else parts
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        if not (leaf == "weight" and tensor.dtype == torch.float8_e4m3fn or leaf in parts[1:]):
            yield name, tensor
            continue
        held = pending.setdefault(module, {})
        held[leaf] = tensor
        if all(part in held for part in needed):
            del pending[module]
            yield f"{module}.weight", _record(held, block, scheme)
    if pending:
        incomplete = sorted(pending)
        raise ValueError(f"fp8 checkpoint: {len(incomplete)} modules lack their weight or scale, e.g. "
                         f"{incomplete[0]!r} has only {sorted(pending[incomplete[0]])}")


def _record(held: dict[str, torch.Tensor], block: list[int] | None, scheme: str) -> QuantizedWeight:
    qweight = held["weight"]
    rows, cols = qweight.shape
    if block:
        scale = held["weight_scale_inv"].float()
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != grid:
            raise ValueError(f"fp8 weight_scale_inv of shape {tuple(scale.shape)} for a {rows} x {cols} weight in "
                             f"{block[0]} x {block[1]} blocks; expected {grid}")
        return QuantizedWeight(qweight, 8, scale, (block[0], block[1]), cols, rows)
    scale = held["weight_scale"].float().reshape(1, 1)
    if scheme == "static":
        return QuantizedWeight(qweight, 8, scale, (rows, cols), cols, rows, activation="fp8_static",
                               input_scale=held["input_scale"].float().reshape(()))
    return QuantizedWeight(qweight, 8, scale, (rows, cols), cols, rows, activation="fp8_per_token")

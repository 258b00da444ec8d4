"""On-the-fly quantization of a float checkpoint (``--quantization fp8`` / ``w8a8``), for users who have no
quantized copy: each linear weight of the decoder layers gets one scale per output channel computed
at load (symmetric, the channel's largest magnitude maps to the type's largest value), and the
activations are quantized per token at every step (dynamic).

Which weights: the 2-D ``*.weight`` tensors under ``model.layers.`` whose module is a projection
(``*_proj``, MLA's ``kv_a_proj_with_mqa``, Mixtral's experts ``w1`` / ``w2`` / ``w3``); routers, the DSA indexer, norms, embeddings and
``lm_head`` stay as they are, and so do the model's ``FLOAT_WEIGHTS`` (MLA's ``kv_b_proj``, whose weight
is absorbed into the attention rather than multiplied).
"""

from collections.abc import Iterator

import torch

from xinserve.kernels.quantized_weight import FP8_MAX, INT8_RANGE, QuantizedWeight

SCHEMES = ("fp8", "w8a8")
EXPERT_PROJECTIONS = ("w1", "w2", "w3")


def quantizable(name: str, tensor: torch.Tensor, kept_float: tuple[str, ...] = ()) -> bool:
    if not name.startswith("model.layers.") or not name.endswith(".weight") or tensor.dim() != 2:
        return False
    module = name.rsplit(".", 2)[-2]
    projection = module.endswith(("_proj", "_proj_with_mqa")) or module in EXPERT_PROJECTIONS
    return projection and not name.endswith(kept_float)


def quantize_weight(weight: torch.Tensor, scheme: str) -> QuantizedWeight:
    """[out, in] float -> a per-output-channel record with per-token activations."""
    rows, cols = weight.shape
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)  # [out, 1]
    if scheme == "fp8":
        scale = amax / FP8_MAX
        qweight = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedWeight(qweight, 8, scale, (1, cols), cols, rows, activation="fp8_per_token")
    scale = amax / INT8_RANGE[1]
    qweight = torch.round(w / scale).clamp(*INT8_RANGE).to(torch.int8)
    return QuantizedWeight(qweight, 8, scale, (1, cols), cols, rows, activation="int8_per_token")


def quantize_stream(tensors: Iterator[tuple[str, torch.Tensor]], scheme: str, kept_float: tuple[str, ...] = ()
                    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The float checkpoint's stream with its projection weights quantized as ``scheme`` says, except
    those whose names end with one of ``kept_float``."""
    if scheme not in SCHEMES:
        raise ValueError(f"on-the-fly quantization {scheme!r} is not implemented (implemented: {', '.join(SCHEMES)})")
    for name, tensor in tensors:
        yield (name, quantize_weight(tensor, scheme)) if quantizable(name, tensor, kept_float) else (name, tensor)

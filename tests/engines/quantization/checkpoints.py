"""Tiny quantized checkpoints for the tests, and their oracle.

``write_quantized`` turns a tiny float model into a quantized checkpoint (its config's
``quantization_config`` and each linear weight replaced by what a format stores), and writes the
oracle next to it: the same model with every quantized weight as the stored tensors dequantize to,
in float32, for transformers to run. Rows of each weight are first scaled by factors spread over 4x
(so neighbouring blocks and channels get clearly different scales, and a scale applied to the wrong
rows shows in the output).

``hf_greedy`` / ``hf_logprobs`` run transformers on the oracle, with the format's activation
quantization hooked into each quantized Linear's input where it has one.
"""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from xinserve.kernels.quantized_weight import FP8_MAX, QuantizedWeight, expand_grid, quantize_activation

# name, float32 weight -> (the tensors the format stores for it, leaf name -> tensor; its activation
# scheme as a record, or None when weight-only; the weight the stored tensors dequantize to), or None
# to leave the weight in floats
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], QuantizedWeight | None, torch.Tensor] | None]


def is_projection(name: str) -> bool:
    """The decoder layers' projections, as the formats quantize them (not routers, norms, embeddings)."""
    return name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def spread_rows(weight: torch.Tensor) -> torch.Tensor:
    rows = weight.shape[0]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(rows))
    return weight * (2.0 ** torch.linspace(-1, 1, rows))[order, None]


def fp8_blocks(block: tuple[int, int]) -> Quantizer:
    """Block FP8 as DeepSeek-V3 stores it: e4m3 weights, one float32 ``weight_scale_inv`` per block."""
    def quantize(name: str, weight: torch.Tensor):
        rows, cols = weight.shape
        (br, bc), grid = block, (-(-rows // block[0]), -(-cols // block[1]))
        padded = F.pad(weight, (0, -cols % bc, 0, -rows % br))
        scale = padded.abs().reshape(grid[0], br, grid[1], bc).amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
        q = (weight / expand_grid(scale, block, rows, cols)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale}, None, q.float() * expand_grid(scale, block, rows, cols)

    return quantize


def write_quantized(src: Path, dst: Path, oracle: Path, quantize: Quantizer, quantization_config: dict | None
                    ) -> dict[str, QuantizedWeight]:
    """Write the quantized checkpoint to ``dst`` and the float32 oracle to ``oracle``; returns the
    activation schemes of the quantized modules that quantize activations (module name -> record).
    ``quantization_config`` None: ``dst`` stays a float checkpoint (for on-the-fly quantization)."""
    for path in (dst, oracle):
        shutil.copytree(src, path, dirs_exist_ok=True)
        (path / "model.safetensors").unlink()
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    stored, floats, activations = {}, {}, {}
    for name, tensor in load_file(src / "model.safetensors").items():
        result = quantize(name, spread_rows(tensor.float())) if is_projection(name) else None
        if result is None:
            stored[name] = floats[name] = tensor
            continue
        tensors, activation, dequantized = result
        module = name.removesuffix(".weight")
        stored.update({f"{module}.{leaf}": value for leaf, value in tensors.items()})
        floats[name] = dequantized.float()
        if activation is not None:
            activations[module] = activation
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, oracle / "model.safetensors", metadata={"format": "pt"})
    return activations


def _hooked_model(oracle: Path, activations: dict[str, QuantizedWeight]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if name in activations:
            record = activations[name]
            module.register_forward_pre_hook(lambda _, args, record=record: (quantize_activation(args[0], record),))
    return model


def hf_greedy(oracle: Path, prompt: list[int], max_tokens: int,
              activations: dict[str, QuantizedWeight] | None = None) -> list[int]:
    model = _hooked_model(oracle, activations or {})
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, top_p=None, top_k=None, temperature=None)
    return out[0, len(prompt):].tolist()


def hf_logprobs(oracle: Path, ids: list[int], activations: dict[str, QuantizedWeight]) -> torch.Tensor:
    """[len(ids), vocab] log-probs of the next token after each prefix of ``ids``."""
    model = _hooked_model(oracle, activations)
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def greedy_regret(oracle: Path, prompt: list[int], tokens: list[int], activations: dict[str, QuantizedWeight]
                  ) -> float:
    """The largest, over the generated steps, of (the oracle's best log-prob - the log-prob of the token
    the engine chose): 0 when every choice is the oracle's argmax."""
    logprobs = hf_logprobs(oracle, prompt + tokens, activations)[len(prompt) - 1 : -1]  # [len(tokens), V]
    chosen = logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return float((logprobs.max(dim=-1).values - chosen).max())

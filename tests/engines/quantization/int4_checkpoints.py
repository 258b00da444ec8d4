"""Hand-made GPTQ and AWQ tensors for tests, written from the formats' documentation (AutoGPTQ's and
AutoAWQ's README / packing descriptions), independently of the readers: a float weight with a wide
spread of per-row magnitudes is quantized per group, asymmetrically, and packed as each format says."""

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tests.engines.quantization.modelslim_checkpoints import copy_model_files

# AutoAWQ GEMM: nibble k of each int32 holds output column AWQ_PACK_ORDER[k] of its group of eight.
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def spread_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """[out, in] float32 whose rows differ in magnitude by three orders (a scale applied to the wrong
    row or group shows)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-2, 1, out_features)[torch.randperm(out_features, generator=generator)]
    return torch.randn(out_features, in_features, generator=generator) * rows[:, None]


def quantize_groups(weight: torch.Tensor, group_size: int, bits: int = 4, symmetric: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max quantization per (row, group of inputs). Returns q [out, in] unsigned, zero and float16
    scale [out, groups], and the float32 weight they stand for: (q - zero) * scale."""
    out_features, in_features = weight.shape
    top = (1 << bits) - 1
    groups = -(-in_features // group_size)
    padded = torch.nn.functional.pad(weight, (0, groups * group_size - in_features))
    grouped = padded.view(out_features, groups, group_size)
    if symmetric:
        scale = (grouped.abs().amax(-1) / (top // 2)).half()
        zero = torch.full_like(scale, float(1 << (bits - 1)), dtype=torch.float32)
    else:
        low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
        scale = ((high - low) / top).half()
        # GPTQ v1 stores zero - 1, so a zero of 0 cannot be written: keep zeros in 1 .. top
        zero = torch.round(-low / scale.float()).clamp(1, top)
    full_scale = scale.float().repeat_interleave(group_size, 1)[:, :in_features]
    full_zero = zero.repeat_interleave(group_size, 1)[:, :in_features]
    q = torch.clamp(torch.round(weight / full_scale) + full_zero, 0, top)
    return q.to(torch.int32), zero.to(torch.int32), scale, (q - full_zero) * full_scale


def _words(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.uint32).view(np.int32).copy())


def gptq_tensors(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group_size: int, bits: int = 4,
                 zero_minus_one: bool = True) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout: qweight [in / p, out] packs p = 32 / bits consecutive INPUT rows per word
    (row r * p + j at bits j * bits); qzeros [groups, out / p] packs consecutive output columns the
    same way and holds zero - 1 (v1); scales [groups, out] float16; g_idx [in] = i // group_size."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    q_in_out = q.T.numpy().astype(np.uint64)  # [in, out]
    qweight = np.zeros((q_in_out.shape[0] // per_word, q_in_out.shape[1]), dtype=np.uint64)
    for j in range(per_word):
        qweight |= q_in_out[j::per_word] << np.uint64(j * bits)
    stored_zero = (zero.T.numpy().astype(np.int64) - (1 if zero_minus_one else 0)) & mask  # [groups, out]
    qzeros = np.zeros((stored_zero.shape[0], stored_zero.shape[1] // per_word), dtype=np.uint64)
    for j in range(per_word):
        qzeros |= stored_zero[:, j::per_word].astype(np.uint64) << np.uint64(j * bits)
    in_features = q.shape[1]
    return {"qweight": _words(qweight), "qzeros": _words(qzeros), "scales": scale.T.contiguous(),
            "g_idx": (torch.arange(in_features) // group_size).to(torch.int32)}


def awq_tensors(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout: qweight [in, out / 8] packs eight OUTPUT columns per word in the
    interleaved order AWQ_PACK_ORDER; qzeros [groups, out / 8] likewise (the zero itself);
    scales [groups, out] float16."""
    def pack(values: np.ndarray) -> torch.Tensor:  # [rows, cols] -> [rows, cols / 8]
        words = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint64)
        for k, column in enumerate(AWQ_PACK_ORDER):
            words |= values[:, column::8].astype(np.uint64) << np.uint64(4 * k)
        return _words(words)

    return {"qweight": pack(q.T.numpy()), "qzeros": pack(zero.T.numpy()), "scales": scale.T.contiguous()}


def write_int4_model(model_dir: Path, target: Path, method: str, group_size: int = 32
                     ) -> tuple[Path, dict[str, torch.Tensor]]:
    """The float checkpoint at ``model_dir`` with every attention and MLP projection quantized to 4 bits
    (asymmetric, per group) in GPTQ's or AWQ's layout, with its config's ``quantization_config``.
    Returns the directory and the float32 weights the stored tensors stand for (the oracle's)."""
    tensors, dequantized = {}, {}
    for name, tensor in load_file(str(next(model_dir.glob("*.safetensors")))).items():
        if tensor.dim() != 2 or "proj" not in name:
            tensors[name] = tensor
            continue
        module = name.removesuffix(".weight")
        q, zero, scale, dequantized[name] = quantize_groups(tensor.float(), group_size)
        parts = gptq_tensors(q, zero, scale, group_size) if method == "gptq" else awq_tensors(q, zero, scale)
        tensors.update({f"{module}.{k}": v for k, v in parts.items()})
    copy_model_files(model_dir, target)
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    settings = {"bits": 4, "group_size": group_size}
    config["quantization_config"] = (
        {"quant_method": "gptq", "desc_act": False, "sym": False, **settings} if method == "gptq"
        else {"quant_method": "awq", "version": "gemm", "zero_point": True, **settings})
    (target / "config.json").write_text(json.dumps(config))
    return target, dequantized

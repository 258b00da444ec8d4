"""msModelSlim checkpoints for tests: exported by msModelSlim itself (its PyPI wheel quantizes a tiny
Llama on CPU), or written by hand in its layout where the exporter has no CPU path (W4A8 MoE experts,
a model with linear biases)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

# The files a model directory needs besides its weights (msModelSlim writes only the weights and the
# description).
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json")
CALIBRATION_TEXT = "Once upon a time there was a little girl who loved the sea."


def copy_model_files(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (source / name).exists():
            shutil.copy(source / name, target / name)


REPO_ROOT = Path(__file__).resolve().parents[3]


def export_with_msmodelslim(model_dir: Path, target: Path, dynamic: bool) -> Path:
    """W8A8 (static, min-max calibrated on one sentence) or W8A8_DYNAMIC, every linear but lm_head,
    through msModelSlim's own calibrator and ascendV1 saver — in a child process: importing msModelSlim
    replaces pydantic.BaseModel process-wide (msmodelslim/utils/patch/pydantic.py), which breaks
    FastAPI apps and the openai SDK's parse() for the rest of a test session."""
    code = ("import sys; from pathlib import Path; from tests.engines.quantization.modelslim_checkpoints import "
            "_export; _export(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == '1')")
    subprocess.run([sys.executable, "-c", code, str(model_dir), str(target), "1" if dynamic else "0"],
                   cwd=REPO_ROOT, check=True)
    return target


def _export(model_dir: Path, target: Path, dynamic: bool) -> None:
    from msmodelslim.pytorch.llm_ptq.llm_ptq_tools import Calibrator, QuantConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = QuantConfig(w_bit=8, a_bit=8, disable_names=["lm_head"], dev_type="cpu", pr=1.0, mm_tensor=False,
                         is_dynamic=dynamic)
    calibration = [[tokenizer(CALIBRATION_TEXT, return_tensors="pt").input_ids]]
    cwd = os.getcwd()
    target.mkdir(parents=True, exist_ok=True)
    os.chdir(target)  # the calibrator drops a features.npy into the working directory: not the repo's
    try:
        calibrator = Calibrator(model, config, calib_data=calibration, disable_level="L0")
        calibrator.run()
        calibrator.save(str(target), save_type=["ascendV1"])
    finally:
        os.chdir(cwd)
    copy_model_files(model_dir, target)


def write_checkpoint(target: Path, tensors: dict[str, torch.Tensor], description: dict[str, str],
                     model_quant_type: str) -> Path:
    """The ascendV1 layout: quant_model_weight_<type>.safetensors plus quant_model_description.json."""
    target.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(target / f"quant_model_weight_{model_quant_type.lower()}.safetensors"))
    header = {"version": "1.0.0", "model_quant_type": model_quant_type, "group_size": 0}
    (target / "quant_model_description.json").write_text(json.dumps({**header, **description}, indent=1))
    return target


def float_bits_as_int64(values: torch.Tensor) -> torch.Tensor:
    """What msModelSlim stores as deq_scale for a float16 model: each float32's bits, widened."""
    return values.float().view(torch.int32).to(torch.int64)


def w4a8_pack(values: torch.Tensor) -> torch.Tensor:
    """msModelSlim's own W4A8 packing (two signed 4-bit values a byte along the output rows)."""
    # Its module file, loaded alone (it imports only torch): importing the msmodelslim package would patch
    # pydantic for the whole session (see ``export_with_msmodelslim``).
    package = Path(importlib.util.find_spec("msmodelslim").origin).parent
    spec = importlib.util.spec_from_file_location("msmodelslim_pack", package / "format" / "common" / "pack.py")
    pack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack)
    return pack.w4a8_pack_int4(values.to(torch.int8))


_exports: dict[str, Path] = {}


@pytest.fixture(scope="session")
def msmodelslim_w8a8(tiny_models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama exported by msModelSlim as W8A8 (static), once per session whichever test files
    ask (importing msModelSlim and calibrating cost seconds)."""
    if "W8A8" not in _exports:
        _exports["W8A8"] = export_with_msmodelslim(Path(tiny_models("llama")), tmp_path_factory.mktemp("w8a8"),
                                                   dynamic=False)
    return _exports["W8A8"]


def write_w8a8_dynamic(model_dir: Path, target: Path) -> Path:
    """Every linear of a float checkpoint but lm_head as msModelSlim writes W8A8_DYNAMIC: int8 weight,
    symmetric per-channel weight_scale [out, 1], weight_offset 0."""
    tensors, description = {}, {}
    for name, tensor in load_file(str(next(model_dir.glob("*.safetensors")))).items():
        if tensor.dim() != 2 or "proj" not in name:
            tensors[name], description[name] = tensor, "FLOAT"
            continue
        module = name.removesuffix(".weight")
        scale = tensor.float().abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
        parts = {"weight": torch.round(tensor / scale).clamp(-128, 127).to(torch.int8), "weight_scale": scale,
                 "weight_offset": torch.zeros_like(scale)}
        tensors.update({f"{module}.{k}": v for k, v in parts.items()})
        description.update({f"{module}.{k}": "W8A8_DYNAMIC" for k in parts})
    write_checkpoint(target, tensors, description, "W8A8_DYNAMIC")
    copy_model_files(model_dir, target)
    return target


def write_w4a8_moe(model_dir: Path, target: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A Qwen3-MoE float checkpoint as msModelSlim writes W4A8_DYNAMIC MoE models: each routed expert's
    projections 4-bit per output channel (packed by msModelSlim's own packer, with its scale_bias),
    attention W8A8_DYNAMIC, the routers, the dense first layer's MLP, embeddings and norms FLOAT.
    Returns the directory and the float32 weights the stored tensors stand for."""
    tensors, description, dequantized = {}, {}, {}
    for name, tensor in load_file(str(next(model_dir.glob("*.safetensors")))).items():
        module = name.removesuffix(".weight")
        if ".experts." in name:
            scheme, top = "W4A8_DYNAMIC", 7
        elif ".self_attn." in name and name.endswith("proj.weight"):
            scheme, top = "W8A8_DYNAMIC", 127
        else:
            tensors[name], description[name] = tensor, "FLOAT"
            continue
        scale = tensor.float().abs().amax(1, keepdim=True).clamp(min=1e-8) / top
        values = torch.round(tensor.float() / scale).clamp(-top - 1, top).to(torch.int8)
        dequantized[name] = values.float() * scale
        parts = {"weight": w4a8_pack(values) if top == 7 else values, "weight_scale": scale,
                 "weight_offset": torch.zeros_like(scale)}
        if top == 7:
            parts["scale_bias"] = 8 * dequantized[name].sum(1, keepdim=True)
        tensors.update({f"{module}.{k}": v for k, v in parts.items()})
        description.update({f"{module}.{k}": scheme for k in parts})
    write_checkpoint(target, tensors, description, "W4A8_DYNAMIC")
    copy_model_files(model_dir, target)
    return target, dequantized

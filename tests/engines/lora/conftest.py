"""Tiny PEFT adapters on the tiny test models, and transformers + PEFT as the reference."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: Path, path: Path, rank: int, targets=ALL_TARGETS, seed: int = 0, **config) -> Path:
    """A PEFT LoRA adapter of ``base`` saved at ``path``, its lora_B random too (PEFT starts B at zero,
    which would leave the outputs unchanged)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  lora_dropout=0.0, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    peft_model.save_pretrained(path)
    return path


def edit_config(path: Path, **changes) -> None:
    """Change keys of a saved adapter's adapter_config.json."""
    file = path / "adapter_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.fixture(scope="session")
def adapters(tiny_models, tmp_path_factory) -> Callable[..., Path]:
    """``get(arch, rank, **config) -> adapter dir`` memoised, on ``tiny_models(arch)``."""
    built: dict[str, Path] = {}

    def get(arch: str = "llama", rank: int = 8, seed: int = 0, **config) -> Path:
        key = f"{arch}:{rank}:{seed}:{sorted(config.items())!r}"
        if key not in built:
            built[key] = make_adapter(tiny_models(arch), tmp_path_factory.mktemp(f"lora-{arch}-r{rank}"), rank,
                                      seed=seed, **config)
        return built[key]

    return get


class PeftReference:
    """transformers + PEFT greedy generate, one prompt at a time, per adapter (None: the base model)."""

    def __init__(self, base: Path, adapters: dict[str, Path], max_tokens: int) -> None:
        self.max_tokens = max_tokens
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        self.vocab_size = model.config.vocab_size
        self.models: dict[str | None, torch.nn.Module] = {None: model}
        for name, path in adapters.items():
            base_copy = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            self.models[name] = PeftModel.from_pretrained(base_copy, path).eval()

    def generate(self, prompt: list[int], adapter: str | None) -> list[int]:
        with torch.inference_mode():
            out = self.models[adapter].generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=self.max_tokens, do_sample=False, top_p=None,
                top_k=None, temperature=None)
        return out[0, len(prompt):].tolist()

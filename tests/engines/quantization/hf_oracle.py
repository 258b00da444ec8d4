"""The oracle for quantized checkpoints: transformers in float32 running the same model with each
quantized weight replaced by the float weight its stored tensors stand for, and the scheme's activation
quantization (kernels/quantized_weight.py's ``quantize_activation``) applied to each quantized linear's
input by hooks on HF's modules (for Qwen3-MoE's fused experts, inside their forward)."""

import types
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.engines.quantization.modelslim_checkpoints import copy_model_files
from xinserve.kernels.quantized_weight import quantize_activation


def activation(kind: str, input_scale: torch.Tensor | None = None, input_offset: torch.Tensor | None = None
               ) -> types.SimpleNamespace:
    """What ``quantize_activation`` reads of a record: the activation scheme and its static parameters."""
    scalar = (lambda t: None if t is None else t.float().reshape(()))
    return types.SimpleNamespace(activation=kind, input_scale=scalar(input_scale), input_offset=scalar(input_offset))


class QuantOracle:
    """``model_dir``: the float checkpoint; ``dequantized``: HF weight name -> float32 weight;
    ``activations``: HF module name (a Linear, or a fused experts module) -> its activation scheme."""

    def __init__(self, model_dir: Path, workdir: Path, dequantized: dict[str, torch.Tensor],
                 activations: dict[str, types.SimpleNamespace]) -> None:
        tensors = load_file(str(next(model_dir.glob("*.safetensors"))))
        copy_model_files(model_dir, workdir)
        save_file({name: dequantized.get(name, tensor).float().contiguous() for name, tensor in tensors.items()},
                  str(workdir / "model.safetensors"))
        self.model = AutoModelForCausalLM.from_pretrained(workdir, dtype=torch.float32).eval()
        modules = dict(self.model.named_modules())
        for name, spec in activations.items():
            module = modules[name]
            if hasattr(module, "gate_up_proj"):
                module.forward = types.MethodType(_quantized_experts_forward(spec), module)
            else:
                module.register_forward_pre_hook(lambda _, args, spec=spec: (quantize_activation(args[0], spec),))

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                      top_p=None, top_k=None, temperature=None)
        return out[0, len(prompt):].tolist()

    def regrets(self, prompt: list[int], generated: list[int]) -> list[float]:
        """Per generated token: how many nats below the oracle's best next token it is, teacher-forced
        on the generated sequence."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt + generated])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # [len(generated), V]
        chosen = logprobs.gather(1, torch.tensor(generated)[:, None])[:, 0]
        return (logprobs.max(dim=-1).values - chosen).tolist()


def _quantized_experts_forward(spec: types.SimpleNamespace):
    """HF Qwen3-MoE experts' computation with each expert's input and SwiGLU output quantized per row."""
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            gate, up = F.linear(quantize_activation(hidden_states[token], spec), self.gate_up_proj[expert]).chunk(2, -1)
            down = F.linear(quantize_activation(self.act_fn(gate) * up, spec), self.down_proj[expert])
            out.index_add_(0, token, down * top_k_weights[token, slot, None])
        return out

    return forward

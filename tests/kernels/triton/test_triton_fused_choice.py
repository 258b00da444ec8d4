"""Which platforms' registries choose the fused Triton kernels (rms_norm, rotary, silu_and_mul, top_k_top_p):
CUDA's and MUSA's preference orders do (MUSA's own module offers attention only), after the probe; the CPU's
never lists Triton, so a CPU worker keeps the reference there (the interpreter is a test device, not a fast
one). Ascend's order takes torch_npu's fused operators first: tests/kernels/ascend/test_npu.py
(``test_the_registry_chooses_npu_for_every_op``). Each op has a timing workload, run here once per
implementation, so on a GPU the kernels are weighed against the reference instead of winning by order."""

import pytest
import torch

from xinserve.engines.platforms.cpu import KERNEL_PREFERENCE as CPU_KERNELS
from xinserve.engines.platforms.cuda import KERNEL_PREFERENCE as CUDA_KERNELS
from xinserve.engines.platforms.musa import KERNEL_PREFERENCE as MUSA_KERNELS
from xinserve.kernels import registry
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes import elementwise_timing
from xinserve.kernels.probes.timing import WORKLOADS
from xinserve.kernels.references import dense as reference
from xinserve.kernels.triton import OPS

CPU = torch.device("cpu")
FUSED = ("rms_norm", "rotary", "silu_and_mul", "top_k_top_p")
# Llama-like with a partial GPT-J rotary (GLM), sizes that are no power of two
SHAPES = ModelShapes(num_heads=6, num_kv_heads=2, head_dim=40, rotary_dim=20, rope_is_neox=False, hidden_size=120,
                     intermediate_size=200, vocab_size=500, block_size=16)
OTHERS = {op: "reference" for op in registry.OPS if op not in FUSED}  # keeps the other ops' probes out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preference", [CUDA_KERNELS, MUSA_KERNELS], ids=["cuda", "musa"])
def test_cuda_and_musa_choose_the_triton_kernels(preference, dtype, monkeypatch) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    selection = registry.select(preference, CPU, dtype, SHAPES, forced=OTHERS)
    assert {op: selection.chosen[op] for op in FUSED} == dict.fromkeys(FUSED, "triton"), selection.rejected
    assert selection.ops.rms_norm is OPS["rms_norm"] and selection.ops.top_k_top_p is OPS["top_k_top_p"]
    assert selection.ops.rotary_embedding is OPS["rotary_embedding"]
    assert not set(FUSED) & set(selection.uncapturable)  # CUDA graphs may capture them


def test_the_cpu_never_lists_triton_and_keeps_the_reference(monkeypatch) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    assert "triton" not in CPU_KERNELS
    # defer_builds: the C++ kernels (which offer none of these ops) are not built for this
    selection = registry.select(CPU_KERNELS, CPU, torch.float32, SHAPES, forced=OTHERS, defer_builds=True)
    assert {op: selection.chosen[op] for op in FUSED} == dict.fromkeys(FUSED, "reference")


@pytest.mark.parametrize("op", FUSED)
def test_each_op_has_a_timing_workload_that_runs_both_implementations(op, monkeypatch) -> None:
    # a step of 2 tokens through 2 layers: the interpreter runs each program in Python
    monkeypatch.setattr(elementwise_timing, "LAYERS", 2)
    monkeypatch.setattr(elementwise_timing, "DECODE_TOKENS", 2)
    tiny = ModelShapes(num_heads=2, num_kv_heads=1, head_dim=8, rotary_dim=8, rope_is_neox=True, hidden_size=16,
                       intermediate_size=16, vocab_size=40, block_size=16)
    for functions in (OPS, reference.OPS):
        WORKLOADS[op](functions, tiny, CPU, torch.float32)()

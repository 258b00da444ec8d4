"""The fused Triton ops inside a model, under Triton's interpreter on the CPU: a worker forced to take Triton's
rms_norm, rotary, silu_and_mul and top_k_top_p generates the tokens of the reference path, greedy and seeded
sampling with top-k / top-p, on Qwen3 (per-head q/k norm on slices of the fused projection, neox rotary) and
GLM-4 (partial interleaved rotary)."""

import pytest

from xinserve.engines import LLM, SamplingParams

FUSED = ("rms_norm", "rotary", "silu_and_mul", "top_k_top_p")
# every other op the reference on both sides (a C++ kernel is a CPU candidate for attention and linear)
REFERENCE = {op: "reference" for op in ("decode_attention", "prefill_attention", "write_kv", "linear")}


@pytest.mark.parametrize("arch", ["qwen3", "glm4"])
def test_generation_with_the_fused_triton_ops_equals_the_reference(tiny_models, arch) -> None:
    model = tiny_models(arch, hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=2)
    options = {"dtype": "float32", "num_kv_blocks": 16, "max_num_batched_tokens": 64}
    fused = LLM(model, device="cpu", **options, kernels={**REFERENCE, **dict.fromkeys(FUSED, "triton")})
    plain = LLM(model, device="cpu", **options, kernels={**REFERENCE, **dict.fromkeys(FUSED, "reference")})
    assert {op: fused.engine.runner.kernels.chosen[op] for op in FUSED} == dict.fromkeys(FUSED, "triton")
    prompts = [[5, 17, 42, 9, 100, 3], [7, 8, 9]]
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                   SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True)):
        got = [r.token_ids for r in fused.generate(prompts, params)]
        assert got == [r.token_ids for r in plain.generate(prompts, params)]

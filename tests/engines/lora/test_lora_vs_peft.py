"""Greedy outputs with LoRA adapters equal transformers + PEFT token for token: 20 prompts, three adapters
of ranks 4, 8 and 16 (one rsLoRA, one with an alpha_pattern, one on the attention only) and base-model rows
in one batch, under preemption (a small KV pool), chunked prefill and prefix hits; a prefix never hits
across adapters."""

import random

import pytest

from tests.engines.lora.conftest import PeftReference
from xinserve.engines import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 8
ADAPTERS = {  # name -> (rank, PEFT config)
    "r4": (4, {}),
    "r8_rslora": (8, {"use_rslora": True, "alpha_pattern": {"down_proj": 3.0}}),
    "r16_attention": (16, {"targets": ["q_proj", "v_proj", "o_proj"]}),
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tiny_models, adapters):
    arch = request.param
    paths = {name: adapters(arch, rank, seed=i, **config) for i, (name, (rank, config)) in enumerate(ADAPTERS.items())}
    return tiny_models(arch), paths, PeftReference(tiny_models(arch), paths, MAX_TOKENS)


def mixed_batch(vocab_size: int) -> tuple[list[list[int]], list[str | None]]:
    """20 prompts, every adapter and the base model interleaved; prompts 16-19 repeat 0-3 with the same adapter."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 24))] for _ in range(16)]
    names = [[None, *ADAPTERS][i % 4] for i in range(16)]
    return prompts + prompts[:4], names + names[:4]


def test_adapters_and_base_rows_in_one_batch_match_peft_with_preemption_and_prefix_hits(setup):
    base, paths, reference = setup
    prompts, names = mixed_batch(reference.vocab_size)
    with LLM(base, enable_lora=True, max_loras=3, max_lora_rank=16, num_kv_blocks=40, block_size=4,
             max_num_batched_tokens=32, lora_modules={n: str(p) for n, p in paths.items()}) as llm:
        results = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, lora_name=n)
                                         for n in names])
        stats = llm.engine.stats()
        again = llm.generate(prompts[:8], [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, lora_name=n)
                                           for n in names[:8]])
        hits = llm.engine.stats().prefix_cache_hits_total - stats.prefix_cache_hits_total
    for prompt, name, result in zip(prompts, names, results):
        assert result.outputs[0].token_ids == reference.generate(prompt, name), f"adapter {name} diverged"
    for prompt, name, result in zip(prompts, names, again):
        assert result.outputs[0].token_ids == reference.generate(prompt, name), f"adapter {name} diverged on a hit"
    assert stats.num_preemptions_total > 0
    assert hits > 0
    outputs = {name: reference.generate(prompts[0], name) for name in [None, *ADAPTERS]}
    assert len({tuple(tokens) for tokens in outputs.values()}) == 4, "each adapter must change the output"


def test_a_prefix_cached_under_one_adapter_is_not_hit_under_another(setup):
    base, paths, reference = setup
    prompt = list(range(5, 5 + 21))  # five full blocks of 4
    with LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64, block_size=4) as llm:
        def run(name: str | None) -> tuple[list[int], int]:
            before = llm.engine.stats().prefix_cache_hits_total
            request = None if name is None else LoRARequest(name, str(paths[name]))
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), lora_request=request)
            return out[0].outputs[0].token_ids, llm.engine.stats().prefix_cache_hits_total - before

        tokens, hits = run("r4")
        assert hits == 0 and tokens == reference.generate(prompt, "r4")
        for other in ("r8_rslora", None):
            tokens, hits = run(other)
            assert hits == 0, f"{other} hit r4's cached prefix"
            assert tokens == reference.generate(prompt, other)
        tokens, hits = run("r4")
        assert hits == 20 and tokens == reference.generate(prompt, "r4")
        assert llm.engine.lora_names() == ["r4", "r8_rslora"]  # loaded on first use

"""LoRA over two tensor-parallel ranks (gloo, CPU): column-parallel projections hold their rows of B,
row-parallel ones their columns of A, and the outputs equal transformers + PEFT token for token with three
adapters and base rows in one batch, under preemption and prefix hits; adapters loaded at runtime and
beyond the slots reach every rank."""

import random

import pytest
import torch
from transformers import AutoConfig

from tests.engines.lora.conftest import PeftReference
from xinserve.engines import LLM, LoRARequest, SamplingParams
from xinserve.engines.lora.memory import lora_slot_bytes

MAX_TOKENS = 6
RANKS = {"r4": (4, {}), "r8": (8, {"use_rslora": True}), "r16": (16, {"targets": ["k_proj", "v_proj", "down_proj"]})}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_match_peft_with_mixed_adapters_preemption_and_prefix_hits(arch, tiny_models, adapters):
    base = tiny_models(arch)
    paths = {name: adapters(arch, rank, seed=20 + i, **config) for i, (name, (rank, config)) in enumerate(RANKS.items())}
    reference = PeftReference(base, paths, MAX_TOKENS)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, reference.vocab_size) for _ in range(rng.randint(4, 14))] for _ in range(8)]
    prompts += prompts[:2]  # repeated with the same adapter: prefix hits
    names = [[None, *RANKS][i % 4] for i in range(8)]
    names += names[:2]
    with LLM(base, tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=20,
             block_size=4, max_num_batched_tokens=16, lora_modules={"r4": str(paths["r4"])}) as llm:
        requests = [None if n is None else LoRARequest(n, str(paths[n])) for n in names]
        results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), lora_request=requests)
        stats = llm.engine.stats()
        slot_bytes = llm.engine.runner.lora.slot_bytes()
    for prompt, name, result in zip(prompts, names, results):
        assert result.outputs[0].token_ids == reference.generate(prompt, name), f"adapter {name} diverged"
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert slot_bytes == lora_slot_bytes(AutoConfig.from_pretrained(base), 16, torch.float32, tensor_parallel_size=2)

"""The correctness oracle: greedy tokens equal transformers' ``generate`` token for token, at any
batch composition, with preemption, with prefix caching and with chunked prefill; for dense,
mixture-of-experts and sliding-window models."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from xinserve.engines import LLM, SamplingParams

WINDOW = 7  # not a multiple of the block size: the window's edge moves through blocks
# name -> tiny_models arguments; the MoE shapes are server/embedded_model/factory.py's defaults (8 or 6 experts,
# top-2, a dense first layer, a shared expert, grouped routing)
MODELS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "glm4": ("glm4", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "glm4_moe": ("glm4_moe", {}),
    # every layer windowed; Qwen2's layer 0 full and layer 1 windowed (max_window_layers)
    "mistral_window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
}
ARCHS = [*MODELS, "stories260K"]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tiny_models):
    if request.param == "stories260K":
        return request.getfixturevalue("stories_dir")
    arch, kwargs = MODELS[request.param]
    return tiny_models(arch, **kwargs)


class Reference:
    """transformers' greedy generate, one prompt at a time (no padding), memoized."""

    def __init__(self, path):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.vocab_size = self.model.config.vocab_size
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def generate(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self.cache:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, top_p=None,
                    top_k=None, temperature=None,
                )
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]

    def prefill_logprobs(self, prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = self.model(torch.tensor([prompt])).logits[0, -1]
        return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def reference(model_dir):
    return Reference(model_dir)


def random_prompts(count: int, vocab_size: int, seed: int, lengths=(3, 40), prefix: list[int] = ()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, vocab_size) for _ in range(rng.randint(*lengths))]
            for _ in range(count)]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def check_against_reference(llm: LLM, reference: Reference, prompts: list[list[int]]) -> None:
    results = llm.generate(prompts, GREEDY)
    for prompt, result in zip(prompts, results):
        expected = reference.generate(prompt)
        assert result.prompt_token_ids == prompt
        assert result.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert result.finish_reason == ("length" if len(expected) == MAX_TOKENS else "stop")
    assert_all_blocks_free(llm)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.requests and not llm.engine.scheduler.running


def test_single_prompt(model_dir, reference):
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4)
    check_against_reference(llm, reference, random_prompts(1, reference.vocab_size, seed=1))


def test_sixteen_mixed_prompts_together(model_dir, reference):
    llm = LLM(model_dir, num_kv_blocks=256, block_size=4)
    check_against_reference(llm, reference, random_prompts(16, reference.vocab_size, seed=2))


def test_preemption_under_a_tiny_kv_pool(model_dir, reference):
    llm = LLM(model_dir, num_kv_blocks=24, block_size=4, enable_prefix_caching=False)
    check_against_reference(llm, reference, random_prompts(16, reference.vocab_size, seed=2, lengths=(10, 30)))
    assert llm.engine.stats().num_preemptions_total > 0


def test_prefix_caching_with_a_shared_long_prefix(model_dir, reference):
    llm = LLM(model_dir, num_kv_blocks=256, block_size=4, enable_prefix_caching=True)
    prefix = random_prompts(1, reference.vocab_size, seed=3, lengths=(33, 33))[0]
    prompts = random_prompts(8, reference.vocab_size, seed=4, lengths=(1, 9), prefix=prefix)
    check_against_reference(llm, reference, prompts[:1])
    check_against_reference(llm, reference, prompts[1:])
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits_total >= 7 * 32
    assert stats.prefix_cache_queries_total == sum(len(p) for p in prompts)


def test_chunked_prefill_with_a_budget_smaller_than_the_prompt(model_dir, reference):
    llm = LLM(model_dir, num_kv_blocks=256, block_size=4, max_num_batched_tokens=8)
    prompts = random_prompts(4, reference.vocab_size, seed=5, lengths=(20, 40))
    check_against_reference(llm, reference, prompts)


def test_one_token_budget_prefills_single_token_chunks(model_dir, reference):
    """Every step has one token: mid-prompt chunks look like decodes but must not be sampled."""
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, max_num_batched_tokens=1)
    check_against_reference(llm, reference, random_prompts(2, reference.vocab_size, seed=7, lengths=(5, 9)))


def test_first_token_logprobs_match_prefill_logits(model_dir, reference):
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4)
    prompt = random_prompts(1, reference.vocab_size, seed=6, lengths=(20, 20))[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    expected = reference.prefill_logprobs(prompt)
    lp = out.outputs[0].logprobs[0]
    top = torch.topk(expected, 5)
    assert lp.top_token_ids == top.indices.tolist()
    assert torch.allclose(torch.tensor(lp.top_logprobs), top.values, atol=1e-4)
    assert abs(lp.logprob - expected[out.token_ids[0]].item()) < 1e-4


def test_seeded_n4_sampling_is_the_same_with_preemption(model_dir, reference):
    """Extra choices that are preempted resume on their own context, not on another choice's."""
    prompts = random_prompts(3, reference.vocab_size, seed=8, lengths=(9, 14))
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    ample = LLM(model_dir, num_kv_blocks=256, block_size=4).generate(prompts, params)
    tight = LLM(model_dir, num_kv_blocks=20, block_size=4)
    squeezed = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions_total > 0
    for a, b in zip(ample, squeezed):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            assert [lp.logprob for lp in ca.logprobs] == pytest.approx([lp.logprob for lp in cb.logprobs],
                                                                      abs=1e-4)
    assert_all_blocks_free(tight)


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window"])
def test_sliding_window_past_its_edge(tiny_models, name):
    """Prompts from shorter than the window (their decode steps cross its edge) to six windows long,
    batched, at block sizes that do and do not divide the window, and in 5-token chunks; the window
    changes transformers' own tokens at these lengths, so attending to everything would fail."""
    arch, kwargs = MODELS[name]
    reference = Reference(tiny_models(arch, **kwargs))
    rng = random.Random(9)
    lengths = [WINDOW - 3, WINDOW, WINDOW + 1, 2 * WINDOW, 3 * WINDOW + 2, 6 * WINDOW]
    prompts = [[rng.randrange(3, reference.vocab_size) for _ in range(n)] for n in lengths]
    for options in ({"block_size": 4}, {"block_size": 16}, {"block_size": 4, "max_num_batched_tokens": 5}):
        check_against_reference(LLM(tiny_models(arch, **kwargs), num_kv_blocks=128, **options), reference, prompts)
    full_attention = Reference(tiny_models(arch))  # the same weights without a window
    assert any(reference.generate(p) != full_attention.generate(p) for p in prompts)

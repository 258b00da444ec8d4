"""Engine-level sampling behaviour: seeds, n > 1, stops, limits, and rejected prompts."""

import pytest

from xinserve.engines import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama"), num_kv_blocks=512, block_size=4)



PROMPTS = ["Once upon a time", "The little fox ran", "A cat and a dog"]


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm, tiny_models, assert_idle):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded)[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2]],
        [unseeded, seeded, SamplingParams(temperature=0.7, seed=9, max_tokens=5)],
    )
    assert mixed[1].token_ids == alone
    other = LLM(tiny_models("llama"), num_kv_blocks=64, block_size=8)
    assert other.generate([PROMPTS[0]], seeded)[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], different)[0].token_ids != alone
    assert_idle(llm)


def test_n_choices_share_the_prompt_and_differ(llm, assert_idle):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate([PROMPTS[0] * 8], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    single = llm.generate([PROMPTS[0] * 8], SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    assert single[0].token_ids == out.outputs[0].token_ids  # choice 0 matches n = 1
    greedy = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    assert_idle(llm)


def test_seeded_choices_do_not_repeat_a_neighbouring_seed(llm, assert_idle):
    def choices(seed: int) -> list[list[int]]:
        params = SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        return [c.token_ids for c in llm.generate([PROMPTS[0]], params)[0].outputs]

    zero, one = choices(0), choices(1)
    assert zero[1:] != one[:2]  # with seed + index, seed 0's choices 1-2 were seed 1's choices 0-1
    assert all(z != o for z in zero[1:] for o in one[:2])
    assert choices(0) == zero  # still deterministic
    assert_idle(llm)


def test_output_of_partial_characters_keeps_its_text(llm, assert_idle):
    """A byte-level token holding only a character's first byte, forced: its text was held back forever."""
    first_byte = llm.tokenizer.convert_tokens_to_ids("ð")  # byte 0xF0 in GPT-2's byte alphabet
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={first_byte: 100})
    out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert out.token_ids == [first_byte] * 12
    assert out.text == llm.tokenizer.decode(out.token_ids) == "\ufffd" * 12
    assert_idle(llm)


def test_stop_token_ids_and_max_tokens(llm, assert_idle):
    free_run = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    stop_id = free_run.token_ids[4]
    first = free_run.token_ids.index(stop_id)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free_run.token_ids[: first + 1] and out.finish_reason == "stop"
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 10
    assert_idle(llm)


def test_min_tokens_holds_back_stop_tokens_in_greedy_decoding(llm, assert_idle):
    first = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=1))[0].token_ids[0]
    stop_first = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first])
    stopped = llm.generate([PROMPTS[1]], stop_first)[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate(
        [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[first])
    )[0]
    assert first not in held.token_ids[:4] and len(held.token_ids) >= 4
    assert_idle(llm)


def test_stop_string_cuts_text_and_stops_generation(llm, assert_idle):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free_run = llm.generate([PROMPTS[2]], params)[0]
    text = free_run.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string from {text!r}"
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert len(out.token_ids) < len(free_run.token_ids)
    assert out.token_ids == free_run.token_ids[: len(out.token_ids)]
    assert_idle(llm)


def test_max_model_len_ends_generation_with_length(tiny_models):
    llm = LLM(tiny_models("llama"), num_kv_blocks=64, block_size=4, max_model_len=20)
    out = llm.generate([list(range(10, 25))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_prompts_that_can_never_fit_are_rejected_up_front(tiny_models, assert_idle):
    llm = LLM(tiny_models("llama"), num_kv_blocks=8, block_size=4, max_model_len=1000)
    assert llm.engine.max_model_len == 32  # capped to the whole KV pool
    with pytest.raises(ValueError, match="context"):
        llm.generate([list(range(10, 50))], SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10, 10_000_000]], SamplingParams(temperature=0))
    assert_idle(llm)


def test_invalid_sampling_params_raise():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="n must"):
        SamplingParams(n=0)


def test_kv_pool_is_sized_from_free_memory_after_warm_up(tiny_models):
    from xinserve.engines.platforms import get_platform

    # The small pool a few blocks of whatever memory is free now (a fixed 1e-6 of it is under one block
    # when the rest of the suite holds memory), the large one a hundred times that.
    probe = LLM(tiny_models("llama"), kv_cache_memory_fraction=1e-4, max_num_batched_tokens=64)
    small_fraction = max(1e-6, 4 * probe.engine.runner.bytes_per_block() / get_platform("cpu").free_memory())
    probe.close()
    small = LLM(tiny_models("llama"), kv_cache_memory_fraction=small_fraction, max_num_batched_tokens=64)
    large = LLM(tiny_models("llama"), kv_cache_memory_fraction=100 * small_fraction, max_num_batched_tokens=64)
    free = get_platform("cpu").free_memory()
    for llm, fraction in ((small, small_fraction), (large, 100 * small_fraction)):
        bm = llm.engine.block_manager
        assert bm.num_blocks * llm.engine.runner.bytes_per_block() <= 1.5 * fraction * free
        # plus the scratch block where padded decode rows write (engines/worker/decode_buckets.py)
        assert llm.engine.runner.kv_cache.shape[2] == bm.num_blocks + 1
    assert large.engine.block_manager.num_blocks > 10 * small.engine.block_manager.num_blocks
    out = small.generate(["Once upon a time"] * 4, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.token_ids) == 8 or o.finish_reason == "length" for o in out)


def test_extreme_seeds_work_and_out_of_range_seeds_are_rejected(llm, assert_idle):
    for seed in (2**63 - 1, -(2**63)):
        params = SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=4, ignore_eos=True)
        out = llm.generate([PROMPTS[0]], params)[0]
        assert [len(c.token_ids) for c in out.outputs] == [4, 4]
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    assert_idle(llm)

"""Async scheduling (engines/core/async_scheduling.py): step N+1 scheduled while step N runs, its inputs taken
from N's sampled tensor, and what the "one more token each" assumption got wrong corrected afterwards.
Greedy tokens still equal transformers' token for token with preemption, prefix-cache hits, max_tokens,
stop tokens and an abort mid-stream (a stop string's); seeded sampling equals the synchronous engine's;
a request async cannot serve (log-probs) runs synchronous steps; a failed step is redone; no block leaks."""

import random

import torch
from transformers import AutoModelForCausalLM

from xinserve.engines import LLM, SamplingParams


def reference(path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, top_p=None, top_k=None,
                               temperature=None)[0, len(p):].tolist() for p, n in zip(prompts, max_tokens)]


def drive(step, has_unfinished, after=lambda got: None) -> dict[str, tuple[list[int], str | None]]:
    """Every request's tokens and finish reason, stepping until nothing is left."""
    got: dict[str, tuple[list[int], str | None]] = {}
    while has_unfinished():
        for out in step().outputs:
            tokens, _ = got.get(out.request_id, ([], None))
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
        after(got)
    return got


def prompts_with_shared_prefixes(n: int) -> list[list[int]]:
    rng = random.Random(11)
    prefix = [rng.randrange(3, 200) for _ in range(9)]
    return [(prefix if i % 2 else []) + [rng.randrange(3, 200) for _ in range(rng.randint(3, 8))] for i in range(n)]


def test_greedy_equals_transformers_with_preemption_prefix_hits_stops_and_an_abort(tiny_model_dir, assert_idle):
    prompts = prompts_with_shared_prefixes(8)
    max_tokens = [3 + i % 4 * 3 for i in range(len(prompts))]
    expected = reference(tiny_model_dir, [*prompts, prompts[0]], [*max_tokens, 30])
    llm = LLM(tiny_model_dir, num_kv_blocks=20, block_size=4, enable_prefix_caching=True)
    engine = llm.engine
    stepper = engine.async_steps()
    # Request 1 stops at a token of its own output (a stop token ends it as EOS would).
    stop_at = expected[1][2]
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        stop = [stop_at] if i == 1 else []
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, stop_token_ids=stop))
    engine.add_request("long", prompts[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))

    def abort_long_after_three(got):
        # As a stop string found by the HTTP process would: the client got 3 tokens, the rest is dropped.
        if len(got.get("long", ([],))[0]) == 3 and "long" in engine.requests:
            engine.abort_request("long", 0, 3)

    got = drive(stepper.step, stepper.has_unfinished, abort_long_after_three)
    stepper.close()
    for i, tokens in enumerate(expected[:-1]):
        want = tokens[: tokens.index(stop_at) + 1] if i == 1 else tokens
        assert got[str(i)][0] == want, f"request {i} diverged"
        assert got[str(i)][1] == ("stop" if i == 1 or len(want) < max_tokens[i] else "length")
    assert got["long"] == (expected[-1][:3], None)
    stats = engine.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert stats.generation_tokens_total == sum(len(t) for t, _ in got.values())
    assert stepper.overlapped > 10 and stepper.synchronous == 0
    assert_idle(llm)


def test_seeded_sampling_equals_the_synchronous_engine_and_logprobs_run_synchronously(tiny_model_dir, assert_idle):
    prompts = prompts_with_shared_prefixes(6)

    def run(use_async: bool):
        llm = LLM(tiny_model_dir, num_kv_blocks=64, block_size=4)
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=3 if i == 5 else 10, ignore_eos=True,
                                    min_tokens=2 if i == 5 else 4, logprobs=2 if i == 5 else None)
            engine.add_request(str(i), prompt, params)
        stepper = engine.async_steps() if use_async else None
        got = drive(stepper.step, stepper.has_unfinished) if stepper else drive(engine.step, engine.has_unfinished_requests)
        assert_idle(llm)
        return got, stepper

    (sync_got, _), (async_got, stepper) = run(False), run(True)
    stepper.close()
    assert async_got == sync_got
    # Request 5 asks for log-probs: its steps ran synchronously, and the others' once it was done.
    assert stepper.synchronous > 0 and stepper.overlapped > 0


def test_a_failed_step_is_undone_and_run_again_synchronously(tiny_model_dir, assert_idle):
    prompts = prompts_with_shared_prefixes(4)
    expected = reference(tiny_model_dir, prompts, [8] * len(prompts))
    llm = LLM(tiny_model_dir, num_kv_blocks=64, block_size=4)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=8))
    stepper = engine.async_steps()
    forward, calls = engine.runner.forward, []

    def fails_once(batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("a device error")
        return forward(batch)

    engine.runner.forward = fails_once
    got = drive(stepper.step, stepper.has_unfinished)
    stepper.close()
    assert [got[str(i)][0] for i in range(len(prompts))] == expected
    assert stepper.synchronous >= 1 and len(calls) > 8
    assert_idle(llm)


def test_no_row_is_run_past_max_tokens_or_the_context(tiny_model_dir, assert_idle):
    """A sequence whose pending token is certainly its last gets no row after it: past the context
    there is no position to run (the rotary table ends there), past max_tokens the row is wasted."""
    prompt = list(range(5, 15))
    llm = LLM(tiny_model_dir, num_kv_blocks=16, block_size=4, max_model_len=16)
    engine = llm.engine
    engine.add_request("context", prompt, SamplingParams(temperature=0, ignore_eos=True))
    engine.add_request("budget", prompt[:5], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    stepper = engine.async_steps()
    rows = []
    schedule = engine.scheduler.schedule

    def counted():
        scheduled = schedule()
        rows.append(sum(s.num_new_tokens for s in scheduled))
        return scheduled

    engine.scheduler.schedule = counted
    got = drive(stepper.step, stepper.has_unfinished)
    stepper.close()
    expected = reference(tiny_model_dir, [prompt, prompt[:5]], [6, 4])
    assert got == {"context": (expected[0], "length"), "budget": (expected[1], "length")}
    assert stepper.synchronous == 0
    assert sum(rows) == len(prompt) + 5 + 5 + 3  # both prompts, then one row per token but each last
    assert_idle(llm)

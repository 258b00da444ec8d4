"""Grammar-constrained output, logit bias and prompt log-probs in the offline engine."""

import json
import threading
from dataclasses import replace

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from xinserve.engines import LLM, SamplingParams
from xinserve.engines.core.sequence import Sequence
from xinserve.engines.structured.compiler import GrammarCompiler
from xinserve.engines.structured.digest_cache import schema_digest
from xinserve.engines.structured.limits import SchemaLimits
from xinserve.engines.worker.runner import _plain_greedy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
}
PROMPTS = ["The river", "A small library", "Good software is tested"]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama"), num_kv_blocks=256, block_size=4)



def test_outputs_match_the_schema_greedy_seeded_and_n(llm, assert_idle):
    params = [
        SamplingParams(temperature=0, max_tokens=120, json_schema=SCHEMA),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=120, json_schema=SCHEMA),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),  # an unconstrained neighbour
    ]
    outs = llm.generate(PROMPTS, params)
    for choice in [*outs[0].outputs, *outs[1].outputs]:
        assert choice.finish_reason == "stop"  # the grammar's end, not max_tokens
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    assert len({c.text for c in outs[1].outputs}) > 1
    assert len(outs[2].token_ids) == 8
    again = llm.generate(PROMPTS[1], params[1])[0]
    assert [c.text for c in again.outputs] == [c.text for c in outs[1].outputs]  # seeds hold
    assert_idle(llm)


def test_any_json_object(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=60, json_schema={"type": "object"}))[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)


def test_preemption_keeps_the_grammar_state(tiny_models, llm):
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=120, json_schema=SCHEMA)
    roomy = llm.generate(PROMPTS[2], params)[0]
    # Blocks for about two of the four choices at once: the others are preempted and recomputed.
    tight = LLM(tiny_models("llama"), num_kv_blocks=36, block_size=4, enable_prefix_caching=False)
    out = tight.generate(PROMPTS[2], params)[0]
    assert tight.engine.scheduler.num_preemptions > 0
    assert [c.text for c in out.outputs] == [c.text for c in roomy.outputs]
    for choice in out.outputs:
        jsonschema.validate(json.loads(choice.text), SCHEMA)


def test_unconstrained_batches_never_build_a_mask(llm, monkeypatch):
    def fail(*args):
        raise AssertionError("an unconstrained batch built a grammar mask")

    monkeypatch.setattr("xinserve.engines.worker.sampler.apply_grammars", fail)
    monkeypatch.setattr("xinserve.engines.worker.runner.apply_grammars", fail)
    llm.generate(PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=1.0, max_tokens=4)])


def test_unsupported_schema_is_a_value_error(llm, assert_idle):
    with pytest.raises(ValueError, match="unsupported JSON schema"):
        llm.generate(PROMPTS[0], SamplingParams(json_schema={"type": "strin"}))
    with pytest.raises(ValueError, match="not valid JSON"):
        llm.generate(PROMPTS[0], SamplingParams(json_schema="{nope"))
    with pytest.raises(ValueError, match="json_schema must be"):
        SamplingParams(json_schema=["not", "a", "schema"])
    assert_idle(llm)


def test_logit_bias_forces_and_forbids(llm):
    forced = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logit_bias={50: 100}))[0]
    assert forced.token_ids == [50] * 5
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0].token_ids[0]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True, logit_bias={free: -100})
    assert free not in llm.generate(PROMPTS[0], params)[0].token_ids
    with pytest.raises(ValueError, match="logit_bias token ids"):
        llm.generate(PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})
    for bad in ({"x": 1.0}, {5: None}, {5: "high"}, [1, 2]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.engine.add_request("bad", [1, 2, 3], SamplingParams(prompt_logprobs=llm.engine.vocab_size + 1))


def test_prompt_logprobs_equal_transformers_and_survive_chunking(tiny_models):
    path = tiny_models("llama")
    prompt = "The river begins as a spring high in the mountains, where snow melts"
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    whole = LLM(path, num_kv_blocks=64, block_size=4).generate(prompt, params)[0]
    # A 5-token budget splits the prompt into chunks; every chunk adds its own log-probs.
    chunked = LLM(path, num_kv_blocks=64, block_size=4, max_num_batched_tokens=5).generate(prompt, params)[0]
    ids = whole.prompt_token_ids
    assert len(whole.prompt_logprobs) == len(ids) and whole.prompt_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)  # position i predicts i + 1
    for pos, (entry, other) in enumerate(zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]), start=1):
        assert entry.logprob == pytest.approx(expected[pos - 1, ids[pos]].item(), abs=1e-4)
        assert entry.top_token_ids == expected[pos - 1].topk(3).indices.tolist()
        assert other.logprob == pytest.approx(entry.logprob, abs=1e-4)
    assert chunked.token_ids == whole.token_ids


def test_only_plain_greedy_rows_take_the_fast_path():
    # The fast path is one argmax over the logits, masked by a grammar when there is one; a bias
    # must take the sampler.
    plain = Sequence(0, "r", [1, 2], SamplingParams(temperature=0))
    biased = Sequence(1, "r", [1, 2], SamplingParams(temperature=0, logit_bias={3: 5.0}))
    constrained = Sequence(2, "r", [1, 2], SamplingParams(temperature=0))
    constrained.grammar = object()
    assert _plain_greedy(plain) and _plain_greedy(constrained) and not _plain_greedy(biased)


def test_grammar_starts_after_its_token(llm):
    """``json_schema_after_token`` (a reasoning model's ``</think>``): free text up to and including the
    token, exactly as without a grammar, then JSON in the schema."""
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].token_ids
    after = free[3]
    cut = free.index(after) + 1  # its first appearance ends the free part
    params = SamplingParams(temperature=0, max_tokens=150, json_schema=SCHEMA, json_schema_after_token=after)
    out = llm.generate(PROMPTS[0], params)[0]
    assert out.token_ids[:cut] == free[:cut]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(llm.tokenizer.decode(out.token_ids[cut:], skip_special_tokens=True)), SCHEMA)


def test_a_costly_pattern_is_refused_before_any_compile(llm, assert_idle):
    # c{8000} once cost 9 s in the check and held the worker's compile thread.
    with pytest.raises(ValueError, match="patterns repeat to 8000 atoms"):
        llm.generate(PROMPTS[0], SamplingParams(json_schema={"type": "string", "pattern": "c{8000}"}))
    assert_idle(llm)


class _BlockingCompiles:
    """xgrammar's compiler, but a schema that mentions "slow" blocks until released."""

    def __init__(self, real) -> None:
        self.real = real
        self.started = threading.Event()
        self.release = threading.Event()

    def compile_json_schema(self, schema: str, **options):
        if "slow" in schema:
            self.started.set()
            self.release.wait()
        return self.real.compile_json_schema(schema, **options)


def _step_until(engine, request_id: str, limit: int = 3000) -> list:
    outs = []
    for _ in range(limit):
        outs += [o for o in engine.step().outputs if o.request_id == request_id]
        if outs and outs[-1].finished:
            return outs
    raise AssertionError(f"{request_id} did not finish in {limit} steps")


def test_a_costly_compile_neither_holds_up_a_cheap_one_nor_outlives_its_deadline(llm, monkeypatch, assert_idle):
    engine, grammars = llm.engine, llm.engine.grammars
    blocking = _BlockingCompiles(grammars._xgrammar_compiler())
    monkeypatch.setattr(grammars, "_xgrammar_compiler", lambda: blocking)
    monkeypatch.setattr(grammars, "limits", replace(grammars.limits, compile_timeout_s=3600.0))
    ids = engine.tokenizer.encode(PROMPTS[0])
    slow = json.dumps({"type": "string", "description": "slow", "maxLength": 5})
    engine.add_request("slow", ids, SamplingParams(temperature=0, max_tokens=20, json_schema=slow))
    try:
        _cheap_runs_then_slow_fails(engine, grammars, blocking, ids, slow, monkeypatch)
    finally:
        blocking.release.set()  # the compile thread must not outlive the test blocked
    assert_idle(llm)


def _cheap_runs_then_slow_fails(engine, grammars, blocking, ids, slow, monkeypatch) -> None:
    assert blocking.started.wait(60)
    cheap = SamplingParams(temperature=0, max_tokens=20, json_schema={"enum": ["red", "green"], "description": "cheap"})
    engine.add_request("cheap", ids, cheap)
    outs = _step_until(engine, "cheap")  # while the slow compile still holds its thread
    assert outs[-1].finish_reason == "stop" and not blocking.release.is_set()
    assert "slow" in engine.requests

    # Past its deadline (0 s: it started already) the slow request fails alone, as the client's fault.
    monkeypatch.setattr(grammars, "limits", replace(grammars.limits, compile_timeout_s=0.0))
    step = engine.step()
    (failed,) = [f for f in step.failures if f.request_id == "slow"]
    assert failed.bad_request and not [o for o in step.outputs if o.request_id == "slow"]
    assert "took more than 0s to compile" in failed.message
    # The same schema now fails at once, without another compile.
    engine.add_request("again", ids, SamplingParams(temperature=0, max_tokens=20, json_schema=slow))
    (again,) = [f for f in engine.step().failures if f.request_id == "again"]
    assert again.bad_request and "took more than" in again.message


def test_compiled_grammars_are_cached_by_digest_within_a_byte_budget(llm):
    engine = llm.engine
    schemas = [json.dumps({"enum": [f"value {i}"]}) for i in range(6)]
    probe = GrammarCompiler(engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    size = probe.compile(schemas[0]).future.result(60).memory_size_bytes
    budget = 3 * size + 1000  # room for about three of them
    grammars = GrammarCompiler(
        engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids), SchemaLimits(compiled_cache_bytes=budget)
    )
    for schema in schemas:
        pending = grammars.compile(schema)
        pending.future.result(60)
        grammars.account(pending)
        assert grammars.cache.size_bytes <= budget
    assert 1 < len(grammars.cache) < len(schemas)
    assert schema_digest(schemas[-1]) in grammars.cache and schema_digest(schemas[0]) not in grammars.cache

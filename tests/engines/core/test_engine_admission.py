"""What the engine refuses at admission or start-up, and how a failing step stays one request's
problem: every field that indexes the vocabulary or the rotary table is checked before the step."""

import shutil

import pytest

from xinserve.engines import LLM, SamplingParams
from xinserve.engines.core.outputs import RequestFailure

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama"), num_kv_blocks=128, block_size=4)



@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    (SamplingParams(stop_token_ids=[10**6], min_tokens=2), "stop_token_ids"),
])
def test_fields_outside_the_vocabulary_are_refused_at_admission(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.add_request("bad", [1, 2, 3], params)
    assert "bad" not in llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_a_negative_stop_token_id_is_refused_where_the_params_are_made():
    """No vocabulary holds it: ``SamplingParams.validate`` refuses it before any engine sees it."""
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1], min_tokens=2)


def test_max_model_len_beyond_the_rotary_table_is_refused(tiny_models):
    path = tiny_models("llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_model_len 65 is more than .* max_position_embeddings 64"):
        LLM(path, max_model_len=65, num_kv_blocks=64)
    assert LLM(path, max_model_len=64, num_kv_blocks=64).engine.max_model_len == 64


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_few_sequences_start_with_a_budget_longer_than_the_context(tiny_models, max_num_seqs):
    """The warm-up batch never holds a sequence longer than the context (it once overran rope)."""
    path = tiny_models("llama", max_position_embeddings=64)
    llm = LLM(path, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, kv_cache_memory_fraction=1e-4)
    out = llm.generate(["Once upon a time"] * 3, GREEDY)
    assert [len(o.token_ids) for o in out] == [6, 6, 6]


def test_weights_and_tokenizer_in_separate_directories(tiny_models, tmp_path):
    source = tiny_models("llama")
    weights, tokenizer = tmp_path / "weights", tmp_path / "tokenizer"
    weights.mkdir()
    tokenizer.mkdir()
    for f in source.iterdir():
        target = tokenizer if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) else weights
        shutil.copy(f, target / f.name)
    with pytest.raises((OSError, ValueError)):
        LLM(weights, num_kv_blocks=32)  # no tokenizer next to the weights
    split = LLM(weights, tokenizer=str(tokenizer), num_kv_blocks=32)
    whole = LLM(source, num_kv_blocks=32)
    assert split.engine.eos_token_ids == whole.engine.eos_token_ids
    assert split.generate(["The fox"], GREEDY)[0].token_ids == whole.generate(["The fox"], GREEDY)[0].token_ids


def test_a_step_that_fails_is_retried_without_the_request_behind_it(llm, monkeypatch, assert_idle):
    expected = llm.generate(["The little fox ran", "A cat and a dog"], GREEDY)
    execute = llm.engine.runner.execute

    def fails_with_poison(scheduled):
        if any(s.seq.request_id == "poison" for s in scheduled):
            raise RuntimeError("kernel fault")
        return execute(scheduled)

    monkeypatch.setattr(llm.engine.runner, "execute", fails_with_poison)
    engine = llm.engine
    tok = llm.tokenizer
    for request_id, prompt in (("a", "The little fox ran"), ("poison", "Once upon"), ("b", "A cat and a dog")):
        engine.add_request(request_id, tok.encode(prompt), GREEDY if request_id != "poison"
                           else SamplingParams(n=2, temperature=0, max_tokens=6))
    poison = engine.requests["poison"]
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    failures = []
    while engine.has_unfinished_requests():
        step = engine.step()
        failures += step.failures
        for out in step.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert failures == [RequestFailure("poison", "RuntimeError: kernel fault")]
    assert [seq.finish_reason for seq in poison] == ["abort", "abort"]  # every choice of it ended
    assert [tokens["a"], tokens["b"]] == [o.token_ids for o in expected]
    assert_idle(llm)


def test_generate_reports_a_failed_request_on_its_result(llm, monkeypatch, assert_idle):
    poison = llm.tokenizer.encode("Once upon")
    execute = llm.engine.runner.execute

    def fails_with_poison(scheduled):
        if any(s.seq.prompt_token_ids == poison for s in scheduled):
            raise RuntimeError("kernel fault")
        return execute(scheduled)

    monkeypatch.setattr(llm.engine.runner, "execute", fails_with_poison)
    good, failed = llm.generate(["The little fox ran", poison], [GREEDY, SamplingParams(n=2, temperature=0)])
    assert good.error is None and good.finish_reason == "length" and good.token_ids
    assert failed.error == "RuntimeError: kernel fault"
    assert [(c.finish_reason, c.token_ids) for c in failed.outputs] == [("abort", []), ("abort", [])]
    assert_idle(llm)

"""Request models: OpenAI's ranges and types, vLLM's extras, and the mapping to SamplingParams."""

import math

import pytest
from pydantic import ValidationError

from xinserve.engines import SamplingParams
from xinserve.server.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from xinserve.server.errors import APIError

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, **kw})


def bad_loc(**kw) -> tuple:
    with pytest.raises(ValidationError) as info:
        chat(**kw)
    return info.value.errors()[0]["loc"]


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", 2.01), ("temperature", -1), ("top_p", 1.01), ("top_p", -0.1), ("n", 0), ("n", 129),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("top_logprobs", 21),
])
def test_values_outside_openais_documented_ranges_are_rejected(field, value):
    assert bad_loc(**{field: value})[0] == field


@pytest.mark.parametrize(("field", "value"), [
    ("top_p", 0), ("max_tokens", 0), ("max_tokens", -1), ("max_completion_tokens", 0), ("min_p", 1.5),
    ("repetition_penalty", 0), ("top_k", -2), ("top_k", 2**63), ("seed", 2**63), ("seed", -(2**63) - 1),
    ("min_tokens", -1), ("stop_token_ids", [-1]), ("stop_token_ids", [2**63]), ("stop", [""]),
])
def test_values_outside_the_engines_ranges_are_a_400_naming_the_field(field, value):
    # Shapes pass the request model; the range is the engine's (SamplingParams.validate), checked once.
    req = chat(**{field: value})
    budget = 4 if req.requested_max_tokens is None else req.requested_max_tokens
    with pytest.raises(APIError) as info:
        req.sampling_params(max_tokens=budget, logprobs=None)
    assert (info.value.status, info.value.param, info.value.code) == (400, field, "invalid_value")
    assert info.value.message.startswith(f"Invalid value for '{field}': {field}")


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", "0.5"), ("n", 1.5), ("n", "2"), ("stream", "true"), ("max_tokens", "10"), ("logprobs", 1),
])
def test_wrong_types_are_rejected_not_coerced(field, value):
    assert bad_loc(**{field: value})[0] == field


def test_messages_rules():
    assert bad_loc(messages=[])[0] == "messages"
    assert bad_loc(messages=[{"role": "wizard", "content": "x"}])[:3] == ("messages", 0, "role")
    assert bad_loc(messages=[{"role": "user"}])[:2] == ("messages", 0)
    assert bad_loc(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]) == (
        "messages", 0, "content")
    # An assistant turn that only calls tools may have no content.
    req = chat(messages=[*MSG, {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])
    assert req.messages[1].text() == ""
    parts = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert parts.messages[0].text() == "a\nb"


def test_stop_forms():
    assert chat(stop="x").stop_list == ["x"]
    assert chat(stop=["a", "b", "c", "d"]).stop_list == ["a", "b", "c", "d"]
    assert chat().stop_list == []
    assert bad_loc(stop=["a", "b", "c", "d", "e"]) == ("stop",)
    with pytest.raises(APIError) as info:  # an empty stop string: the engine's rule
        chat(stop=[""]).sampling_params(max_tokens=1, logprobs=None)
    assert info.value.param == "stop"


def test_logit_bias_within_openais_limits_reaches_the_engine():
    def message(bias: dict) -> str:
        with pytest.raises(ValidationError) as info:
            chat(logit_bias=bias)
        assert info.value.errors()[0]["loc"] == ("logit_bias",)
        return info.value.errors()[0]["msg"]

    assert "at most 300" in message({str(i): 1.0 for i in range(301)})
    assert "[-100, 100]" in message({"3": 100.5})
    assert "token ids" in message({"-3": 1.0})
    # Digits int() refuses, which isdigit() accepts: once a 500 when the ids were checked.
    assert "token ids" in message({"\u00b2": 1.0})
    assert "token ids" in message({"\u0663": 1.0})  # ARABIC-INDIC DIGIT THREE: ASCII ids only
    assert chat(logit_bias={}).logit_bias == {}
    bias = {str(i): -100.0 + i / 2 for i in range(300)}
    assert chat(logit_bias=bias).sampling_params(max_tokens=1, logprobs=None).logit_bias == {
        i: -100.0 + i / 2 for i in range(300)}


def test_cross_field_checks_name_the_param():
    with pytest.raises(APIError) as info:
        chat(top_logprobs=2).check()
    assert (info.value.status, info.value.param) == (400, "top_logprobs")
    with pytest.raises(APIError) as info:
        chat(response_format={"type": "json_schema"}).check()
    assert info.value.param == "response_format.json_schema"
    chat(logprobs=True, top_logprobs=2, response_format={"type": "text"}).check()
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(APIError) as info:
        chat(tools=tools, tool_choice="required", response_format={"type": "json_object"}).check()
    assert info.value.param == "response_format"
    with pytest.raises(APIError) as info:
        chat(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}}).check()
    assert info.value.param == "tool_choice"
    chat(tool_choice="auto").check()  # auto without tools: nothing to call, nothing to refuse


def test_max_tokens_precedence_and_logprobs():
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens == 7
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=0).requested_max_tokens == 0  # refused by the engine
    assert (chat(max_tokens=5).max_tokens_param, chat(max_completion_tokens=7).max_tokens_param) == (
        "max_tokens", "max_completion_tokens")
    assert chat().requested_max_tokens is None
    assert chat().num_logprobs is None
    assert chat(logprobs=True).num_logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).num_logprobs == 5


def test_sampling_params_are_built_in_the_http_process():
    req = chat(n=2, temperature=0, top_p=0.9, top_k=-1, seed=3, stop="x", presence_penalty=0.5, ignore_eos=True,
               min_tokens=2, stop_token_ids=[7], repetition_penalty=1.1, skip_special_tokens=False)
    params = req.sampling_params(max_tokens=12, logprobs=3)
    assert isinstance(params, SamplingParams)
    assert (params.n, params.temperature, params.top_p, params.top_k, params.seed) == (2, 0, 0.9, 0, 3)
    assert (params.max_tokens, params.logprobs, params.ignore_eos, params.min_tokens) == (12, 3, True, 2)
    assert params.stop == ["x"]  # matched by the HTTP process's detokenizer, not the engine
    assert params.stop_token_ids == [7] and params.repetition_penalty == 1.1 and not params.skip_special_tokens
    defaults = chat().sampling_params(max_tokens=1, logprobs=None)
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (1.0, 1.0, 0)


def test_a_value_the_engine_refuses_is_a_400_before_any_worker_sees_it():
    with pytest.raises(APIError) as info:
        chat(seed=None).sampling_params(max_tokens=0, logprobs=None)
    assert info.value.status == 400 and "max_tokens" in info.value.message


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 1e-300), ("repetition_penalty", math.inf), ("repetition_penalty", math.nan),
    ("temperature", math.nan), ("min_p", math.nan), ("top_p", math.nan),
])
def test_a_non_finite_or_tiny_sampling_value_is_a_400_naming_its_field(field, value):
    # JSON's Infinity and NaN parse as floats; the engine's own range (SamplingParams.validate) refuses them.
    try:
        req = chat(**{field: value})
    except ValidationError as exc:  # OpenAI's narrower range, where the request model has one
        assert exc.errors()[0]["loc"] == (field,)
        return
    with pytest.raises(APIError) as info:
        req.sampling_params(max_tokens=4, logprobs=None)
    assert (info.value.status, info.value.param) == (400, field) and field in info.value.message


def test_min_tokens_above_max_tokens_is_a_400_naming_min_tokens():
    assert chat(min_tokens=4).sampling_params(max_tokens=4, logprobs=None).min_tokens == 4
    with pytest.raises(APIError) as info:  # the budget in effect: asked for, or what the context leaves
        chat(min_tokens=5, max_tokens=4).sampling_params(max_tokens=4, logprobs=None)
    assert (info.value.status, info.value.param) == (400, "min_tokens") and "4" in info.value.message
    with pytest.raises(ValueError, match="min_tokens"):  # the offline engine refuses it too
        SamplingParams(min_tokens=17, max_tokens=16)
    assert SamplingParams(min_tokens=17, max_tokens=None).min_tokens == 17


def test_completion_prompts_and_checks():
    def comp(**kw) -> CompletionRequest:
        return CompletionRequest.model_validate({"model": "m", **kw})

    assert comp(prompt="a").prompts() == ["a"]
    assert comp(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert comp(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert comp(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    assert comp(prompt="a").max_tokens == 16  # OpenAI's legacy default
    for kw, param in (({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"),
                      ({"prompt": "a", "best_of": 2}, "best_of"), ({"prompt": "a", "suffix": "z"}, "suffix")):
        with pytest.raises(APIError) as info:
            comp(**kw).check()
        assert info.value.param == param
    with pytest.raises(ValidationError):
        comp(prompt=[1, "a"])
    with pytest.raises(ValidationError):
        comp(prompt="a", logprobs=6)  # OpenAI's limit for completions is 5 (chat's top_logprobs: 20)
    assert comp(prompt="a", logprobs=5).logprobs == 5
    assert comp(prompt="a", echo=True, logprobs=2).prompt_logprobs == 2  # echoed tokens get log-probs too
    assert comp(prompt="a", logprobs=2).prompt_logprobs is None


def test_image_part_error_names_the_part_type():
    with pytest.raises(ValidationError) as info:
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "image_url", "image_url": {"url": "x"}}]}])
    errors = info.value.errors()
    assert len(errors) == 1 and "content part type 'image_url' is not supported" in errors[0]["msg"]

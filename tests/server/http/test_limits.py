"""The operator's request limits: each one a 400 naming its field, read from the app's own config."""

import asyncio

import httpx
import pytest

from xinserve.server.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from xinserve.server.app import create_app
from xinserve.server.config import LimitsSettings, parse_config
from xinserve.server.errors import APIError
from xinserve.server.http.limits import cap_max_tokens, check_chat, check_completion

LIMITS = LimitsSettings(max_messages=2, max_prompt_chars=10, max_stop_chars=5, max_n=2, max_tokens=8)


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def comp(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **kw})


def refused(check, body) -> tuple[str | None, str | None]:
    with pytest.raises(APIError) as info:
        check(body, LIMITS)
    assert info.value.status == 400
    return info.value.param, info.value.code


def test_requests_within_the_limits_pass():
    check_chat(chat(n=2, max_tokens=8, stop=["12345"] * 4,
                    messages=[{"role": "user", "content": "12345"}, {"role": "assistant", "content": "12345"}]),
               LIMITS)
    check_completion(comp(prompt=["12345", "12345"], n=2, max_tokens=8, stop="12345"), LIMITS)
    check_completion(comp(prompt=[[1] * 100]), LIMITS)  # token ids are not characters to tokenise
    check_completion(comp(), LIMITS)  # OpenAI's implicit max_tokens of 16 is capped later, not refused


@pytest.mark.parametrize(("kw", "expected"), [
    ({"messages": [{"role": "user", "content": "a"}] * 3}, ("messages", "array_above_max_length")),
    ({"messages": [{"role": "user", "content": "123456"}, {"role": "user", "content": "12345"}]},
     ("messages", "string_above_max_length")),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "12345678901"}]}]},
     ("messages", "string_above_max_length")),
    ({"stop": ["ok", "123456"]}, ("stop", "string_above_max_length")),
    ({"n": 3}, ("n", "integer_above_max_value")),
    ({"max_tokens": 9}, ("max_tokens", "integer_above_max_value")),
    ({"max_completion_tokens": 9}, ("max_completion_tokens", "integer_above_max_value")),
])
def test_chat_limits_name_the_field(kw, expected):
    assert refused(check_chat, chat(**kw)) == expected


@pytest.mark.parametrize(("kw", "expected"), [
    ({"prompt": "12345678901"}, ("prompt", "string_above_max_length")),
    ({"prompt": ["123456", "123456"]}, ("prompt", "string_above_max_length")),
    ({"stop": "123456"}, ("stop", "string_above_max_length")),
    ({"n": 3}, ("n", "integer_above_max_value")),
    ({"max_tokens": 9}, ("max_tokens", "integer_above_max_value")),
])
def test_completion_limits_name_the_field(kw, expected):
    assert refused(check_completion, comp(**kw)) == expected


def test_max_tokens_cap_bounds_the_default_budget_too():
    assert cap_max_tokens(2000, LIMITS) == 8  # no max_tokens asked: the rest of the context, capped
    assert cap_max_tokens(5, LIMITS) == 5
    assert cap_max_tokens(2000, LimitsSettings()) == 2000  # no cap by default


def test_defaults_are_documented_values():
    d = LimitsSettings()
    assert (d.max_body_bytes, d.max_messages, d.max_prompt_chars, d.max_stop_chars, d.max_n, d.max_tokens) == (
        8 * 1024 * 1024, 2048, 1_000_000, 256, 128, None)


def post(app, path: str, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post(path, json=body)

    return asyncio.run(go())


def test_each_app_enforces_its_own_config():
    """Checked before routing: the app's pools never load here, so a pass is the 503 for no worker."""
    models = [{"name": "m", "path": "/nonexistent", "workers": ["cpu"]}]
    strict = create_app(parse_config({"limits": {"max_stop_chars": 3, "max_n": 1}, "models": models}))
    default = create_app(parse_config({"models": models}))
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": "abcd"}
    r = post(strict, "/v1/chat/completions", chat_body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert post(default, "/v1/chat/completions", chat_body).status_code == 503
    r = post(strict, "/v1/completions", {"model": "m", "prompt": "hi", "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert post(default, "/v1/completions", {"model": "m", "prompt": "hi", "n": 2}).status_code == 503

"""Property tests of /v1/messages and /v1/messages/count_tokens against a live tiny-model server.

Bodies are valid (so the request really runs) or valid with one or two fields broken: junk of any
JSON type, unknown or misplaced content blocks, odd roles, huge text, out-of-range numbers. Pinned:
no request ever gets a 5xx; every error is Anthropic's shape (``{"type": "error", "error": {"type",
"message"}}``); a 200 is a whole message, or a stream of named events ending with ``message_stop``
(or an ``error`` event); afterwards the server still answers.
"""

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.server.conftest import SHORT_MAX_TOKENS

MODEL = "tiny"
MAX_TOKENS = SHORT_MAX_TOKENS  # the server's limits.max_tokens: every generation stays short
ERROR_TYPES = {"invalid_request_error", "authentication_error", "permission_error", "not_found_error",
               "request_too_large", "rate_limit_error", "api_error", "overloaded_error"}

FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(short_tiny_server):
    return short_tiny_server


texts = st.one_of(st.text(max_size=20), st.builds(lambda c, k: c * k, st.sampled_from("a \u00e9\U0001f600\x00"),
                                                  st.integers(0, 30_000)))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), texts)
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                    max_leaves=6)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
tool = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "get_time"]), "input_schema": st.just(SCHEMA)},
                             optional={"description": st.text(max_size=10)})
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
tool_use = st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.text(min_size=1, max_size=6),
                                  "name": st.sampled_from(["get_weather", "get_time"]),
                                  "input": st.dictionaries(st.text(max_size=5), scalars, max_size=2)})
tool_result = st.fixed_dictionaries(
    {"type": st.just("tool_result"), "tool_use_id": st.text(min_size=1, max_size=6)},
    optional={"content": st.text(max_size=20) | st.lists(text_block, max_size=2), "is_error": st.booleans()})
user = st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=40) | st.lists(
    st.one_of(text_block, tool_result), min_size=1, max_size=3)})
assistant = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.text(max_size=40) | st.lists(
    st.one_of(text_block, tool_use), min_size=1, max_size=3)})
conversation = st.lists(st.one_of(user, assistant), min_size=1, max_size=4)
odd_block = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["image", "document", "thinking", "hologram", ""]) | junk},
                          optional={"text": junk, "source": junk}),
    tool_use, tool_result, junk)
odd_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool"]) | junk},
    optional={"content": texts | st.lists(odd_block, max_size=3) | junk})

FIELDS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {  # name: (valid, broken)
    "model": (st.just(MODEL), st.sampled_from(["no-such-model", ""]) | junk),
    "messages": (conversation, st.lists(st.one_of(user, assistant, odd_message), max_size=4) | junk),
    "max_tokens": (st.integers(1, MAX_TOKENS), st.integers(-2, 10**6) | junk),
    "system": (st.text(max_size=20) | st.lists(text_block, max_size=2), st.lists(odd_block, max_size=2) | junk),
    "stop_sequences": (st.lists(st.text(min_size=1, max_size=4), max_size=4), st.lists(texts, max_size=6) | junk),
    "temperature": (st.floats(0, 1), st.floats(-1, 3) | junk),
    "top_p": (st.floats(0.01, 1), st.floats(-1, 2) | junk),
    "top_k": (st.integers(0, 5), st.integers(-3, 2**70) | junk),
    "metadata": (st.fixed_dictionaries({}, optional={"user_id": st.text(max_size=8)}), junk),
    "stream": (st.booleans(), junk),
    "tools": (st.lists(tool, max_size=2, unique_by=lambda t: t["name"]),
              st.lists(st.dictionaries(st.sampled_from(["name", "input_schema", "type"]), junk), max_size=2) | junk),
    "tool_choice": (st.fixed_dictionaries({"type": st.sampled_from(["auto", "none"])}),
                    st.fixed_dictionaries({"type": st.sampled_from(["any", "tool", "x"]) | junk},
                                          optional={"name": junk, "disable_parallel_tool_use": junk}) | junk),
    "output_config": (st.just({"format": {"type": "json_schema", "schema": SCHEMA}}), junk),
}
REQUIRED = ("model", "messages", "max_tokens")
# Bodies that once broke the server: a role of an unhashable type next to content blocks (a 500).
LIST_ROLE = {"model": MODEL, "max_tokens": 2, "messages": [{"role": ["user"], "content": [{"type": "text", "text": "x"}]}]}


@st.composite
def bodies(draw) -> dict[str, Any]:
    names = [n for n in FIELDS if n in REQUIRED or draw(st.booleans())]
    broken = set(draw(st.lists(st.sampled_from(list(FIELDS)), max_size=2)))
    body = {n: draw(FIELDS[n][1] if n in broken else FIELDS[n][0]) for n in names}
    for name in draw(st.lists(st.sampled_from(REQUIRED), max_size=1)):
        body.pop(name, None)  # a required field missing
    if body.get("output_config") and isinstance(body.get("tool_choice"), dict) and not broken:
        body.pop("output_config")  # not both grammars in a valid body
    return body


def _check_error(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] in ERROR_TYPES
    assert isinstance(error["error"]["message"], str) and error["error"]["message"]


@FUZZ
@given(body=bodies())
@example(body=LIST_ROLE)
def test_messages_never_5xx_and_errors_are_anthropics(http, body):
    if body.get("stream") is True:
        with http.stream("POST", "/v1/messages", json=body) as r:
            if r.status_code != 200:
                r.read()
                _check_error(r)
                return
            names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
        assert names[0] == "message_start" and names[-1] in ("message_stop", "error"), names
        return
    r = http.post("/v1/messages", json=body)
    if r.status_code != 200:
        _check_error(r)
        return
    message = r.json()
    assert message["type"] == "message" and message["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence",
                                                                       "tool_use")
    assert all(b["type"] in ("text", "tool_use") for b in message["content"])


@FUZZ
@given(body=bodies())
@example(body=LIST_ROLE)
def test_count_tokens_never_5xx(http, body):
    r = http.post("/v1/messages/count_tokens", json=body)
    if r.status_code != 200:
        _check_error(r)
        return
    assert isinstance(r.json()["input_tokens"], int)


@pytest.mark.parametrize("content", [b"", b"{", b"[1, 2]", b"null", b'"text"', b"[" * 100_000])
def test_malformed_bodies_are_anthropic_errors(http, content):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        _check_error(http.post(path, content=content, headers={"content-type": "application/json"}))


def test_after_the_fuzzing_the_server_answers(http):
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2
    assert json.loads(http.get("/health").text)["status"] == "ok"

"""Property tests of the HTTP API: several hundred generated requests against a live tiny-model server.

Chat and completion bodies are either valid (every field in range, so the request really runs) or
valid with one or two fields broken: out of range, of the wrong type, huge or empty, past 64 bits,
or a required one missing; unknown fields ride along. Raw bodies are bytes, broken JSON, JSON that
is not an object, nesting past the parser's limit, under various content types. Pinned: no request
ever gets a 5xx; every 4xx is OpenAI's error envelope; a 200 is a whole response (a stream ends with
``[DONE]``, any error in it an envelope frame); afterwards the server is idle and still answers.

The examples are derandomised, so a failure reproduces on every run; ``@example`` keeps the cases
that once broke the server.
"""

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import SHORT_MAX_TOKENS

MODEL = "tiny"
MAX_TOKENS = SHORT_MAX_TOKENS  # the server's limits.max_tokens: every generation stays short

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def server(short_tiny_server):
    return short_tiny_server


# ---------------------------------------------------------------- strategies

def _repeat(alphabet: str, sizes: st.SearchStrategy[int]) -> st.SearchStrategy[str]:
    """Long strings without paying hypothesis to draw each character."""
    return st.builds(lambda c, k: c * k, st.sampled_from(alphabet), sizes)


texts = st.one_of(st.text(max_size=20), _repeat("ab \u00e9\u4e2d\U0001f600\x00", st.integers(0, 30_000)))
# Integers past what the process boundary carries (msgpack: 64 bits), boundaries drawn on purpose.
big_ints = st.one_of(st.integers(-(2**70), 2**70),
                     st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**64)]))
scalars = st.one_of(st.none(), st.booleans(), big_ints, st.floats(allow_nan=False, allow_infinity=False), texts)
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                    max_leaves=6)


class Field:
    """One request field: values it may validly take, and edge values (mostly invalid) or junk."""

    def __init__(self, valid: st.SearchStrategy[Any], edge: st.SearchStrategy[Any] | None = None) -> None:
        self.valid = valid
        self.invalid = junk if edge is None else st.one_of(edge, junk)


unit = st.floats(0, 1, exclude_min=True)
stop_strings = st.text(min_size=1, max_size=8)
token_ids = st.lists(st.integers(0, 250), min_size=1, max_size=6)
bad_token_ids = st.lists(st.one_of(st.integers(-2, 600), big_ints), min_size=1, max_size=6)

SAMPLING = {
    "n": Field(st.integers(1, 2), st.integers(-1, 200) | big_ints),
    "temperature": Field(st.floats(0, 2), st.floats(-1, 3) | st.just(1e-300)),
    "top_p": Field(unit, st.floats(-0.5, 1.5)),
    "top_k": Field(st.integers(-1, 5), st.integers(-3, 5) | big_ints),
    "min_p": Field(st.floats(0, 1), st.floats(-1, 2)),
    "presence_penalty": Field(st.floats(-2, 2), st.floats(-3, 3)),
    "frequency_penalty": Field(st.floats(-2, 2), st.floats(-3, 3)),
    "repetition_penalty": Field(st.floats(0.1, 3), st.floats(-1, 0)),
    "seed": Field(st.integers(-(2**63), 2**63 - 1), big_ints),
    "stop": Field(stop_strings | st.lists(stop_strings, max_size=4), st.lists(texts, max_size=6)),
    "stop_token_ids": Field(token_ids, bad_token_ids),
    "min_tokens": Field(st.integers(0, 1), st.integers(-1, 8) | big_ints),  # valid: at most max_tokens
    "ignore_eos": Field(st.booleans()),
    "skip_special_tokens": Field(st.booleans()),
    "stream": Field(st.booleans()),
    "stream_options": Field(st.fixed_dictionaries({}, optional={"include_usage": st.booleans()})),
    "logit_bias": Field(st.just({}), st.dictionaries(st.integers(0, 600).map(str), st.floats(-100, 100),
                                                     max_size=3)),
    "user": Field(st.text(max_size=10), texts),
    "max_tokens": Field(st.integers(1, MAX_TOKENS), st.integers(-2, 10) | big_ints),
}

text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": st.text(max_size=40) | st.lists(text_part, min_size=1, max_size=2)})
odd_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool", "function", "wizard"]) | junk},
    optional={"content": texts | st.none() | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url", ""])}, optional={"text": junk}), max_size=3) | junk,
        "name": junk, "tool_call_id": junk,
        "tool_calls": st.lists(st.dictionaries(st.text(max_size=5), junk, max_size=2), max_size=2) | junk})
# Keyword arguments that apply_chat_template itself takes, as well as ones only a template reads.
template_kwargs = st.dictionaries(
    st.sampled_from(["return_dict", "tokenize", "add_generation_prompt", "continue_final_message",
                     "return_tensors", "padding", "truncation", "max_length", "documents", "tools",
                     "enable_thinking", "messages", "tokenizer_kwargs", "return_assistant_tokens_mask"]),
    junk, max_size=2)
unknown = Field(st.none(), junk)

CHAT_REQUIRED = {
    "model": Field(st.just(MODEL), st.sampled_from(["no-such-model", ""])),
    "messages": Field(st.lists(message, min_size=1, max_size=4),
                      st.lists(st.one_of(message, odd_message), max_size=4)),
}
CHAT = {
    **SAMPLING,
    "max_completion_tokens": Field(st.integers(1, MAX_TOKENS), st.integers(-1, 10)),
    "logprobs": Field(st.booleans()),
    "top_logprobs": Field(st.integers(0, 20), st.integers(-1, 22)),
    "tools": Field(st.just([]), st.lists(st.dictionaries(st.text(max_size=5), junk, max_size=2), max_size=2)),
    "tool_choice": Field(st.sampled_from(["auto", "none"])),
    "response_format": Field(st.just({"type": "text"}), st.fixed_dictionaries({"type": st.text(max_size=12)})),
    "add_generation_prompt": Field(st.booleans()),
    "chat_template_kwargs": Field(st.just({}), template_kwargs),
    "unknown_field": unknown,
}
COMPLETION_REQUIRED = {
    "model": CHAT_REQUIRED["model"],
    "prompt": Field(st.one_of(st.text(min_size=1, max_size=40), st.lists(st.text(max_size=20), min_size=1,
                                                                         max_size=2), token_ids),
                    st.one_of(texts, st.lists(texts, max_size=3), bad_token_ids, st.lists(bad_token_ids,
                                                                                           max_size=3))),
}
COMPLETION = {
    **SAMPLING,
    "echo": Field(st.booleans()),
    "logprobs": Field(st.integers(0, 5), st.integers(-1, 21)),
    "best_of": Field(st.just(1), st.integers(0, 3)),
    "suffix": Field(st.just(""), texts),
    "unknown_field": unknown,
}


@st.composite
def _mutated(draw: Any, required: dict[str, Field], optional: dict[str, Field]) -> dict[str, Any]:
    """A valid body with one or two fields made invalid (or a required one removed), so that the
    bad value is what the server meets, not hidden behind another field's 400."""
    body = draw(_valid(required, optional))
    fields = {**required, **optional}
    for key in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=2, unique=True)):
        if key in required and draw(st.booleans()):
            body.pop(key)
        else:
            body[key] = draw(fields[key].invalid)
    return body


def _valid(required: dict[str, Field], optional: dict[str, Field]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({k: f.valid for k, f in required.items()},
                                 optional={k: f.valid for k, f in optional.items()})


def requests(required: dict[str, Field], optional: dict[str, Field]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(_valid(required, optional), _mutated(required, optional))


chat_requests = requests(CHAT_REQUIRED, CHAT)
completion_requests = requests(COMPLETION_REQUIRED, COMPLETION)

raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    junk.map(lambda v: json.dumps(v).encode()),  # JSON, but rarely an object
    st.integers(1, 50_000).map(lambda depth: b"[" * depth + b"]" * depth),  # nesting past the parser's limit
    st.sampled_from([b"", b"{", b'{"model": "tiny", "messages": [', b"null", b'{"model": NaN}',
                     b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', b"\xff\xfe{}"]),
)
content_types = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", None,
                                 "multipart/form-data; boundary=x", "application/x-www-form-urlencoded"])


# ---------------------------------------------------------------- checks

def check_response(http: httpx.Client, schemas, path: str, content: bytes, content_type: str | None,
                   stream: bool) -> None:
    headers = {"content-type": content_type} if content_type else {}
    with http.stream("POST", path, content=content, headers=headers) as r:
        raw = r.read()
    event(f"status {r.status_code}")
    assert r.status_code < 500, (r.status_code, raw[:500], content[:300])
    if r.status_code >= 400:
        schemas.validate("ErrorResponse", json.loads(raw))
        return
    assert r.status_code == 200, (r.status_code, raw[:300])
    if not (stream and r.headers["content-type"].startswith("text/event-stream")):
        assert json.loads(raw)["choices"]
        return
    events = [line[5:].strip() for line in raw.decode().splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]", events[-3:]
    for data in events[:-1]:
        frame = json.loads(data)
        if "error" in frame:
            schemas.validate("ErrorResponse", frame)
            assert frame["error"]["type"] != "internal_server_error", frame


def post_json(http: httpx.Client, schemas, path: str, body: dict[str, Any]) -> None:
    # NaN never comes from the strategies; allow_nan=False keeps the JSON standard.
    check_response(http, schemas, path, json.dumps(body, allow_nan=False).encode(), "application/json",
                   body.get("stream") is True)


# ---------------------------------------------------------------- the properties

HI = [{"role": "user", "content": "hi"}]


@FUZZ
@given(body=chat_requests)
# Once 500s: integers over 64 bits failed the send to the worker (msgpack) after validation passed.
@example(body={"model": MODEL, "messages": HI, "stop_token_ids": [2**64]})
@example(body={"model": MODEL, "messages": HI, "top_k": 2**70})
@example(body={"model": MODEL, "messages": HI, "min_tokens": 2**64})
def test_chat_never_5xx_and_errors_are_envelopes(http, schemas, body):
    post_json(http, schemas, "/v1/chat/completions", body)


@FUZZ
@given(body=completion_requests)
@example(body={"model": MODEL, "prompt": "hi", "stop_token_ids": [2**64], "stream": True})
def test_completions_never_5xx_and_errors_are_envelopes(http, schemas, body):
    post_json(http, schemas, "/v1/completions", body)


@settings(FUZZ, max_examples=100)
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), content=raw_bodies,
       content_type=content_types)
def test_malformed_bodies_are_4xx_envelopes(http, schemas, path, content, content_type):
    check_response(http, schemas, path, content, content_type, stream=False)


def engine_gauges(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in ("xinserve:num_requests_running", "xinserve:num_requests_waiting")}


def test_after_the_fuzzing_the_server_is_idle_and_answers(server, http):
    r = http.post("/v1/chat/completions",
                  json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    health = http.get("/health").json()
    assert health["status"] == "ok"
    assert [w["load"] for w in health["workers"]] == [0]  # no request left counted against the worker
    assert engine_gauges(server) == {"xinserve:num_requests_running": 0, "xinserve:num_requests_waiting": 0}

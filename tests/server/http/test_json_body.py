"""The JSON body's bounds, read from its bytes: nesting depth and valid Unicode text."""

import json
import time

import pytest

from xinserve.server.http.json_body import MAX_JSON_DEPTH, check_json_body, nested_deeper_than


def nest(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"a":' * (depth // 2) + b"[" * (depth - depth // 2) + inner + b"]" * (depth - depth // 2) + b"}" * (
        depth // 2)


@pytest.mark.parametrize("depth", [0, 1, 2, 7, 63, 64])
def test_nesting_up_to_the_limit_passes(depth):
    assert not nested_deeper_than(nest(depth), 64)
    assert check_json_body(b'{"x": ' + nest(depth - 1) + b"}") is None if depth else True


@pytest.mark.parametrize("depth", [65, 66, 500, 100_000])
def test_nesting_past_the_limit_is_a_400(depth):
    assert nested_deeper_than(nest(depth), 64)
    err = check_json_body(nest(depth))
    assert err is not None and err.status == 400 and str(MAX_JSON_DEPTH) in err.message


@pytest.mark.parametrize("text", [
    '"[[[[[[[[[["', '"\\"[[[[[[[[["', '"\\\\\\"[[[[[[[[["', '"a\\\\", "u": "[[[[[[[[[[["', '"\\u005b[[[[[[[[[["',
])
def test_brackets_inside_strings_do_not_count(text):
    body = f'{{"s": {text}, "t": [[1]]}}'.encode()
    json.loads(body)  # each case is valid JSON
    assert not nested_deeper_than(body, 3)
    assert nested_deeper_than(body, 2)


def test_malformed_nesting_is_left_to_the_parser():
    assert not nested_deeper_than(b"[" * 1000, 64)
    assert not nested_deeper_than(b"]" * 1000 + b"[" * 1000, 64)


@pytest.mark.parametrize(("body", "param"), [
    (b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
    (b'{"messages": [{"content": "ok"}, {"content": "\\udc00b"}]}', "messages.1.content"),
    (b'{"prompt": ["x", "\\ud83dx"]}', "prompt.1"),
    (b'{"prompt": "a\xed\xa0\x80"}', "prompt"),  # a surrogate encoded as UTF-8: Python's parser takes it
    (b'{"kw": {"\\udfff": 1}}', "kw.\\udfff"),  # the key itself, escaped: the error echoes it
])
def test_an_unpaired_surrogate_is_a_400_naming_its_field(body, param):
    err = check_json_body(body)
    assert err is not None and (err.status, err.param) == (400, param)
    json.dumps(err.message, ensure_ascii=False).encode()  # the error itself is valid Unicode


@pytest.mark.parametrize("body", [
    b'{"c": "\\ud83d\\ude00 \\\\ud800"}',  # a pair, and an escaped backslash before "ud800"
    "{\"c\": \"\u00e9\U0001f600\x00\"}".encode(), b'{"c": "a\\u0000b"}', b"not json \\ud800", b"\xff\xfe{}",
])
def test_valid_text_and_malformed_bodies_pass(body):
    assert check_json_body(body) is None


def test_an_8_mb_body_is_checked_in_well_under_a_second():
    # A regular expression over the strings took 2.3 s for the first (Python's json writes emoji as
    # escaped surrogate pairs) and 0.5 s for the second. CPU time: a busy machine's wall clock is not.
    bodies = [json.dumps({"messages": [{"content": "\U0001f600 [\"x\"]" * 350_000}]}).encode(),
              json.dumps({"messages": [{"content": "x" * 8_000_000}]}).encode(),
              json.dumps({"prompt": list(range(1_000_000))}).encode(),
              json.dumps({"messages": [{"content": "a"}] * 400_000}).encode()]
    for body in bodies:
        start = time.process_time()
        assert check_json_body(body) is None
        assert time.process_time() - start < 1.0, len(body)

"""Streamed bodies are byte-identical to the ones recorded before the per-token frame templates
(tests/fixtures/stream_golden.json: chat with usage, n=2, log-probs, stop strings, tool calls;
completions with echo and log-probs; Anthropic's and the Responses API's streams)."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.server.api.stream_golden_requests import REQUESTS, body_bytes

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "stream_golden.json"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("name, path, body, text", REQUESTS, ids=[r[0] for r in REQUESTS])
def test_a_streamed_body_is_byte_identical_to_the_recorded_one(tok, name, path, body, text):
    assert body_bytes(tok, path, body, text).decode() == json.loads(GOLDEN.read_text())[name]

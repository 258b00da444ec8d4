"""A multi-head latent attention model with the DSA indexer (a tiny random GLM-5) served through the
API: the checks tests/server/api/openai/test_api.py makes of a completion and of a chat stream, and the served
greedy text equals the offline engine's (itself equal to transformers', tests/engines/models/test_mla.py)."""


import httpx
import pytest

from tests.server.conftest import MLA_MODEL, check_chat_stream, sse_events
from xinserve.engines import LLM, SamplingParams

MODEL = MLA_MODEL  # one of the models of the shared assorted_server (tests/server/conftest.py)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("glm_moe_dsa")


@pytest.fixture(scope="module")
def http(assorted_server):
    with httpx.Client(base_url=assorted_server.url, timeout=120) as client:
        yield client


def test_completion_matches_the_offline_engine(http, schemas, model_dir):
    # longer than index_topk (12 tokens), so the indexer drops positions while serving
    prompt = "The morning fog rolled slowly over the harbour, and the fishing boats waited at their moorings"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    schemas.validate("CreateCompletionResponse", body)
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 6
    assert body["usage"]["prompt_tokens"] > 12
    offline = LLM(model_dir, num_kv_blocks=64, block_size=16).generate([prompt], SamplingParams(temperature=0,
                                                                                                max_tokens=6))
    assert body["choices"][0]["text"] == offline[0].text


def test_chat_stream_chunks(http, schemas):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the river and the sea."}],
            "max_tokens": 6, "temperature": 0}
    with http.stream("POST", "/v1/chat/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    streamed = check_chat_stream(events, schemas, completion_tokens=6)
    whole = http.post("/v1/chat/completions", json=body).json()
    schemas.validate("CreateChatCompletionResponse", whole)
    assert streamed == whole["choices"][0]["message"]["content"]

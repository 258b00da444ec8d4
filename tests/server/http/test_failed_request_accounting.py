"""A request that fails after it was routed and started keeps its log fields and its key's usage.

The app runs in-process with one stand-in worker that streams a token or two and then fails as a
dead or hung worker does (a 503 after tokens, which is not retried), or never answers (the
request times out). The request log line must still name the model, the worker and the key, and
the key's counters must count the request, its prompt and the tokens generated before the end.
"""

import asyncio
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.stand_in_worker import StandInWorker, auth, make_app
from xinserve.server.worker.messages import RequestError

AUTH = auth("team-a")


def run(app, body: dict) -> tuple[httpx.Response, dict[str, float]]:
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=AUTH) as c:
            r = await c.post("/v1/chat/completions", json=body)
            metrics = (await c.get("/metrics")).text
        return r, metrics

    r, text = asyncio.run(go())
    counters = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name.startswith("xinserve:api_key_") and s.name.endswith("_total")
                and s.labels == {"key_name": "team-a", "model_name": "m"}}
    return r, counters


def request_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records
             if r.name == "xinserve.request" and "POST /v1/chat/completions" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 20}


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_lost_after_tokens_keeps_the_log_fields_and_counts_the_usage(tiny_tokenizer, caplog, stream):
    app = make_app(tiny_tokenizer, StandInWorker(2, RequestError("worker cpu#7 of m is unresponsive",
                                                                  unavailable=True, retryable=True)))
    caplog.set_level(logging.INFO, logger="xinserve.request")
    r, counters = run(app, {**CHAT, "stream": stream})
    prompt_tokens = int(request_line(caplog).split("prompt_tokens=")[1].split()[0])
    assert prompt_tokens > 0
    # Tokens and the failure arrive together: a stream fails before its first frame, with a status.
    assert r.status_code == 503 and "unresponsive" in r.json()["error"]["message"]
    line = request_line(caplog)
    for field in ("key=team-a", "model=m", "worker=cpu#7", "completion_tokens=2", "outcome=error 503"):
        assert field in line, line
    assert counters == {
        "xinserve:api_key_requests_total": 1.0,
        "xinserve:api_key_prompt_tokens_total": float(prompt_tokens),
        "xinserve:api_key_generation_tokens_total": 2.0,
    }


def test_a_timed_out_request_keeps_the_log_fields_and_counts_the_usage(tiny_tokenizer, caplog):
    app = make_app(tiny_tokenizer, StandInWorker(1, None), {"request_timeout_s": 0.2})  # a token, then silence
    caplog.set_level(logging.INFO, logger="xinserve.request")
    r, counters = run(app, CHAT)
    assert r.status_code == 504
    line = request_line(caplog)
    for field in ("key=team-a", "model=m", "worker=cpu#7", "completion_tokens=1", "outcome=error 504"):
        assert field in line, line
    assert counters["xinserve:api_key_requests_total"] == 1
    assert counters["xinserve:api_key_prompt_tokens_total"] > 0
    assert counters["xinserve:api_key_generation_tokens_total"] == 1

"""A config with one model on two CPU workers, a broken model and a broken one with a fallback.

Pins: least-loaded routing over both workers, 429 when every queue is full, 503 for a model with no
ready worker, the fallback chain, /health's 503 detail (a model without a fallback is down, so the
server is "unavailable"; the rescued one counts as answering), the mid-stream error frame (a
request running past ``request_timeout_s``), and a killed worker coming back.
"""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

TIMEOUT_S = 3.0  # long enough to open four streams and probe them, short of their 8,000 tokens
# Streams that outlast the timeout on any machine: 2,000 tokens (the default tiny model's limit) finished
# within 3 s on a fast 2-core machine, and that stream ended without the error frame the test waits for.
STREAM_TOKENS = 8000


@pytest.fixture(scope="module")
def server(start_server, tiny_models, tmp_path_factory):
    model = tiny_models("llama", max_position_embeddings=STREAM_TOKENS + 192)
    config = {
        "server": {"request_timeout_s": TIMEOUT_S},
        "models": [
            # Two sequences per worker and no waiting room: the fifth concurrent request is a 429.
            {"name": "tiny2", "path": str(model), "workers": ["cpu", "cpu"], "max_num_seqs": 2,
             "max_waiting_requests": 0, "cpu_threads": 1},
            {"name": "broken", "path": "/nonexistent/model", "workers": ["cpu"]},
            {"name": "rescued", "path": "/nonexistent/other", "workers": ["cpu"], "fallback": ["tiny2"]},
        ],
    }
    path = tmp_path_factory.mktemp("multi") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    srv = start_server(["--config", str(path)])
    srv.wait_ready(expect_status=503)
    yield srv
    srv.stop()


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def loads(server) -> dict[str, int]:
    return {w["worker"]: w["load"] for w in health(server)["workers"] if w["model"] == "tiny2"}


def success_by_worker(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "xinserve:request_success_total" and s.labels["model_name"] == "tiny2":
                out[s.labels["worker"]] = out.get(s.labels["worker"], 0) + s.value
    return out


def short_chat(server, model: str = "tiny2") -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def test_health_reports_the_broken_model(server):
    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "unavailable"
    states = {(w["model"], w["worker"]): w["state"] for w in body["workers"]}
    assert states == {("tiny2", "cpu#0"): "ready", ("tiny2", "cpu#1"): "ready",
                      ("broken", "cpu"): "failed", ("rescued", "cpu"): "failed"}
    assert body["models"] == {"tiny2": "ready", "broken": "unavailable", "rescued": "fallback"}
    broken = next(w for w in body["workers"] if w["model"] == "broken")
    assert "/nonexistent/model" in broken["last_error"]


def test_unavailable_model_is_503_and_fallback_serves(server, schemas):
    r = short_chat(server, "broken")
    assert r.status_code == 503
    schemas.validate("ErrorResponse", r.json())
    r = short_chat(server, "rescued")
    assert r.status_code == 200
    schemas.validate("CreateChatCompletionResponse", r.json())
    assert r.json()["model"] == "tiny2"  # the model that actually answered


def test_sequential_requests_alternate_workers(server):
    before = success_by_worker(server)
    for _ in range(4):
        assert short_chat(server).status_code == 200
    after = success_by_worker(server)
    assert {w: after.get(w, 0) - before.get(w, 0) for w in ("cpu#0", "cpu#1")} == {"cpu#0": 2, "cpu#1": 2}


async def _open_streams(server, count: int):
    client = httpx.AsyncClient(base_url=server.url, timeout=60)
    body = {"model": "tiny2", "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    streams = []
    for _ in range(count):
        request = client.build_request("POST", "/v1/chat/completions", json=body)
        response = await client.send(request, stream=True)
        assert response.status_code == 200
        lines = response.aiter_lines()
        while not (await anext(lines)).startswith("data:"):
            pass
        streams.append((response, lines))
    return client, streams


def test_concurrent_load_spreads_then_429_then_error_frame(server, schemas):
    async def scenario():
        client, streams = await _open_streams(server, 4)
        try:
            spread = await asyncio.to_thread(loads, server)
            overflow = await asyncio.to_thread(short_chat, server)
            # Each stream now runs into the request timeout: an error frame, then [DONE].
            tails = []
            for _response, lines in streams:
                tail = [line[5:].strip() async for line in lines if line.startswith("data:")]
                tails.append(tail)
        finally:
            for response, _ in streams:
                await response.aclose()
            await client.aclose()
        return spread, overflow, tails

    start = time.monotonic()
    spread, overflow, tails = asyncio.run(scenario())
    assert spread == {"cpu#0": 2, "cpu#1": 2}
    assert overflow.status_code == 429
    schemas.validate("ErrorResponse", overflow.json())
    assert overflow.json()["error"]["type"] == "rate_limit_error"
    for tail in tails:
        assert tail[-1] == "[DONE]"
        error = json.loads(tail[-2])
        schemas.validate("ErrorResponse", error)
        assert error["error"]["code"] == "timeout"
        for frame in tail[:-2]:
            schemas.validate("CreateChatCompletionStreamResponse", json.loads(frame))
    assert time.monotonic() - start < 30
    # Timed-out requests were aborted in their workers: the load drains back to zero.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and loads(server) != {"cpu#0": 0, "cpu#1": 0}:
        time.sleep(0.2)
    assert loads(server) == {"cpu#0": 0, "cpu#1": 0}
    assert short_chat(server).status_code == 200


def test_dead_worker_is_reported_then_restarted(server):
    # Destructive, so it runs last: kill one worker outright, as an OOM killer would.
    victim = next(w for w in health(server)["workers"] if w["worker"] == "cpu#1")
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        body = health(server)
        dead = next(w for w in body["workers"] if w["worker"] == "cpu#1")
        if dead["state"] != "ready":
            break
        time.sleep(0.1)
    assert dead["state"] in ("dead", "starting") and body["models"]["tiny2"] == "degraded"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        back = next(w for w in health(server)["workers"] if w["worker"] == "cpu#1")
        if back["state"] == "ready":
            break
        time.sleep(0.2)
    assert back["state"] == "ready" and back["restarts"] == 1 and back["pid"] != victim["pid"]
    assert back["last_error"].endswith("code -9")  # why it was restarted stays visible
    assert health(server)["models"]["tiny2"] == "ready"
    before = success_by_worker(server)
    for _ in range(4):
        assert short_chat(server).status_code == 200
    after = success_by_worker(server)
    assert {w: after.get(w, 0) - before.get(w, 0) for w in ("cpu#0", "cpu#1")} == {"cpu#0": 2, "cpu#1": 2}

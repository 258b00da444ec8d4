"""Graceful shutdown: SIGTERM drains instead of cutting streams, and the server exits 0.

Two servers, because the two outcomes need two ``shutdown_timeout_s``: one long enough for the
running stream to finish (it must end normally with [DONE]), one shorter than the stream (it must
end with an error frame, then [DONE]).
"""

import json
import os
import signal
import time

import httpx
import pytest
import yaml

NO_CUT = "ASGI callable returned without completing response"


def start(start_server, tiny_model_dir, tmp_path_factory, shutdown_timeout_s: float):
    config = {
        "server": {"shutdown_timeout_s": shutdown_timeout_s},
        "models": [{"name": "tiny", "path": str(tiny_model_dir), "workers": ["cpu"], "cpu_threads": 1}],
    }
    path = tmp_path_factory.mktemp("shutdown") / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    srv = start_server(["--config", str(path)])
    body = srv.wait_ready()
    srv.worker_pid = body["workers"][0]["pid"]
    return srv


def chat(max_tokens: int, n: int = 1, stream: bool = True) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream, "n": n}


def data_lines(lines) -> list[str]:
    return [line[5:].strip() for line in lines if line.startswith("data:")]


def wait_draining(srv) -> httpx.Response:
    deadline = time.monotonic() + 10
    while True:
        r = httpx.get(f"{srv.url}/health", timeout=5)
        if r.json()["status"] == "draining" or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.slow
def test_sigterm_lets_a_running_stream_finish_and_refuses_new_requests(
    start_server, tiny_model_dir, tmp_path_factory, schemas
):
    srv = start(start_server, tiny_model_dir, tmp_path_factory, shutdown_timeout_s=120)
    with httpx.Client(base_url=srv.url, timeout=120) as client, \
            client.stream("POST", "/v1/chat/completions", json=chat(1500)) as r:
        lines = r.iter_lines()
        head = [next(lines) for _ in range(4)]  # the role frame and the first tokens are out
        srv.proc.send_signal(signal.SIGTERM)
        health = wait_draining(srv)
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        assert httpx.get(f"{srv.url}/health/live", timeout=5).status_code == 200
        refused = httpx.post(f"{srv.url}/v1/chat/completions", json=chat(4, stream=False), timeout=10)
        rest = data_lines(lines)
    assert refused.status_code == 503
    schemas.validate("ErrorResponse", refused.json())
    assert refused.json()["error"]["code"] == "shutting_down"
    assert rest[-1] == "[DONE]"
    frames = [json.loads(x) for x in data_lines(head) + rest[:-1]]
    for frame in frames:
        schemas.validate("CreateChatCompletionStreamResponse", frame)
    assert frames[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(f["choices"][0]["delta"].get("content", "")) > 0 for f in frames) > 1
    assert srv.proc.wait(60) == 0
    assert_gone(srv.worker_pid)
    assert NO_CUT not in srv.log()


@pytest.mark.slow
def test_a_stream_longer_than_the_shutdown_timeout_ends_with_an_error_frame(
    start_server, tiny_model_dir, tmp_path_factory, schemas
):
    srv = start(start_server, tiny_model_dir, tmp_path_factory, shutdown_timeout_s=1)
    # Four choices of 2,000 tokens: thousands of steps, far longer than the 1 s allowed.
    with httpx.Client(base_url=srv.url, timeout=120) as client, \
            client.stream("POST", "/v1/chat/completions", json=chat(2000, n=4)) as r:
        lines = r.iter_lines()
        head = [next(lines) for _ in range(8)]
        srv.proc.send_signal(signal.SIGTERM)
        rest = data_lines(lines)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])
    schemas.validate("ErrorResponse", error)
    assert error["error"]["type"] == "service_unavailable_error"
    assert "shutting down" in error["error"]["message"]
    for frame in data_lines(head) + rest[:-2]:
        schemas.validate("CreateChatCompletionStreamResponse", json.loads(frame))
    assert srv.proc.wait(60) == 0
    assert_gone(srv.worker_pid)
    assert NO_CUT not in srv.log()

"""A worker that stops answering (SIGSTOP stands in for a wedged driver call or a deadlocked
collective) is noticed by its silence: after ``heartbeat_timeout_s`` it is "unresponsive" (routed
around; requests it held with no token run elsewhere, a stream it was generating ends with an error
frame), after as long again it is killed and restarted. A worker that resumes in between is ready
again, and a busy worker is never taken for a silent one.
"""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import first_tails, open_stream, serve_config, wait_for

HEARTBEAT_TIMEOUT_S = 2.0

pytestmark = pytest.mark.slow  # a server of its own; workers stopped and restarted


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, tmp_path_factory):
    model = {"path": str(tiny_model_dir), "cpu_threads": 1}
    config = {
        "server": {"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S},
        "models": [{"name": "pair", "workers": ["cpu", "cpu"], **model}, {"name": "solo", "workers": ["cpu"], **model}],
    }
    srv = serve_config(start_server, tmp_path_factory.mktemp("hung"), config)
    yield srv
    srv.stop()


def health(server) -> httpx.Response:
    return httpx.get(f"{server.url}/health", timeout=10)


def worker(server, model: str, label: str) -> dict:
    return next(w for w in health(server).json()["workers"] if w["model"] == model and w["worker"] == label)


def chat_body(model: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "tell me a story"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def chat(server, model: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=chat_body(model, max_tokens), timeout=60)


def back_to_ok(server, model: str, label: str, restarts: int) -> dict:
    assert wait_for(lambda: health(server).json()["status"] == "ok", timeout=90), health(server).json()
    info = worker(server, model, label)
    assert info["state"] == "ready" and info["restarts"] == restarts
    return info


def test_a_stopped_worker_is_routed_around_then_killed_and_restarted(server, schemas):
    victim = worker(server, "pair", "cpu#1")
    assert victim["restarts"] == 0

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            streams = [await open_stream(client, chat_body("pair", 2000, stream=True)) for _ in range(2)]  # one each
            os.kill(victim["pid"], signal.SIGSTOP)
            # Until its silence is noticed it still looks ready: some of these are routed to it.
            burst = [asyncio.ensure_future(client.post("/v1/chat/completions", json=chat_body("pair", 16)))
                     for _ in range(6)]
            held = await asyncio.to_thread(wait_for, lambda: worker(server, "pair", "cpu#1")["load"] >= 2, 10)
            assert held, "no request was routed to the stopped worker"
            noticed = await asyncio.to_thread(
                wait_for, lambda: worker(server, "pair", "cpu#1")["state"] == "unresponsive", 10)
            assert noticed, worker(server, "pair", "cpu#1")
            status = await asyncio.to_thread(health, server)
            # New requests go to the other worker meanwhile.
            during = await client.post("/v1/chat/completions", json=chat_body("pair", 4))
            return status, during, await first_tails(streams), await asyncio.gather(*burst)

    status, during, ended, answers = asyncio.run(scenario())
    assert status.status_code == 200
    body = status.json()
    assert body["status"] == "degraded" and body["models"]["pair"] == "degraded"
    assert during.status_code == 200
    # The requests it held that had no token yet were retried on cpu#0 and succeeded.
    assert [r.status_code for r in answers] == [200] * 6
    assert all(r.json()["usage"]["completion_tokens"] == 16 for r in answers)
    assert server.log().count("unresponsive; retrying on cpu#0") >= 1
    # The stream it was generating: an error frame, then [DONE].
    assert len(ended) == 1
    tail = ended[0]
    assert tail[-1] == "[DONE]"
    error = json.loads(tail[-2])
    schemas.validate("ErrorResponse", error)
    assert "unresponsive" in error["error"]["message"]
    # Killed (SIGTERM would never reach a stopped process) and restarted.
    back = back_to_ok(server, "pair", "cpu#1", restarts=1)
    assert back["pid"] != victim["pid"]
    assert "unresponsive for" in server.log()
    assert chat(server, "pair").status_code == 200


def test_a_single_worker_model_is_unavailable_until_its_worker_is_restarted(server):
    victim = worker(server, "solo", "cpu")
    os.kill(victim["pid"], signal.SIGSTOP)
    assert wait_for(lambda: health(server).json()["models"]["solo"] == "unavailable", timeout=10)
    r = health(server)
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    refused = chat(server, "solo")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_unavailable"
    back = back_to_ok(server, "solo", "cpu", restarts=victim["restarts"] + 1)
    assert back["pid"] != victim["pid"]
    assert chat(server, "solo").status_code == 200


def test_a_worker_that_resumes_in_time_is_ready_again(server):
    victim = worker(server, "pair", "cpu#0")
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        noticed = wait_for(lambda: worker(server, "pair", "cpu#0")["state"] == "unresponsive", timeout=10,
                           interval=0.05)
    finally:
        os.kill(victim["pid"], signal.SIGCONT)  # within the second timeout: before the kill
    assert noticed
    assert wait_for(lambda: worker(server, "pair", "cpu#0")["state"] == "ready", timeout=5)
    info = back_to_ok(server, "pair", "cpu#0", restarts=victim["restarts"])
    assert info["pid"] == victim["pid"]
    assert chat(server, "pair").status_code == 200


def test_a_busy_worker_is_never_unresponsive(server):
    before = {(w["model"], w["worker"]): w["restarts"] for w in health(server).json()["workers"]}
    states: set[str] = set()

    async def scenario() -> list[httpx.Response]:
        answers: list[httpx.Response] = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            # Longer than both deadlines together, on a worker that never idles meanwhile: rounds of work
            # until that long has passed (a fast machine ends one round well within a deadline).
            start = time.monotonic()
            while time.monotonic() - start < 2 * HEARTBEAT_TIMEOUT_S + 1:
                work = [asyncio.ensure_future(client.post("/v1/chat/completions", json=chat_body("solo", 1500)))
                        for _ in range(4)]
                while not all(task.done() for task in work):
                    states.add((await client.get("/health")).json()["models"]["solo"])
                    await asyncio.sleep(0.2)
                answers += await asyncio.gather(*work)
        return answers

    start = time.monotonic()
    answers = asyncio.run(scenario())
    took = time.monotonic() - start
    assert answers and [r.status_code for r in answers] == [200] * len(answers)
    assert states == {"ready"}
    after = {(w["model"], w["worker"]): w["restarts"] for w in health(server).json()["workers"]}
    assert after == before
    assert took > HEARTBEAT_TIMEOUT_S, f"the generation took {took:.1f}s: too short to prove anything"

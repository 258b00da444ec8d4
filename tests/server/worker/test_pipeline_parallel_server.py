"""The server with ``--pipeline-parallel-size 2`` on the CPU: 12 concurrent streams answer as one
device does, /health shows each rank's stage and layers, and a killed stage fails the replica within
5 s, after which the group comes back."""

import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import concurrent_greedy_chats
from tests.server.worker.test_tensor_parallel_server import chat_ids, health

MODEL = "tiny"

pytestmark = pytest.mark.slow  # a two-stage server of its own


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    srv = start_server(["--model", str(tiny_model_dir), "--served-model-name", MODEL, "--device", "cpu",
                        "--pipeline-parallel-size", "2", "--num-kv-blocks", "128"])
    srv.wait_ready()
    yield srv
    srv.stop()


def test_twelve_streams_answer_as_one_device_and_health_shows_the_stages(server, tiny_model_dir):
    from xinserve.engines import LLM, SamplingParams

    (worker,) = health(server)["workers"]
    assert [(r["rank"], r["role"]["pp_stage"], r["role"]["layers"], r["state"]) for r in worker["ranks"]] == [
        (0, 0, "0-0", "ready"), (1, 1, "1-1", "ready")]
    prompts = [f"Story number {i}: the {['river', 'library', 'bread', 'harbour'][i % 4]}" for i in range(12)]
    max_tokens = [4 + i % 9 for i in range(12)]
    results = concurrent_greedy_chats(server.url, "x", MODEL, prompts, max_tokens, timeout=120)
    with LLM(tiny_model_dir, num_kv_blocks=128) as offline:
        expected = offline.generate([chat_ids(offline, p) for p in prompts],
                                    [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
    for (text, usage, reason), ref in zip(results, expected):
        assert (text, usage, reason) == (ref.text, len(ref.token_ids), ref.finish_reason)


def test_a_killed_stage_fails_the_replica_within_5s_and_it_comes_back(server):
    (worker,) = health(server)["workers"]
    os.kill(worker["ranks"][1]["pid"], signal.SIGKILL)
    killed, deadline = time.monotonic(), time.monotonic() + 5
    while (w := health(server)["workers"][0])["state"] == "ready" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w["state"] in ("dead", "starting") and time.monotonic() - killed < 5
    assert "rank 1 of the group" in w["last_error"]
    server.wait_ready(timeout=120)
    (worker,) = health(server)["workers"]
    assert worker["restarts"] == 1 and worker["ranks"][1]["pid"] != w["ranks"][1]["pid"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200

"""Two xinserve replicas behind the real SGLang model gateway (``sglang-router``, a Rust binary from
PyPI): it discovers the model and its tokenizer from the workers, routes chats to both under the
``cache_aware`` and ``power_of_two`` policies, and drops a killed replica on its health check while
traffic continues on the other. No mocks: real processes on local ports."""

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ServerProcess, free_port, wait_for

ROUTER = Path(sys.executable).with_name("sglang-router")

pytestmark = pytest.mark.slow  # two servers and the gateway


class Gateway:
    """A running ``sglang-router launch``; stopped by ``stop()``."""

    def __init__(self, workers: list[ServerProcess], policy: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        assert ROUTER.is_file(), f"{ROUTER} is missing: pip install sglang-router (the test extra has it)"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(ROUTER), "launch", "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
                 "--worker-urls", *(w.url for w in workers),
                 # As quick as the gateway allows: a check a second, one failure marks a worker down.
                 "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                 # cache_aware: any difference in requests in flight counts as imbalance (the
                 # default, 64, needs more traffic than a test sends to ever use the second replica).
                 "--balance-abs-threshold", "0",
                 "--health-check-timeout-secs", "2", "--log-level", "info",
                 # its metrics listener on a port of its own: the default (29000) is taken by any other gateway
                 # running at the same time (another test worker's), and the gateway panics on start
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                stdout=out, stderr=subprocess.STDOUT,
            )

    def workers(self) -> list[dict]:
        assert self.proc.poll() is None, f"sglang-router exited:\n{self.log_path.read_text()[-3000:]}"
        try:
            return httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]
        except httpx.HTTPError:
            return []

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def replicas(start_server, tiny_model_dir) -> list[ServerProcess]:
    # A small fixed KV pool: no memory profiling at start.
    args = ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--cpu-threads", "1", "--num-kv-blocks", "64",
            "--max-model-len", "256"]
    servers = [start_server(args) for _ in range(2)]
    for srv in servers:  # both load at the same time, on the same cores
        srv.wait_ready(timeout=300)
    return servers


@pytest.fixture
def gateway(replicas, tmp_path) -> Iterator[Callable[[str], Gateway]]:
    started: list[Gateway] = []

    def start(policy: str) -> Gateway:
        gw = Gateway(replicas, policy, tmp_path / f"router-{policy}.log")
        started.append(gw)
        # Registered once discovery has named the model (before the fix: "unknown") on both workers.
        registered = wait_for(lambda: [w["model_id"] for w in gw.workers() if w["is_healthy"]] == ["tiny"] * 2,
                              timeout=60, interval=0.2)
        assert registered, f"workers: {gw.workers()}\n{gw.log_path.read_text()[-3000:]}"
        return gw

    yield start
    for gw in started:
        gw.stop()


def chat(client: httpx.Client, prompt: str) -> str:
    """The completion's id (each replica logs the ids it served)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def concurrent_chats(url: str, prompts: list[str]) -> list[str]:
    with httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(partial(chat, client), prompts))


def served_by(replicas: list[ServerProcess], completion_id: str) -> int:
    """Which replica served the completion (its request log line names the id)."""
    found = wait_for(lambda: [i for i, r in enumerate(replicas) if f"id={completion_id} " in r.log()], timeout=10)
    assert len(found) == 1, (completion_id, found)
    return found[0]


def test_worker_info_endpoints_describe_the_model_in_sglangs_shapes(replicas, tiny_model_dir):
    srv = replicas[0]
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{srv.url}{path}", timeout=10).json()
        assert info["served_model_name"] == "tiny" and info["dp_size"] == 1
        assert Path(info["model_path"]) == tiny_model_dir and info["max_total_tokens"] > 0
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(f"{srv.url}{path}", timeout=10).json()
        assert info["architectures"] == ["LlamaForCausalLM"] and info["model_type"] == "llama"
        assert info["is_generation"] is True and Path(info["tokenizer_path"]) == tiny_model_dir
    (load,) = httpx.get(f"{srv.url}/get_load", timeout=10).json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_cache_aware_gateway_lists_the_model_registers_its_tokenizer_and_keeps_prefixes_on_a_replica(
        gateway, replicas):
    gw = gateway("cache_aware")
    with httpx.Client(base_url=gw.url, timeout=60) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
        (tokenizer,) = client.get("/v1/tokenizers").json()["tokenizers"]
        assert tokenizer["name"] == "tiny" and tokenizer["vocab_size"] > 0
    # At once, distinct prompts spread over both replicas (balance_abs_threshold 0: the less loaded one).
    prompts = [f"{c * 3} a distinct request about topic {c}" for c in "abcdef"]
    first = [served_by(replicas, i) for i in concurrent_chats(gw.url, prompts)]
    assert set(first) == {0, 1}, first
    # One at a time (equal load), a prompt goes back to the replica whose tree holds it, even to the
    # second replica, which load balancing alone would not pick.
    with httpx.Client(base_url=gw.url, timeout=60) as client:
        for replica in (0, 1):
            prompt = prompts[first.index(replica)]
            assert served_by(replicas, chat(client, prompt)) == replica, prompt


def test_power_of_two_gateway_routes_to_both_replicas(gateway, replicas):
    gw = gateway("power_of_two")
    ids = concurrent_chats(gw.url, [f"question {i}" for i in range(6)])
    assert {served_by(replicas, i) for i in ids} == {0, 1}


def test_a_killed_replica_is_dropped_and_traffic_continues(gateway, replicas):
    # Last in this file: it kills the second replica.
    gw = gateway("cache_aware")
    dead = replicas[1]
    dead.proc.kill()
    dead.proc.wait(10)
    started = time.monotonic()
    dropped = wait_for(lambda: all(w["url"] != dead.url or not w["is_healthy"] for w in gw.workers()), timeout=30)
    assert dropped, gw.workers()
    assert time.monotonic() - started < 15
    ids = concurrent_chats(gw.url, [f"after the loss {i}" for i in range(4)])
    assert [served_by(replicas, i) for i in ids] == [0] * 4

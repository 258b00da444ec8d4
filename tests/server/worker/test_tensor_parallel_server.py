"""The server with ``--tensor-parallel-size 2`` on the CPU: the API answers as one device does,
/health lists both ranks, a killed rank fails the replica (503, no hang) and the group comes back;
and a group over two "nodes" (two processes on 127.0.0.1, ``--nnodes 2``) serves a request."""

import json
import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import concurrent_greedy_chats, free_port

MODEL = "tiny"

pytestmark = pytest.mark.slow  # a two-rank server of its own, and two-node runs


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    srv = start_server(["--model", str(tiny_model_dir), "--served-model-name", MODEL, "--device", "cpu",
                        "--tensor-parallel-size", "2", "--num-kv-blocks", "128"])
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    """One device, in this process: what the two ranks must answer."""
    from xinserve.engines import LLM

    return LLM(tiny_model_dir, num_kv_blocks=128)


def health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=10).json()


def chat_ids(llm, content: str) -> list[int]:
    tok = llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_health_lists_both_ranks(server):
    (worker,) = health(server)["workers"]
    assert worker["worker"] == "cpu+cpu" and worker["state"] == "ready"
    ranks = worker["ranks"]
    assert [(r["rank"], r["device"], r["state"]) for r in ranks] == [(0, "cpu", "ready"), (1, "cpu", "ready")]
    assert ranks[0]["pid"] != ranks[1]["pid"] and all(isinstance(r["pid"], int) for r in ranks)
    # each rank's role: its tensor-parallel rank; one pipeline stage; a slice of every expert
    assert [r["role"] for r in ranks] == [{"tp_rank": 0, "pp_stage": 0, "expert_range": None, "layers": None},
                                          {"tp_rank": 1, "pp_stage": 0, "expert_range": None, "layers": None}]


def test_api_answers_as_one_device(server, offline):
    from xinserve.engines import SamplingParams

    prompts = [f"Story number {i}: the {['river', 'library', 'bread', 'harbour'][i % 4]}" for i in range(12)]
    max_tokens = [4 + i % 9 for i in range(12)]

    results = concurrent_greedy_chats(server.url, "x", MODEL, prompts, max_tokens, timeout=120)
    expected = offline.generate([chat_ids(offline, p) for p in prompts],
                                [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens])
    for (text, usage, reason), ref in zip(results, expected):
        assert (text, usage, reason) == (ref.text, len(ref.token_ids), ref.finish_reason)

    with httpx.Client(base_url=server.url, timeout=60) as http:
        # completions with echo and log-probs: the prompt's log-probs come from gathered logits too
        body = {"model": MODEL, "prompt": "The river ran", "max_tokens": 3, "temperature": 0, "echo": True,
                "logprobs": 2}
        got = http.post("/v1/completions", json=body).json()["choices"][0]
        ref = offline.generate("The river ran", SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                               prompt_logprobs=2))[0]
        assert got["text"] == "The river ran" + ref.text
        sampled = got["logprobs"]["token_logprobs"][-3:]
        assert sampled == pytest.approx([lp.logprob for lp in ref.outputs[0].logprobs], abs=1e-4)
        prompt_lps = [lp.logprob for lp in ref.prompt_logprobs[1:]]
        assert got["logprobs"]["token_logprobs"][1 : 1 + len(prompt_lps)] == pytest.approx(prompt_lps, abs=1e-4)
        # seeded sampling with n = 2 is reproducible; bad values are 400s, not 500s
        seeded = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "n": 2,
                  "seed": 7, "temperature": 1.0}
        first, again = (http.post("/v1/chat/completions", json=seeded).json() for _ in range(2))
        assert [c["message"] for c in first["choices"]] == [c["message"] for c in again["choices"]]
        bad = http.post("/v1/chat/completions", json={**seeded, "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_a_killed_rank_fails_the_replica_and_it_comes_back(server):
    """SIGKILL rank 1: the replica is failed at once (its rank 0 ended, /health names the dead
    rank), requests get a 503 instead of hanging, and the restarted group serves again."""
    (worker,) = health(server)["workers"]
    os.kill(worker["ranks"][1]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 20
    while (w := health(server)["workers"][0])["state"] == "ready" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w["state"] in ("dead", "starting")
    assert "rank 1 of the group" in w["last_error"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    start = time.monotonic()
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 503 and time.monotonic() - start < 5
    server.wait_ready(timeout=120)
    (worker,) = health(server)["workers"]
    assert worker["restarts"] == 1 and worker["ranks"][1]["pid"] != w["ranks"][1]["pid"]
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200


@pytest.mark.parametrize("split", [["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"]],
                         ids=["tp2", "pp2_one_stage_per_node"])
def test_two_nodes_on_one_machine_serve_a_request(start_server, tiny_model_dir, offline, split):
    """Node 0 runs rank 0 and HTTP; node 1 (a second ``xinserve serve``) runs rank 1 only: a tensor-
    parallel shard, or the pipeline's second stage."""
    from xinserve.engines import SamplingParams

    common = ["--model", str(tiny_model_dir), "--served-model-name", MODEL, "--device", "cpu",
              *split, "--num-kv-blocks", "64", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    head = start_server([*common, "--node-rank", "0"])
    other = start_server([*common, "--node-rank", "1"])
    try:
        head.wait_ready(timeout=120)
        (worker,) = health(head)["workers"]
        assert [r["state"] for r in worker["ranks"]] == ["ready", "ready"]
        assert worker["ranks"][1]["pid"] is None  # on the other node: not a process of this machine
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        got = httpx.post(f"{head.url}/v1/completions", json=body, timeout=60).json()
        ref = offline.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=8))[0]
        assert got["choices"][0]["text"] == ref.text
        assert other.proc.poll() is None and "HTTP" not in json.dumps(other.log()[-2000:]).upper()
    finally:
        head.stop()
        other.stop()

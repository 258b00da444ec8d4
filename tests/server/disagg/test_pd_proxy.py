"""1P1D on this machine: a prefill server and a decode server (MooncakeConnector over loopback TCP) behind
the vLLM-protocol proxy (server/disagg/proxy.py). Greedy answers equal one server's for 20 prompts, the
decode server computes only each prompt's last token (its prompt_tokens_computed counter), streams go
through, a bad or stale ``kv_transfer_params`` is a 400 or a recompute, and no KV block stays used."""

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import REPO_ROOT, free_port, serve_config, sse_events

pytestmark = pytest.mark.slow

PROMPTS = [f"Prompt {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 7) for i in range(20)]
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 8}


def model_config(path: Path, role: str, **extra: Any) -> dict[str, Any]:
    transfer = {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_port": free_port(), **extra}
    return {"models": [{"name": "tiny", "path": str(path), "workers": ["cpu"], "max_model_len": 512,
                        "num_kv_blocks": 256, "kv_transfer_config": transfer}]}


@pytest.fixture(scope="module")
def prefill(start_server, tiny_model_dir: Path, tmp_path_factory):
    config = model_config(tiny_model_dir, "kv_producer", kv_connector_extra_config={"hold_timeout_s": 3})
    return serve_config(start_server, tmp_path_factory.mktemp("prefill"), config)


@pytest.fixture(scope="module")
def decode(start_server, tiny_model_dir: Path, tmp_path_factory):
    config = model_config(tiny_model_dir, "kv_consumer", kv_connector_extra_config={"handshake_timeout_s": 2})
    return serve_config(start_server, tmp_path_factory.mktemp("decode"), config)


@pytest.fixture(scope="module")
def proxy(prefill, decode, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("proxy") / "proxy.log", "wb")  # noqa: SIM115  closed below
    proc = subprocess.Popen([sys.executable, "-m", "xinserve.server.disagg.proxy", "--prefill", prefill.url,
                             "--decode", decode.url, "--port", str(port)], cwd=REPO_ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(10)
    log.close()


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^xinserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def kv_settles(server, timeout: float = 15.0) -> float:
    """The server's KV usage once held blocks are read or expired (its worker frees them when idle too)."""
    deadline = time.monotonic() + timeout
    while (usage := metric(server, "kv_cache_usage_perc")) and time.monotonic() < deadline:
        time.sleep(0.2)
    return usage


def completion(url: str, prompt: str, **fields: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": prompt, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_twenty_prompts_through_the_proxy_answer_as_one_server(prefill, decode, proxy):
    single = [completion(prefill.url, p)["choices"][0] for p in PROMPTS]  # the prefill server alone
    computed = metric(decode, "prompt_tokens_computed_total")
    via_proxy = [completion(proxy, p)["choices"][0] for p in PROMPTS]
    assert [(c["text"], c["finish_reason"]) for c in via_proxy] == [(c["text"], c["finish_reason"]) for c in single]
    assert metric(decode, "prompt_tokens_computed_total") - computed == len(PROMPTS)  # each prompt's last token
    assert kv_settles(prefill) == 0 and kv_settles(decode) == 0


def test_a_chat_stream_through_the_proxy_is_the_one_servers(prefill, decode, proxy):
    body = {**GREEDY, "messages": [{"role": "user", "content": "tell me a story about a fox"}]}
    want = httpx.post(f"{prefill.url}/v1/chat/completions", json=body, timeout=120).json()
    with httpx.stream("POST", f"{proxy}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == want["choices"][0]["message"]["content"]
    assert kv_settles(prefill) == 0 and kv_settles(decode) == 0


def test_the_prefill_answer_carries_vllms_transfer_params(prefill):
    answer = completion(prefill.url, PROMPTS[3], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert {"remote_engine_id", "remote_block_ids", "remote_host", "remote_port"} <= set(params)
    assert "kv_transfer_params" not in completion(prefill.url, PROMPTS[3], max_tokens=1)
    assert kv_settles(prefill) == 0  # never read: the hold expires (hold_timeout_s 3)


def test_a_stale_transfer_is_recomputed_and_a_malformed_one_is_a_400(prefill, decode):
    prompt = PROMPTS[5] + " and once more"
    want = completion(prefill.url, prompt)["choices"][0]["text"]
    params = completion(prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
        "kv_transfer_params"]
    stale = {**params, "remote_request_id": "gone"}
    assert completion(decode.url, prompt, kv_transfer_params=stale)["choices"][0]["text"] == want
    r = httpx.post(f"{decode.url}/v1/completions", timeout=60,
                   json={**GREEDY, "prompt": prompt, "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 400 and "remote_engine_id" in r.json()["error"]["message"]
    assert kv_settles(prefill) == 0 and kv_settles(decode) == 0

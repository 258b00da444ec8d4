"""1P1D on this machine: a prefill server and a decode server (MooncakeConnector over loopback TCP) behind
the vLLM-protocol proxy (server/disagg/proxy.py). Greedy answers equal one server's for 20 prompts, the
decode server computes only each prompt's last token (its prompt_tokens_computed counter), streams go
through, a bad or stale ``kv_transfer_params`` is a 400 or a recompute, and no KV block stays used."""

from pathlib import Path

import httpx
import pytest

from tests.server.conftest import sse_events, wait_for
from tests.server.disagg.pd_servers import (
    GREEDY,
    PROMPTS,
    check_twenty_prompts,
    completion,
    kv_settles,
    metric,
    pd_server,
    settled_metric,
    vllm_proxy,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefill(start_server, tiny_model_dir: Path, tmp_path_factory):
    return pd_server(start_server, tiny_model_dir, tmp_path_factory, "kv_producer", hold_timeout_s=3)


@pytest.fixture(scope="module")
def decode(start_server, tiny_model_dir: Path, tmp_path_factory):
    return pd_server(start_server, tiny_model_dir, tmp_path_factory, "kv_consumer", handshake_timeout_s=2)


@pytest.fixture(scope="module")
def proxy(prefill, decode, tmp_path_factory):
    with vllm_proxy(prefill.url, decode.url, tmp_path_factory.mktemp("proxy")) as url:
        yield url


def test_twenty_prompts_through_the_proxy_answer_as_one_server(prefill, decode, proxy):
    check_twenty_prompts(prefill, decode, proxy)


def test_the_proxy_lists_the_models_and_refuses_a_body_that_is_not_json(decode, proxy):
    assert httpx.get(f"{proxy}/v1/models", timeout=10).json() == httpx.get(f"{decode.url}/v1/models", timeout=10).json()
    for body in (b"{not json", b"[1, 2]"):
        r = httpx.post(f"{proxy}/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body")


@pytest.mark.parametrize("fields", [
    {"n": 3, "temperature": 0.8, "seed": 7},  # the decode's choices all start from the one prompt it read
    {"stop": [" over", "dog"], "max_tokens": 16},
    {"logprobs": 3},
], ids=["n", "stop", "logprobs"])
def test_choices_stop_strings_and_logprobs_through_the_proxy_are_one_servers(prefill, decode, proxy, fields):
    prompt = PROMPTS[4]
    want, got = completion(prefill.url, prompt, **fields), completion(proxy, prompt, **fields)
    assert [(c["text"], c["finish_reason"]) for c in got["choices"]] == [
        (c["text"], c["finish_reason"]) for c in want["choices"]]
    if "logprobs" in fields:
        mine, theirs = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
        assert mine["tokens"] == theirs["tokens"]
        assert [sorted(t) for t in mine["top_logprobs"]] == [sorted(t) for t in theirs["top_logprobs"]]
        assert mine["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=1e-4)
    assert kv_settles(prefill) == 0 and kv_settles(decode) == 0


def test_a_completion_stream_through_the_proxy_is_the_one_servers(prefill, decode, proxy):
    body = {**GREEDY, "prompt": PROMPTS[6], "max_tokens": 12}
    want = completion(prefill.url, PROMPTS[6], max_tokens=12)["choices"][0]["text"]
    with httpx.stream("POST", f"{proxy}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]" and len(events) > 3  # token by token, not one frame
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == want


def test_held_sent_and_expired_transfers_are_counted_in_metrics(prefill, decode, proxy):
    sent = settled_metric(prefill, "kv_transfer_sent_requests_total")
    expired = metric(prefill, "kv_transfer_expired_requests_total")
    completion(proxy, PROMPTS[7])
    completion(prefill.url, PROMPTS[8], max_tokens=1, kv_transfer_params={"do_remote_decode": True})  # never read
    assert wait_for(lambda: metric(prefill, "kv_transfer_held_requests") == 1, timeout=2.5)  # hold_timeout_s 3
    assert wait_for(lambda: metric(prefill, "kv_transfer_expired_requests_total") - expired == 1, timeout=15)
    assert metric(prefill, "kv_transfer_held_requests") == 0
    assert metric(prefill, "kv_transfer_sent_requests_total") - sent == 1
    (worker,) = httpx.get(f"{prefill.url}/health", timeout=10).json()["workers"]
    assert worker["kv_transfer"]["held_requests"] == 0 and worker["kv_transfer"]["expired_total"] >= 1


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

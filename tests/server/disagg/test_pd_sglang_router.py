"""1P1D behind the real SGLang gateway in PD mode (``sglang-router --pd-disaggregation``): it sends each
request to both servers at once with SGLang's bootstrap fields; the prefill server holds the prompt's blocks
under the room and the decode server, finding them there, reads them over Mooncake (loopback TCP). Greedy
answers equal one server's, the decode server computes only each prompt's last token, no block stays used."""

from pathlib import Path

import httpx
import pytest

from tests.server.conftest import wait_for
from tests.server.disagg.pd_servers import (
    GREEDY,
    PROMPTS,
    completion,
    kv_settles,
    metric,
    pd_server,
    settled_metric,
    sglang_gateway,
)
from xinserve.engines.kv.side_channel import ask

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefill(start_server, tiny_model_dir: Path, tmp_path_factory):
    return pd_server(start_server, tiny_model_dir, tmp_path_factory, "kv_producer", hold_timeout_s=5)


@pytest.fixture(scope="module")
def decode(start_server, tiny_model_dir: Path, tmp_path_factory):
    return pd_server(start_server, tiny_model_dir, tmp_path_factory, "kv_consumer", handshake_timeout_s=2,
                     bootstrap_timeout_s=30)


@pytest.fixture(scope="module")
def gateway(prefill, decode, tmp_path_factory):
    with sglang_gateway(prefill, decode, tmp_path_factory.mktemp("router")) as url:
        yield url


def test_the_prefill_server_reports_its_bootstrap_port_as_sglang_does(prefill, decode):
    port = httpx.get(f"{prefill.url}/server_info", timeout=10).json()["disaggregation_bootstrap_port"]
    # Its side channel answers there: a room no prefill has finished is pending.
    assert ask(f"tcp://127.0.0.1:{port}", {"op": "lookup", "room": 12345}, 5) == {"ok": False, "pending": True}
    assert httpx.get(f"{decode.url}/server_info", timeout=10).json()["disaggregation_bootstrap_port"] is None


def test_twenty_prompts_through_sglang_router_in_pd_mode_answer_as_one_server(prefill, decode, gateway):
    prompts = PROMPTS
    single = [completion(prefill.url, p)["choices"][0]["text"] for p in prompts]  # the prefill server alone
    computed = metric(decode, "prompt_tokens_computed_total")
    sent = settled_metric(prefill, "kv_transfer_sent_requests_total")
    via_router = [completion(gateway, p)["choices"][0]["text"] for p in prompts]
    assert via_router == single
    assert metric(decode, "prompt_tokens_computed_total") - computed == len(prompts)  # each prompt's last token
    # Freed after the decode server's read: the prefill worker's next stats say so.
    assert wait_for(lambda: metric(prefill, "kv_transfer_sent_requests_total") - sent == len(prompts), timeout=15)
    assert kv_settles(prefill) == 0 and kv_settles(decode) == 0


def test_a_chat_through_sglang_router_in_pd_mode(prefill, decode, gateway):
    body = {**GREEDY, "messages": [{"role": "user", "content": "tell me a story about a fox"}]}
    want = httpx.post(f"{prefill.url}/v1/chat/completions", json=body, timeout=120).json()
    r = httpx.post(f"{gateway}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert kv_settles(prefill) == 0 and kv_settles(decode) == 0

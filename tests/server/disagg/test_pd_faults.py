"""Faults between a prefill server and two decode servers (one per ``kv_load_failure_policy``), over loopback
Mooncake TCP: a read that fails is recomputed to the one server's answer under ``recompute`` and a clear 500
under ``fail``, the prefill's engine process killed (SIGKILL) while it holds a request's blocks included; no
KV block stays used on a decode server."""

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port, serve_config, wait_for
from tests.server.disagg.pd_servers import GREEDY, PROMPTS, completion, kv_settles, model_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefill(start_server, tiny_model_dir: Path, tmp_path_factory):
    config = model_config(tiny_model_dir, "kv_producer", kv_connector_extra_config={"hold_timeout_s": 60})
    return serve_config(start_server, tmp_path_factory.mktemp("prefill"), config)


def _decode(start_server, model: Path, directory: Path, policy: str):
    config = model_config(model, "kv_consumer", kv_load_failure_policy=policy,
                          kv_connector_extra_config={"handshake_timeout_s": 2, "bootstrap_timeout_s": 3})
    return serve_config(start_server, directory, config)


@pytest.fixture(scope="module")
def decodes(start_server, tiny_model_dir: Path, tmp_path_factory):
    return {policy: _decode(start_server, tiny_model_dir, tmp_path_factory.mktemp(policy), policy)
            for policy in ("recompute", "fail")}


def prefilled(prefill, prompt: str) -> dict:
    return completion(prefill.url, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})[
        "kv_transfer_params"]


def decoded(server, prompt: str, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={**GREEDY, "prompt": prompt, **fields}, timeout=120)


def test_a_stale_transfer_is_a_500_under_the_fail_policy(prefill, decodes):
    params = {**prefilled(prefill, PROMPTS[2]), "remote_request_id": "gone"}
    r = decoded(decodes["fail"], PROMPTS[2], kv_transfer_params=params)
    assert r.status_code == 500
    assert "could not be loaded" in r.json()["error"]["message"]
    assert kv_settles(decodes["fail"]) == 0


def test_the_prefill_engine_killed_while_it_holds_the_blocks(prefill, decodes):
    want = {p: completion(prefill.url, p)["choices"][0]["text"] for p in PROMPTS[9:11]}
    held = {p: prefilled(prefill, p) for p in want}  # held for 60 s: only the kill ends the hold
    (worker,) = httpx.get(f"{prefill.url}/health", timeout=10).json()["workers"]
    os.kill(worker["pid"], signal.SIGKILL)
    recompute, fail = (decodes[k] for k in ("recompute", "fail"))
    first, second = want
    r = decoded(recompute, first, kv_transfer_params=held[first])
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[first]
    r = decoded(fail, second, kv_transfer_params=held[second])
    assert r.status_code == 500 and "could not be loaded" in r.json()["error"]["message"]
    # SGLang's bootstrap fields naming the dead instance: the same two outcomes.
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": held[first]["remote_port"], "bootstrap_room": 7}
    r = decoded(recompute, first, **room)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[first]
    r = decoded(fail, second, **{**room, "bootstrap_room": 8})
    assert r.status_code == 500 and "bootstrap_room 8" in r.json()["error"]["message"]
    assert kv_settles(recompute) == 0 and kv_settles(fail) == 0
    # The prefill server starts its engine again: it holds nothing from before.
    assert wait_for(lambda: httpx.get(f"{prefill.url}/health", timeout=10).json()["status"] == "ok", timeout=120)
    assert kv_settles(prefill) == 0


def test_a_bootstrap_room_whose_prefill_instance_does_not_answer(decodes):
    port = free_port()  # nobody listens there: no answer within handshake_timeout_s
    room = {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 2**64 - 1}
    want = completion(decodes["recompute"].url, PROMPTS[12])["choices"][0]["text"]
    assert decoded(decodes["recompute"], PROMPTS[12], **room).json()["choices"][0]["text"] == want
    assert decoded(decodes["fail"], PROMPTS[12], **room).status_code == 500
    bad = decoded(decodes["fail"], PROMPTS[12], **{**room, "bootstrap_room": 2**64})
    assert bad.status_code == 400
    bad = decoded(decodes["recompute"], PROMPTS[12], **{**room, "bootstrap_port": 70000})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bootstrap_port"
    unusable = decoded(decodes["recompute"], PROMPTS[12], **{**room, "bootstrap_host": "no such host"})
    assert unusable.json()["choices"][0]["text"] == want  # computed here, as for a silent peer

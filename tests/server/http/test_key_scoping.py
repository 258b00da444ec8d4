"""A key limited to some models reaches no other, in any way: not through a fallback chain (nor in
its error messages), not in /health or /metrics when those need a key; and the API description
(/openapi.json, /docs, /redoc) needs a key like every path that is not exempt."""

import json
import time

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

KEY_A = "sk-team-a-71c2d9e0"  # limited to "public", which falls back to "secret"
KEY_ADMIN = "sk-admin-5b8e13f4"  # every model


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("key-scoping")
    broken = root / "broken"  # a model whose worker cannot load, so requests for it fall back
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["FancyForCausalLM"], "model_type": "llama"}))
    config = {
        "server": {"api_keys": [{"name": "team-a", "key": KEY_A, "models": ["public"]},
                                {"name": "admin", "key": KEY_ADMIN}],
                   "auth_exempt_paths": []},
        "models": [
            {"name": "public", "path": str(broken), "tokenizer": str(tiny_model_dir), "workers": ["cpu"],
             "fallback": ["secret"]},
            {"name": "secret", "path": str(tiny_model_dir), "workers": ["cpu"], "max_num_seqs": 2,
             "cpu_threads": 1},
        ],
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    srv = start_server(["--config", str(path)])
    deadline = time.monotonic() + 600  # a first run builds the C++ extension, on a shared machine
    while True:  # /health needs a key here, so the fixture's own wait cannot poll it
        try:
            workers = httpx.get(f"{srv.url}/health", headers=auth(KEY_ADMIN), timeout=5).json().get("workers", [])
        except httpx.HTTPError:
            workers = []
        if workers and all(w["state"] != "starting" for w in workers):
            break
        assert time.monotonic() < deadline, srv.log()[-4000:]
        time.sleep(0.5)
    yield srv
    srv.stop()


def chat(server, key: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth(key), timeout=60)


def test_a_fallback_the_key_may_not_use_does_not_answer(server):
    r = chat(server, KEY_ADMIN, "public")
    assert r.status_code == 200 and r.json()["model"] == "secret"  # the chain itself works
    r = chat(server, KEY_A, "public")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "model_unavailable" and "secret" not in r.text
    body = {"model": "public", "prompt": "hi", "max_tokens": 2, "n": 50}  # more than "secret" holds
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(KEY_A), timeout=60)
    assert r.status_code == 503 and "secret" not in r.text


def test_health_shows_a_limited_key_only_its_models(server):
    r = httpx.get(f"{server.url}/health", headers=auth(KEY_A), timeout=10)
    assert "secret" not in r.text
    body = r.json()
    # "public" cannot answer this key: its fallback is not one the key may use.
    assert r.status_code == 503 and body["status"] == "unavailable"
    assert body["models"] == {"public": "unavailable"}
    assert {w["model"] for w in body["workers"]} == {"public"}
    r = httpx.get(f"{server.url}/health", headers=auth(KEY_ADMIN), timeout=10)
    assert r.status_code == 200 and r.json()["models"] == {"public": "fallback", "secret": "ready"}
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 401


def test_metrics_show_a_limited_key_only_its_models(server):
    def model_names(key: str) -> set[str]:
        text = httpx.get(f"{server.url}/metrics", headers=auth(key), timeout=10).text
        return {s.labels["model_name"] for f in text_string_to_metric_families(text)
                for s in f.samples if "model_name" in s.labels}

    assert model_names(KEY_A) == {"public"}
    assert model_names(KEY_ADMIN) == {"public", "secret"}
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 401


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc"])
def test_api_description_needs_a_key_unless_exempt(server, path):
    assert httpx.get(f"{server.url}{path}", timeout=10).status_code == 401
    r = httpx.get(f"{server.url}{path}", headers=auth(KEY_A), timeout=10)
    assert r.status_code == 200
    if path == "/openapi.json":
        assert "/v1/chat/completions" in r.json()["paths"]
    else:
        assert "/openapi.json" in r.text

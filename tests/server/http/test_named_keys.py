"""Named API keys: a key limited to some models sees only those (the others are 404, as if absent),
each key's requests and tokens are counted under its name, and no key value ever reaches the log or
/metrics. Config errors name the entry without showing its key."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import KEY_A, KEY_B, KEY_PLAIN
from xinserve.server.config import ConfigError, parse_config

ALL_KEYS = (KEY_A, KEY_B, KEY_PLAIN)
MODELS = [{"name": "tiny", "path": "embedded:xinserve-tiny"}, {"name": "other", "path": "embedded:xinserve-tiny"}]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def server(keyed_server):
    return keyed_server


def chat(server, key: str, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5,
            "ignore_eos": True, **kw}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth(key), timeout=60)


def key_counters(server) -> dict[tuple[str, str, str], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("xinserve:api_key_") and s.name.endswith("_total"):
                out[(s.name, s.labels["key_name"], s.labels["model_name"])] = s.value
    return out


def test_a_limited_key_sees_only_its_models(server):
    r = httpx.get(f"{server.url}/v1/models", headers=auth(KEY_A), timeout=10)
    assert [m["id"] for m in r.json()["data"]] == ["tiny"]
    r = httpx.get(f"{server.url}/v1/models", headers=auth(KEY_B), timeout=10)
    assert [m["id"] for m in r.json()["data"]] == ["tiny", "other"]
    assert httpx.get(f"{server.url}/v1/models/tiny", headers=auth(KEY_A), timeout=10).status_code == 200
    hidden = httpx.get(f"{server.url}/v1/models/other", headers=auth(KEY_A), timeout=10)
    absent = httpx.get(f"{server.url}/v1/models/nope", headers=auth(KEY_A), timeout=10)
    assert hidden.status_code == absent.status_code == 404
    assert hidden.json()["error"] == {**absent.json()["error"], "message": "The model 'other' does not exist."}


def test_allowed_model_200_other_model_404_as_if_absent(server):
    assert chat(server, KEY_A, "tiny").status_code == 200
    hidden, absent = chat(server, KEY_A, "other"), chat(server, KEY_A, "nope")
    assert hidden.status_code == absent.status_code == 404
    assert hidden.json()["error"]["code"] == absent.json()["error"]["code"] == "model_not_found"
    body = {"model": "other", "prompt": "hello", "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(KEY_A), timeout=60)
    assert r.status_code == 404
    assert chat(server, KEY_B, "other").status_code == 200  # an unlimited key from key_env
    assert chat(server, KEY_PLAIN, "other").status_code == 200
    assert chat(server, "sk-not-a-key", "tiny").status_code == 401


def test_per_key_counters_move_by_the_usage(server):
    before = key_counters(server)
    r = chat(server, KEY_A, "tiny")
    usage = r.json()["usage"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=auth(KEY_PLAIN), timeout=60,
                      json={"model": "other", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "ignore_eos": True, "stream": True}) as s:
        assert s.status_code == 200
        s.read()
    chat(server, KEY_A, "other")  # refused: not a request of the model, nothing counted
    after = key_counters(server)

    def moved(name: str, key: str, model: str) -> float:
        series = (f"xinserve:api_key_{name}_total", key, model)
        return after.get(series, 0.0) - before.get(series, 0.0)

    assert moved("requests", "team-a", "tiny") == 1
    assert moved("prompt_tokens", "team-a", "tiny") == usage["prompt_tokens"]
    assert moved("generation_tokens", "team-a", "tiny") == usage["completion_tokens"] == 5
    assert moved("requests", "key-3", "other") == 1  # a plain string, third in the list
    assert moved("generation_tokens", "key-3", "other") == 3
    assert moved("requests", "team-a", "other") == 0


def test_key_values_never_logged_nor_exported_and_the_log_names_the_key(server):
    chat(server, KEY_B, "tiny")
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    log = server.log()
    for key in ALL_KEYS:
        assert key not in metrics and key not in log
    assert 'key_name="team-b"' in metrics
    lines = [ln for ln in log.splitlines() if "POST /v1/chat/completions status=200" in ln and "key=team-b" in ln]
    assert "model=tiny" in lines[-1]
    assert any("status=404" in ln and "key=team-a" in ln for ln in log.splitlines())


@pytest.mark.parametrize("entry, message", [
    ({"name": "t", "key_env": "XINSERVE_TEST_UNSET_VARIABLE"}, "environment variable XINSERVE_TEST_UNSET_VARIABLE"),
    ({"name": "t", "key": "sk-x", "key_env": "X"}, "exactly one of key and key_env"),
    ({"name": "t", "key": "sk-x", "models": ["missing"]}, "unknown model(s) ['missing']"),
    ({"name": "t", "key": "sk-x", "modles": ["tiny"]}, "server.api_keys.0.named.modles"),
    ({"name": "key-2", "key": "sk-x"}, "duplicate key name(s) ['key-2']"),
    ({"name": "t", "key": "sk-plain-string"}, "two entries have the same key"),
])
def test_bad_key_entries_are_named_without_their_key(entry, message, monkeypatch):
    monkeypatch.delenv("XINSERVE_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError) as exc:
        parse_config({"server": {"api_keys": [entry, "sk-plain-string"]}, "models": MODELS})
    assert message in str(exc.value)
    assert "sk-x" not in str(exc.value) and "sk-plain-string" not in str(exc.value)


def test_plain_string_keys_keep_working_and_get_position_names():
    config = parse_config({"server": {"api_keys": ["k1", {"name": "ops", "key": "k2"}, "k3"]}, "models": MODELS})
    assert config.server.api_keys[0] == "k1"
    assert [(k.name, k.secret, k.models) for k in config.server.named_keys()] == [
        ("key-1", "k1", []), ("ops", "k2", []), ("key-3", "k3", [])]
    assert "k2" not in repr(config)

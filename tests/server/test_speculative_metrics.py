"""A model served with --speculative-config: /metrics carries vLLM's spec_decode counters under the
server's prefix, /health the method and the running acceptance rate."""

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    srv = start_server(["--model", str(tiny_model_dir), "--served-model-name", "tiny",
                        "--speculative-config", json.dumps(SPEC)])
    srv.wait_ready()
    yield srv
    srv.stop()


def samples(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_and_health_report_accepted_draft_tokens(http):
    # Greedy tiny random models settle into loops: prompt lookup then drafts what the loop repeats.
    for prompt in ("the cat sat on the mat, the cat sat on the", "one two three one two three one two"):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 48,
                                               "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 48
    families = samples(http.get("/metrics").text)
    value = {name: families[f"xinserve:spec_decode_{name}"][0].value
             for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    assert value["num_drafts"] > 0 and 0 < value["num_accepted_tokens"] <= value["num_draft_tokens"]
    per_position = families["xinserve:spec_decode_num_accepted_tokens_per_pos"]
    assert sorted(s.labels["position"] for s in per_position) == ["0", "1", "2"]
    assert sum(s.value for s in per_position) == value["num_accepted_tokens"]
    assert all(s.labels["model_name"] == "tiny" for s in per_position)
    [worker] = http.get("/health").json()["workers"]
    spec = worker["speculative_decoding"]
    assert spec["method"] == "ngram"
    assert spec["acceptance_rate"] == pytest.approx(value["num_accepted_tokens"] / value["num_draft_tokens"], abs=1e-3)

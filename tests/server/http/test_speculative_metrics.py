"""A model served with --speculative-config: /metrics carries vLLM's spec_decode counters under the
server's prefix, /health the method and the running acceptance rate."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import SPEC_MODEL

MODEL = SPEC_MODEL  # one of the models of the shared assorted_server (tests/server/conftest.py)


@pytest.fixture(scope="module")
def http(assorted_server):
    with httpx.Client(base_url=assorted_server.url, timeout=120) as client:
        yield client


def samples(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_and_health_report_accepted_draft_tokens(http):
    # Greedy tiny random models settle into loops: prompt lookup then drafts what the loop repeats.
    for prompt in ("the cat sat on the mat, the cat sat on the", "one two three one two three one two"):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 48,
                                               "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 48
    families = samples(http.get("/metrics").text)
    value = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        [value[name]] = [s.value for s in families[f"xinserve:spec_decode_{name}"] if s.labels["model_name"] == MODEL]
    assert value["num_drafts"] > 0 and 0 < value["num_accepted_tokens"] <= value["num_draft_tokens"]
    per_position = families["xinserve:spec_decode_num_accepted_tokens_per_pos"]
    assert sorted(s.labels["position"] for s in per_position) == ["0", "1", "2"]
    assert sum(s.value for s in per_position) == value["num_accepted_tokens"]
    assert all(s.labels["model_name"] == MODEL for s in per_position)  # the other models draft nothing
    [worker] = [w for w in http.get("/health").json()["workers"] if w["model"] == MODEL]
    spec = worker["speculative_decoding"]
    assert spec["method"] == "ngram"
    assert spec["acceptance_rate"] == pytest.approx(value["num_accepted_tokens"] / value["num_draft_tokens"], abs=1e-3)

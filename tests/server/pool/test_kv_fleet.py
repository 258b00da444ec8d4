"""A served model with KV events and the host KV tier: the flags reach the worker, a prompt evicted by
others is reloaded from the tier (counted as vLLM's external_prefix_cache_* on /metrics, shown on
/health), its events can be replayed from the worker's ROUTER socket, and each replica of a model gets
its own data-parallel rank."""

from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.engines.kv.test_kv_events import DECODER, VBlockRemoved, VBlockStored, replay, replay_socket
from tests.server.conftest import KV_FLEET_MODEL
from xinserve.server.config import parse_config
from xinserve.server.pool.model_pool import ModelPool

MODEL = KV_FLEET_MODEL  # one of the models of the shared assorted_server (tests/server/conftest.py)
PROMPT = [(7 * i) % 250 + 3 for i in range(70)]  # 4 full blocks of 16


@pytest.fixture(scope="module")
def served(assorted_server):
    with httpx.Client(base_url=assorted_server.url, timeout=120) as client:
        yield client, assorted_server.kv_events


def complete(http: httpx.Client, prompt: list[int]) -> str:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                           "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def engine_counters(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {s.name.partition(":")[2]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.labels.get("model_name") == MODEL}


def test_an_evicted_prompt_is_reloaded_from_the_host_tier_and_its_events_replay(served):
    http, events = served
    cold = complete(http, PROMPT)
    for k in (0, 100):  # two prompts of 7 blocks evict PROMPT's 4 cached blocks from the pool of 8
        complete(http, [(11 * i + k) % 250 + 3 for i in range(100)])
    assert complete(http, PROMPT) == cold
    counters = engine_counters(http)
    assert counters["external_prefix_cache_hits_total"] == 64
    assert counters["external_prefix_cache_queries_total"] == 70 + 100 + 100 + 70
    health = http.get("/health").json()
    (worker,) = [w for w in health["workers"] if w["model"] == MODEL]
    assert worker["info"]["kv_offloading"]["capacity_blocks"] > 0
    assert worker["info"]["kv_events"]["data_parallel_rank"] == 0
    assert worker["external_prefix_cache_hits_total"] == 64

    ctx = zmq.Context()
    sock = replay_socket(ctx, events["replay_endpoint"])
    replayed = replay(sock, 0)
    sock.close(linger=0)
    ctx.term()
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))  # every batch, in order, from the first
    batches = [DECODER.decode(payload) for _, payload in replayed]
    found = [e for b in batches for e in b.events]
    first = next(i for i, e in enumerate(found) if isinstance(e, VBlockStored) and e.token_ids[:16] == PROMPT[:16])
    evicted = set(found[first].block_hashes)
    assert any(isinstance(e, VBlockRemoved) and evicted & set(e.block_hashes) for e in found[first:])
    assert all(b.data_parallel_rank == 0 for b in batches)


def test_each_replica_of_a_model_gets_its_own_data_parallel_rank(tmp_path: Path):
    config = parse_config({"models": [{"name": "m", "path": str(tmp_path), "workers": ["cpu", "cpu"]}]})
    pool = ModelPool(config.models[0], cpu_threads=1, log_level=20)
    specs = [pool._spec(w, str(tmp_path), str(tmp_path), str(tmp_path)) for w in pool.workers]
    assert [s.engine_kwargs["data_parallel_rank"] for s in specs] == [0, 1]

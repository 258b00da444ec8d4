"""Metric names and labels (DESIGN.md), read from worker stats at scrape time."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from xinserve.engines.core.outputs import EngineStats
from xinserve.server.http.metrics import (
    EngineStatsCollector,
    KeyMetrics,
    LimitedKeyView,
    LoraMetrics,
    RequestMetrics,
    observe_many,
)

DESIGN_NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                "generation_tokens_total", "num_preemptions_total", "request_success_total",
                "prefix_cache_queries_total", "prefix_cache_hits_total", "time_to_first_token_seconds",
                "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"]


class Worker:
    def __init__(self, model, label, ready, stats, restarts=0, info=None):
        self.model_name, self.label, self.ready, self.stats = model, label, ready, stats
        self.restarts, self.info = restarts, info or {}


class Pool:
    def __init__(self, workers):
        self.workers = workers


class Choice:
    def __init__(self, reason):
        self.finish_reason = reason


class Gen:
    def __init__(self, worker):
        self.worker = worker
        self.arrival, self.first_token_at, self.inter_token_latencies = 10.0, 10.2, [0.01, 0.02]
        self.queue_time, self.done = 0.05, True
        self.choices = [Choice("stop"), Choice("length")]


def scrape(registry) -> dict[str, dict]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, {})[(s.labels.get("model_name"), s.labels.get("worker"),
                                        s.labels.get("finished_reason"), s.labels.get("le"))] = s.value
    return out


def test_every_design_metric_is_exported_with_model_and_worker_labels():
    up = Worker("glm", "npu:0", True, EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.25,
                                                  num_preemptions_total=0, prefix_cache_queries_total=0,
                                                  prefix_cache_hits_total=0, prompt_tokens_total=7,
                                                  generation_tokens_total=99),
                info={"decode_graphs": {"buckets": {"1": {"state": "compiled"}, "2": {"state": "compiling"},
                                                    "4": {"state": "failed"}, "8": {"state": "compiled"}}}})
    down = Worker("glm", "musa:0", False, EngineStats(5, 0, 0.0, 0, 0, 0, 0, 4), restarts=2)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector({"glm": Pool([up, down])}))
    metrics = RequestMetrics(registry)
    metrics.observe(Gen(up), end=11.0)
    samples = scrape(registry)
    for name in DESIGN_NAMES:
        assert any(s.startswith(f"xinserve:{name}") for s in samples), name
    running = samples["xinserve:num_requests_running"]
    assert running[("glm", "npu:0", None, None)] == 3
    assert running[("glm", "musa:0", None, None)] == 0  # a worker that is not serving runs nothing
    assert samples["xinserve:generation_tokens_total"][("glm", "musa:0", None, None)] == 4  # counters stay
    assert samples["xinserve:kv_cache_usage_perc"][("glm", "npu:0", None, None)] == 0.25
    success = samples["xinserve:request_success_total"]
    assert success[("glm", "npu:0", "stop", None)] == 1 and success[("glm", "npu:0", "length", None)] == 1
    assert samples["xinserve:time_to_first_token_seconds_count"][("glm", "npu:0", None, None)] == 1
    assert samples["xinserve:inter_token_latency_seconds_count"][("glm", "npu:0", None, None)] == 2
    assert samples["xinserve:e2e_request_latency_seconds_sum"][("glm", "npu:0", None, None)] == 1.0
    assert samples["xinserve:worker_ready"][("glm", "musa:0", None, None)] == 0
    compiled = samples["xinserve:decode_buckets_compiled"]  # the others run eagerly for now, or for good
    assert compiled[("glm", "npu:0", None, None)] == 2 and compiled[("glm", "musa:0", None, None)] == 0
    restarts = samples["xinserve:worker_restarts_total"]
    assert restarts[("glm", "musa:0", None, None)] == 2 and restarts[("glm", "npu:0", None, None)] == 0


def test_the_vllm_prefix_names_every_metric_as_vllm_does():
    stats = EngineStats(2, 1, 0.5, 0, 10, 4, 7, 9)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector({"glm": Pool([Worker("glm", "npu:0", True, stats)])}, "vllm"))
    RequestMetrics(registry, "vllm").observe(Gen(Worker("glm", "npu:0", True, stats)), end=11.0)
    KeyMetrics(registry, "vllm").observe("team-a", "glm", 3, 4)
    samples = scrape(registry)
    assert not [name for name in samples if name.startswith("xinserve:")]
    for name in DESIGN_NAMES:
        assert any(s.startswith(f"vllm:{name}") for s in samples), name
    key = ("glm", "npu:0", None, None)
    # vLLM 0.6's KV-usage name, and its per-token latency histogram (the inter-token observations).
    assert samples["vllm:gpu_cache_usage_perc"][key] == samples["vllm:kv_cache_usage_perc"][key] == 0.5
    assert samples["vllm:time_per_output_token_seconds_count"][key] == 2
    # ... and the prefix-cache names vLLM's production-stack router reads.
    assert samples["vllm:gpu_prefix_cache_queries_total"][key] == 10
    assert samples["vllm:gpu_prefix_cache_hits_total"][key] == 4
    assert samples["vllm:gpu_prefix_cache_hit_rate"][key] == 0.4
    assert samples["vllm:api_key_requests_total"][("glm", None, None, None)] == 1


def test_the_lora_info_gauge_carries_each_workers_adapters_in_vllms_labels():
    stats = EngineStats(3, 2, 0.5, 0, 0, 0, 0, 0, running_lora_adapters=["sql", "chat"],
                        waiting_lora_adapters=["math"], max_lora=4)
    workers = [Worker("glm", "npu:0", True, stats), Worker("glm", "npu:1", True, None),
               Worker("glm", "npu:2", False, stats)]  # no stats yet; not serving
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector({"glm": Pool(workers)}, "vllm"))
    (family,) = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
                 if f.name == "vllm:lora_requests_info"]
    by_worker = {s.labels.pop("worker"): s for s in family.samples}
    assert by_worker["npu:0"].labels == {"model_name": "glm", "max_lora": "4", "running_lora_adapters": "sql,chat",
                                         "waiting_lora_adapters": "math"}
    for idle in ("npu:1", "npu:2"):
        assert by_worker[idle].labels == {"model_name": "glm", "max_lora": "0", "running_lora_adapters": "",
                                          "waiting_lora_adapters": ""}
    assert all(s.value > 1.7e9 for s in family.samples)  # when it was read, as vLLM's


def test_per_adapter_counters_are_labelled_by_adapter_and_base_model():
    registry = CollectorRegistry()
    loras = LoraMetrics(registry, "vllm")
    loras.observe("sql", "glm", 5, 7)
    loras.observe("sql", "glm", 1, 2)
    loras.observe("chat", "glm", 3, 0)
    samples = {(s.name, s.labels["lora_name"]): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples if s.name.endswith("_total")}
    assert samples == {("vllm:lora_requests_total", "sql"): 2, ("vllm:lora_prompt_tokens_total", "sql"): 6,
                       ("vllm:lora_generation_tokens_total", "sql"): 9, ("vllm:lora_requests_total", "chat"): 1,
                       ("vllm:lora_prompt_tokens_total", "chat"): 3, ("vllm:lora_generation_tokens_total", "chat"): 0}


def test_a_limited_key_sees_only_its_models_series_and_its_own_key_counters():
    stats = EngineStats(1, 0, 0.5, 0, 0, 0, 3, 4)
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector({"glm": Pool([Worker("glm", "npu:0", True, stats)]),
                                            "secret": Pool([Worker("secret", "npu:1", True, stats)])}))
    RequestMetrics(registry).observe(Gen(Worker("secret", "npu:1", True, stats)), end=11.0)
    keys = KeyMetrics(registry)
    keys.observe("team-a", "glm", 5, 6)
    keys.observe("team-b", "glm", 7, 8)
    keys.observe("team-b", "secret", 9, 10)
    Counter("http_requests", "an unlabelled series", registry=registry).inc()

    def series(source) -> set[tuple]:
        text = generate_latest(source).decode()
        return {(s.name, s.labels.get("model_name"), s.labels.get("key_name"))
                for f in text_string_to_metric_families(text) for s in f.samples}

    everything = series(registry)
    seen = series(LimitedKeyView(registry, ["glm"], "team-a"))
    assert {m for _, m, _ in everything} == {"glm", "secret", None}
    assert {m for _, m, _ in seen} == {"glm", None}
    assert {k for _, _, k in seen} == {"team-a", None}
    assert ("http_requests_total", None, None) in seen
    # Nothing else is left out: every series of "glm" without another key's name.
    assert seen == {s for s in everything if s[1] in ("glm", None) and s[2] in ("team-a", None)}


def test_observing_many_latencies_at_once_exposes_what_observing_each_does():
    # On bucket bounds, between them, below the first and past the last (the +Inf bucket), repeated.
    values = [0.0, 0.01, 0.010001, 0.025, 0.5, 0.5, 3.0, 99.0, 1e-9, 0.075] * 3
    scraped = []
    for bulk in (False, True):
        registry = CollectorRegistry()
        child = Histogram("h", "h", ["model_name"], buckets=[0.01, 0.025, 0.05, 0.075, 0.1, 0.5, 2.5],
                          registry=registry).labels("m")
        if bulk:
            observe_many(child, values)
            observe_many(child, [])
        else:
            for value in values:
                child.observe(value)
        scraped.append(scrape(registry))
    each, many = scraped
    assert many.keys() == each.keys()
    assert many["h_bucket"] == each["h_bucket"] and many["h_count"] == each["h_count"]
    assert many["h_sum"] == pytest.approx(each["h_sum"])  # one addition of the sum, not one per value

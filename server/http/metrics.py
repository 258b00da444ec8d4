"""Prometheus metrics: vLLM's engine metric names under ``xinserve:`` (or another prefix, such as
``vllm:`` for routers and autoscalers configured for vLLM), labelled model_name and worker.

Engine gauges and counters are read at scrape time from each worker's last reported stats (a
custom collector), so a slow or dead worker never blocks /metrics. Latency histograms and
``request_success_total`` are observed here, in the HTTP process, as requests finish. HTTP
metrics come from prometheus-fastapi-instrumentator, in the same per-app registry. Per-API-key
counters are named ``api_key_*`` and labelled ``key_name``; per-LoRA-adapter counters ``lora_*``, labelled
``lora_name`` (and ``model_name``: the adapter's base model).

``LimitedKeyView`` is what a scrape with a key limited to some models sees (when ``/metrics`` needs a
key): the series of the other models, and the other keys' counters, are left out.
"""

import bisect
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from xinserve.server.api.generation import Generation

DEFAULT_PREFIX = "xinserve"
LABELS = ("model_name", "worker")

# (metric name, EngineStats field, help); counters are exported with the "_total" suffix.
ENGINE_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0 to 1)."),
    ("kv_transfer_held_requests", "kv_transfer_held_requests",
     "Finished requests whose KV blocks this prefill instance holds for a decode instance to read."),
)
ENGINE_COUNTERS = (
    ("prompt_tokens", "prompt_tokens_total", "Prefill tokens processed."),
    ("prompt_tokens_computed", "prompt_tokens_computed_total",
     "Prompt tokens run through the model (neither prefix-cache hits nor loaded by a KV connector)."),
    ("generation_tokens", "generation_tokens_total", "Tokens generated."),
    ("num_preemptions", "num_preemptions_total", "Sequences preempted for lack of KV blocks."),
    ("prefix_cache_queries", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    ("external_prefix_cache_queries", "external_prefix_cache_queries_total",
     "Prompt tokens looked up in the external (host) KV tier."),
    ("external_prefix_cache_hits", "external_prefix_cache_hits_total",
     "Prompt tokens found in the external (host) KV tier."),
    ("kv_transfer_sent_requests", "kv_transfer_sent_total",
     "Held requests whose KV blocks a decode instance read (prefill/decode disaggregation)."),
    ("kv_transfer_expired_requests", "kv_transfer_expired_total",
     "Held requests freed unread after hold_timeout_s (vLLM's nixl_num_kv_expired_reqs)."),
    ("kv_transfer_failed_loads", "kv_transfer_failed_loads_total",
     "Requests whose KV this decode instance failed to read from a prefill instance (recomputed or failed)."),
)

# vLLM's older names, still read by vLLM's production-stack router and dashboards (same values).
LEGACY_GAUGES = (
    ("gpu_cache_usage_perc", "kv_cache_usage", "Fraction of KV-cache blocks in use (0 to 1), as vLLM 0.6."),
)
LEGACY_COUNTERS = (
    ("gpu_prefix_cache_queries", "prefix_cache_queries_total", "Prompt tokens looked up, as vLLM 0.6."),
    ("gpu_prefix_cache_hits", "prefix_cache_hits_total", "Prompt tokens found in the cache, as vLLM 0.6."),
)
# vLLM's LoRA info gauge: its labels name the adapters of the running and the waiting requests
# (comma-separated) and the device's adapter slots; its value is when the stats were read.
LORA_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "num_drafts", "Sequence-steps that verified draft tokens."),
    ("spec_decode_num_draft_tokens", "num_draft_tokens", "Draft tokens proposed and verified."),
    ("spec_decode_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0)


class EngineStatsCollector:
    """Yields the engine gauges and counters from the router's workers when scraped."""

    def __init__(self, pools: dict[str, Any], prefix: str = DEFAULT_PREFIX) -> None:
        self.pools = pools
        self.prefix = prefix + ":"

    def collect(self) -> Iterator[Metric]:
        prefix = self.prefix
        workers = [w for pool in self.pools.values() for w in pool.workers]
        for name, field, doc in ENGINE_GAUGES + LEGACY_GAUGES:
            family = GaugeMetricFamily(prefix + name, doc, labels=LABELS)
            for w in workers:
                # A worker that is not serving has no running or waiting requests.
                value = getattr(w.stats, field) if w.ready and w.stats is not None else 0.0
                family.add_metric([w.model_name, w.label], float(value))
            yield family
        for name, field, doc in ENGINE_COUNTERS + LEGACY_COUNTERS:
            family = CounterMetricFamily(prefix + name, doc, labels=LABELS)
            for w in workers:
                family.add_metric([w.model_name, w.label], float(0.0 if w.stats is None else getattr(w.stats, field)))
            yield family
        hit_rate = GaugeMetricFamily(prefix + "gpu_prefix_cache_hit_rate", "Prefix-cache hits per prompt "
                                     "token looked up since start (0 to 1), as vLLM 0.6.", labels=LABELS)
        for w in workers:
            queries = 0 if w.stats is None else w.stats.prefix_cache_queries_total
            rate = w.stats.prefix_cache_hits_total / queries if queries else 0.0
            hit_rate.add_metric([w.model_name, w.label], rate)
        yield hit_rate
        yield from self._spec_decode(workers, prefix)
        ready = GaugeMetricFamily(prefix + "worker_ready", "1 when the worker serves requests.", labels=LABELS)
        for w in workers:
            ready.add_metric([w.model_name, w.label], 1.0 if w.ready else 0.0)
        yield ready
        compiled = GaugeMetricFamily(prefix + "decode_buckets_compiled", "Decode batch buckets running compiled "
                                     "or graph-captured (the others run eagerly; engines/worker/warmup.py).", labels=LABELS)
        for w in workers:
            buckets = (w.info.get("decode_graphs") or {}).get("buckets") or {}
            compiled.add_metric([w.model_name, w.label], sum(b["state"] == "compiled" for b in buckets.values()))
        yield compiled
        restarts = CounterMetricFamily(prefix + "worker_restarts", "Times the worker process was started again "
                                       "after it died.", labels=LABELS)
        for w in workers:
            restarts.add_metric([w.model_name, w.label], float(w.restarts))
        yield restarts
        yield self._lora_info(workers, prefix)

    @staticmethod
    def _lora_info(workers: list[Any], prefix: str) -> Metric:
        """vLLM's ``lora_requests_info``: per worker, its adapter slots and the adapters in use (a worker
        that is not serving: none)."""
        lora = GaugeMetricFamily(prefix + "lora_requests_info", "Running stats on LoRA requests.",
                                 labels=[*LABELS, *LORA_LABELS])
        for w in workers:
            stats = w.stats if w.ready else None
            lora.add_metric([w.model_name, w.label, str(stats.max_lora if stats else 0),
                             ",".join(stats.running_lora_adapters) if stats else "",
                             ",".join(stats.waiting_lora_adapters) if stats else ""], time.time())
        return lora


    @staticmethod
    def _spec_decode(workers: list[Any], prefix: str) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters, for the workers that speculate."""
        spec = [(w, w.stats.spec_decode) for w in workers if w.stats is not None and w.stats.spec_decode is not None]
        if not spec:
            return
        for name, field, doc in SPEC_DECODE_COUNTERS:
            family = CounterMetricFamily(prefix + name, doc, labels=LABELS)
            for w, counters in spec:
                family.add_metric([w.model_name, w.label], float(getattr(counters, field)))
            yield family
        per_pos = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by position in the draft.", labels=[*LABELS, "position"])
        for w, counters in spec:
            for position, value in enumerate(counters.accepted_per_position):
                per_pos.add_metric([w.model_name, w.label, str(position)], float(value))
        yield per_pos


class RequestMetrics:
    """Per-request histograms and the success counter, observed when a request ends."""

    def __init__(self, registry: CollectorRegistry, prefix: str = DEFAULT_PREFIX) -> None:
        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{prefix}:{name}", documentation, LABELS, buckets=buckets, registry=registry)

        self.success = Counter(
            f"{prefix}:request_success", "Finished choices by finish reason.",
            [*LABELS, "finished_reason"], registry=registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive outputs of a request.",
                             _ITL_BUCKETS)
        # vLLM's earlier name for the same observations, still read by its production stack's dashboards.
        self.tpot = histogram("time_per_output_token_seconds",
                              "Time per output token (as inter_token_latency_seconds).", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time a request waited in the engine before it ran.",
                               _LATENCY_BUCKETS)

    def observe(self, gen: Generation, end: float) -> None:
        labels = (gen.worker.model_name, gen.worker.label)
        if gen.first_token_at is not None:
            self.ttft.labels(*labels).observe(gen.first_token_at - gen.arrival)
        for histogram in (self.itl, self.tpot):
            observe_many(histogram.labels(*labels), gen.inter_token_latencies)
        if gen.queue_time is not None:
            self.queue.labels(*labels).observe(gen.queue_time)
        if gen.done:
            self.e2e.labels(*labels).observe(end - gen.arrival)
            for choice in gen.choices:
                self.success.labels(*labels, choice.finish_reason).inc()


def observe_many(histogram: Histogram, values: list[float]) -> None:
    """``histogram.observe(v)`` for each of ``values`` (a labelled child), in one pass.

    A request observes one inter-token latency per output token, twice (two names): one lock and one
    bucket walk per value were ~10% of the HTTP process's CPU per streamed token
    (benchmarks/server_path_cpu.py measures that CPU). Here each bucket gets one increment of its count. prometheus_client
    has no public bulk observe; its per-bucket (non-cumulative) counts ``_buckets``, bounds
    ``_upper_bounds`` and ``_sum`` are what ``observe`` updates (tests/server/http/test_metrics.py holds the
    two to the same exposition)."""
    if not values:
        return
    bounds = histogram._upper_bounds
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect.bisect_left(bounds, value)] += 1  # the first bucket with value <= bound, as observe
    histogram._sum.inc(sum(values))
    for bucket, count in zip(histogram._buckets, counts):
        if count:
            bucket.inc(count)


class UsageMetrics:
    """Generation requests and their tokens per ``label`` and model: ``{stem}_requests``,
    ``{stem}_prompt_tokens``, ``{stem}_generation_tokens``; ``whose`` names the label's subject in the help."""

    def __init__(self, registry: CollectorRegistry, prefix: str, stem: str, label: str, whose: str) -> None:
        labels = (label, "model_name")
        self.requests = Counter(f"{prefix}:{stem}_requests", f"Generation requests made with {whose}.", labels,
                                registry=registry)
        self.prompt_tokens = Counter(f"{prefix}:{stem}_prompt_tokens", f"Prompt tokens of {whose}'s requests.",
                                     labels, registry=registry)
        self.generation_tokens = Counter(f"{prefix}:{stem}_generation_tokens",
                                         f"Tokens generated for {whose}'s requests.", labels, registry=registry)

    def observe(self, name: str, model: str, prompt_tokens: int, generation_tokens: int) -> None:
        self.requests.labels(name, model).inc()
        self.prompt_tokens.labels(name, model).inc(prompt_tokens)
        self.generation_tokens.labels(name, model).inc(generation_tokens)


class KeyMetrics(UsageMetrics):
    """Per API key, labelled by the key's name (never the key): ``api_key_*``."""

    def __init__(self, registry: CollectorRegistry, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(registry, prefix, "api_key", "key_name", "the key")


class LoraMetrics(UsageMetrics):
    """Per LoRA adapter, labelled by its name and its base model: ``lora_*``."""

    def __init__(self, registry: CollectorRegistry, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(registry, prefix, "lora", "lora_name", "the LoRA adapter")


class LimitedKeyView:
    """``registry`` as a key limited to some models sees it: without the samples labelled with a
    ``model_name`` it may not use or with another key's ``key_name``; unlabelled series (the HTTP
    metrics) stay. A collector, so ``generate_latest(LimitedKeyView(...))`` renders it."""

    def __init__(self, registry: CollectorRegistry, models: list[str], key_name: str) -> None:
        self.registry = registry
        self.models = set(models)
        self.key_name = key_name

    def _visible(self, labels: dict[str, str]) -> bool:
        model, key = labels.get("model_name"), labels.get("key_name")
        return (model is None or model in self.models) and (key is None or key == self.key_name)

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            kept = [s for s in family.samples if self._visible(s.labels)]
            if len(kept) == len(family.samples):
                yield family
                continue
            view = Metric(family.name, family.documentation, family.type, family.unit)
            view.samples = kept
            yield view

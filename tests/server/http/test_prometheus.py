"""A real Prometheus scrapes a live xinserve: the target is up, token counters and a TTFT quantile are
queryable through Prometheus' HTTP API, and every expression of the Grafana dashboard parses, names
only metrics the server exports, and returns data.

The server names its metrics as vLLM does (``--metric-prefix vllm``): every series vLLM's production
stack reads is there under vLLM's name, and the dashboard (its ``prefix`` variable set to vllm) and the
autoscaling rules read them. The default ``xinserve:`` names are the same code with another prefix
(tests/server/http/test_metrics.py).

Prometheus is Debian's ``prometheus`` package (``.ci/run`` installs it); without it these tests fail.
"""

import json
import math
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "config" / "grafana" / "dashboards" / "xinserve.json"
ADAPTER_RULES = REPO / "deploy" / "kubernetes" / "prometheus-adapter" / "config.yaml"
KEY = "sk-prometheus-test"
PREFIX = "vllm"

pytestmark = pytest.mark.slow  # a server of its own and a Prometheus scraping it
# Grafana's variables, as Grafana would fill them in for "All" and a short range.
GRAFANA_VARIABLES = {"${prefix}": PREFIX, "$__rate_interval": "1m", "$model": ".*", "$worker": ".*"}
METRIC_NAME = re.compile(r"(?<![\w:])((?:vllm:|xinserve:|http_)[A-Za-z0-9_:]+)")
# What vLLM's production stack (router, autoscalers, dashboards) reads from a vLLM server.
VLLM_SERIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc",
               "prompt_tokens_total", "generation_tokens_total", "request_success_total",
               "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
               "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
               "request_queue_time_seconds_bucket", "num_preemptions_total", "prefix_cache_queries_total",
               "prefix_cache_hits_total", "lora_requests_info", "gpu_prefix_cache_hit_rate",
               "gpu_prefix_cache_hits_total", "gpu_prefix_cache_queries_total")


@pytest.fixture(scope="module")
def server(start_server, tiny_model_dir):
    srv = start_server(["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--cpu-threads", "1",
                        "--api-key", KEY, "--metric-prefix", PREFIX])
    srv.wait_ready()
    return srv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A running ``prometheus`` binary: its HTTP API, and waiting on it while checking it still runs."""

    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body.get('error')}"
        return body["data"]["result"]

    def value(self, expr: str) -> float:
        """The one sample's value; NaN when there is none (yet)."""
        result = self.query(expr)
        assert len(result) <= 1, result
        return float(result[0]["value"][1]) if result else math.nan

    def wait(self, check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited:\n{self.log.read_text()[-3000:]}"
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{what}: not after {timeout}s\n{self.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "the prometheus binary is missing: apt-get install prometheus (.ci/run does it)"
    root = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        # /metrics is exempt from the API key by default, as a Prometheus scraper needs.
        "scrape_configs": [{"job_name": "xinserve", "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}],
    }
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{_free_port()}"
    with open(root / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address={address}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    prom = Prometheus(f"http://{address}", proc, root / "prometheus.log")
    try:
        prom.wait(lambda: httpx.get(f"{prom.url}/-/ready", timeout=2).status_code == 200, "Prometheus ready")
        prom.wait(lambda: [s["value"][1] for s in prom.query('up{job="xinserve"}')] == ["1"], "target up")
        # Labelled series appear with their first request; rate() needs a scrape of them before more
        # traffic to see them increase, so the traffic comes in two rounds with a scrape between.
        send_traffic(server)
        prom.wait(lambda: prom.value(f"sum({PREFIX}:time_to_first_token_seconds_count)") > 0, "first round scraped")
        send_traffic(server)
        yield prom
    finally:
        proc.terminate()
        proc.wait(20)


def send_traffic(server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "the same prompt every time"}],
            "max_tokens": 8, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c:
        for _ in range(3):
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            s.read()
        assert c.post("/v1/chat/completions", json={**body, "model": "nope"}).status_code == 404


def test_prometheus_scrapes_tokens_and_ttft_quantiles(prometheus):
    # Two rounds of three 8-token chats and an 8-token stream.
    prometheus.wait(lambda: prometheus.value(f"sum({PREFIX}:generation_tokens_total)") >= 64,
                    "every generated token scraped")
    (up,) = prometheus.query('up{job="xinserve"}')
    assert up["value"][1] == "1"
    (series,) = prometheus.query(f'{PREFIX}:generation_tokens_total{{model_name="tiny"}}')
    assert series["metric"]["worker"] == "cpu"
    ttft_p50 = f"histogram_quantile(0.5, sum by (le) (rate({PREFIX}:time_to_first_token_seconds_bucket[1m])))"
    prometheus.wait(lambda: not math.isnan(prometheus.value(ttft_p50)), "a TTFT quantile")
    assert 0 < prometheus.value(ttft_p50) < 60


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    return exprs


def fill(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def exported_names(server) -> set[str]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_dashboard_expression_returns_data(prometheus):
    # Every panel shows something once the traffic has been scraped; an unknown name would be empty.
    exprs = [fill(e) for e in dashboard_expressions()]
    try:
        prometheus.wait(lambda: all(prometheus.query(e) for e in exprs), "every panel with data", timeout=30)
    except TimeoutError:
        pytest.fail(f"dashboard expressions without data: {[e for e in exprs if not prometheus.query(e)]}")


def adapter_series(query: str) -> str:
    """An adapter rule's series query as the server's prefix makes it: ``(xinserve|vllm):name`` -> vllm:name."""
    return re.sub(r"\((?:\w+\|)+\w+\):", f"{PREFIX}:", query)


def test_dashboard_and_autoscaling_name_only_exported_metrics(server, prometheus):
    exported = exported_names(server)
    dashboard = DASHBOARD.read_text().replace("${prefix}", PREFIX)
    adapter = yaml.safe_load(yaml.safe_load(ADAPTER_RULES.read_text())["data"]["config.yaml"])
    adapter_queries = [adapter_series(rule["seriesQuery"]) for rule in adapter["rules"]]
    referenced = set(METRIC_NAME.findall(dashboard)) | {n for q in adapter_queries for n in METRIC_NAME.findall(q)}
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "http_requests_total"} <= referenced
    assert referenced - exported == set()
    # Those the adapter turns into the HPA's metrics exist in Prometheus too (in a cluster the
    # ServiceMonitor adds the namespace and pod labels the adapter's series queries also ask for).
    for name in {n for q in adapter_queries for n in METRIC_NAME.findall(q)}:
        assert prometheus.query(name), name


def test_vllm_named_series_are_scraped_and_no_xinserve_engine_series_remain(server, prometheus):
    for name in VLLM_SERIES:
        prometheus.wait(lambda name=name: bool(prometheus.query(f"{PREFIX}:{name}")), name, timeout=30)
    (success,) = prometheus.query(f'sum by (finished_reason) ({PREFIX}:request_success_total{{model_name="tiny"}})')
    assert success["metric"]["finished_reason"] == "length" and float(success["value"][1]) >= 8
    (lora,) = prometheus.query(f"{PREFIX}:lora_requests_info")
    # No adapters: Prometheus stores the empty adapter lists as absent labels, as it does vLLM's.
    assert lora["metric"]["max_lora"] == "0" and lora["metric"].get("running_lora_adapters", "") == ""
    assert not [n for n in exported_names(server) if n.startswith("xinserve:")]

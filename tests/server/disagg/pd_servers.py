"""What the prefill/decode server tests share: two servers' configs, their counters, KV settling."""

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import REPO_ROOT, free_port, serve_config, wait_for

PROMPTS = [f"Prompt {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 7) for i in range(20)]
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 8}


def model_config(path: Path, role: str, **extra: Any) -> dict[str, Any]:
    transfer = {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_port": free_port(), **extra}
    return {"models": [{"name": "tiny", "path": str(path), "workers": ["cpu"], "max_model_len": 512,
                        "num_kv_blocks": 256, "kv_transfer_config": transfer}]}


def metric(server: Any, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^xinserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def settled_metric(server: Any, name: str) -> float:
    """``name`` once no stats are in flight: a worker sends the ones after an idle free at its next
    heartbeat (1 s), so two reads 1.5 s apart that agree are current."""
    value = metric(server, name)
    while True:
        time.sleep(1.5)
        value, before = metric(server, name), value
        if value == before:
            return value


def kv_settles(server: Any, timeout: float = 15.0) -> float:
    """The server's KV usage once held blocks are read or expired (its worker frees them when idle too)."""
    deadline = time.monotonic() + timeout
    while (usage := metric(server, "kv_cache_usage_perc")) and time.monotonic() < deadline:
        time.sleep(0.2)
    return usage


def completion(url: str, prompt: str, **fields: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": prompt, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@contextmanager
def vllm_proxy(prefill_url: str, decode_url: str, log_dir: Path) -> Iterator[str]:
    """The vLLM-protocol proxy (``python -m xinserve.server.disagg.proxy``) in front of the two servers:
    its URL once it answers /health; stopped after."""
    port = free_port()
    with open(log_dir / "proxy.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "xinserve.server.disagg.proxy", "--prefill", prefill_url,
                                 "--decode", decode_url, "--port", str(port)], cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def check_twenty_prompts(prefill: Any, decode: Any, url: str) -> None:
    """PROMPTS through ``url`` (a proxy or gateway in front of the pair) answer as the prefill server alone
    does, the decode server computes only each prompt's last token, and no KV block stays used."""
    single = [completion(prefill.url, p)["choices"][0] for p in PROMPTS]  # the prefill server alone
    computed = metric(decode, "prompt_tokens_computed_total")
    through = [completion(url, p)["choices"][0] for p in PROMPTS]
    assert [(c["text"], c["finish_reason"]) for c in through] == [(c["text"], c["finish_reason"]) for c in single]
    assert metric(decode, "prompt_tokens_computed_total") - computed == len(PROMPTS)  # each prompt's last token
    assert kv_settles(prefill) == 0 and kv_settles(decode) == 0


def pd_server(start_server: Any, path: Path, tmp_path_factory: Any, role: str, **extra_config: Any) -> Any:
    """A prefill (``kv_producer``) or decode (``kv_consumer``) server of the model at ``path``."""
    config = model_config(path, role, kv_connector_extra_config=extra_config)
    return serve_config(start_server, tmp_path_factory.mktemp(role), config)


@contextmanager
def sglang_gateway(prefill: Any, decode: Any, log_dir: Path) -> Iterator[str]:
    """The real SGLang model gateway in PD mode (``sglang-router launch --pd-disaggregation``) in front of
    the two servers, the prefill's bootstrap port read from its ``/server_info``: its URL once it answers."""
    info = httpx.get(f"{prefill.url}/server_info", timeout=10).json()
    assert info["disaggregation_mode"] == "prefill"
    assert httpx.get(f"{decode.url}/server_info", timeout=10).json()["disaggregation_mode"] == "decode"
    port = free_port()
    log_path = log_dir / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("sglang-router")), "launch", "--host", "127.0.0.1", "--port",
             str(port), "--pd-disaggregation", "--prefill", prefill.url, str(info["disaggregation_bootstrap_port"]),
             "--decode", decode.url, "--policy", "round_robin", "--health-check-interval-secs", "1",
             "--log-level", "info", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def serves() -> bool:
        try:
            return httpx.post(f"{url}/v1/completions", json={**GREEDY, "prompt": "warm up"}, timeout=60).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        assert wait_for(serves, timeout=90, interval=0.5), log_path.read_text()[-3000:]
        yield url
    finally:
        proc.terminate()
        proc.wait(10)

"""The warm path end to end (engines/compile/, engines/worker/warmup.py, server/cli/warmup.py): a server
with ``--ready-when-warm`` stays 503 "starting" with the warm-up's progress on /health until its decode
buckets are compiled (in the compile child) and loaded, then answers; ``xinserve warmup`` on the same
caches finds every bucket done; a default (ready-first) server on them is settled at its first 200."""

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import REPO_ROOT

FLAGS = ["--max-num-seqs", "2", "--max-model-len", "64", "--block-size", "4", "--num-kv-blocks", "40",
         "--compile", "on"]


def decode_graphs(health: dict) -> dict:
    return (health["workers"][0].get("info") or {}).get("decode_graphs") or {}


@pytest.mark.slow
def test_ready_when_warm_then_warmup_then_a_warm_start(start_server, tiny_models, tmp_path):
    model = tiny_models("llama", num_layers=1, max_position_embeddings=64)
    env = {"XINSERVE_CACHE_DIR": str(tmp_path / "cache")}
    server = start_server(["--model", str(model), *FLAGS, "--ready-when-warm"], env)
    starting = []  # /health bodies while the worker warmed up
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log()[-3000:]
        try:
            response = httpx.get(f"{server.url}/health", timeout=5)
        except httpx.HTTPError:
            time.sleep(0.2)
            continue
        if response.status_code == 200:
            break
        health = response.json()
        assert response.status_code == 503 and health["workers"][0]["state"] == "starting"
        if decode_graphs(health):
            starting.append(decode_graphs(health))
        time.sleep(0.2)
    health = response.json()
    assert response.status_code == 200, server.log()[-3000:]
    graphs = decode_graphs(health)
    assert graphs["settled"] and graphs["progress"] == {"phase": "settled", "done": 2, "total": 2}
    assert {b["state"] for b in graphs["buckets"].values()} == {"compiled"}, graphs
    # Seen while starting: the warm-up's progress, not settled
    assert starting and all(not g["settled"] and g["progress"]["phase"] in ("compiling", "loading") for g in starting)
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": health["workers"][0]["model"], "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert chat.status_code == 200, chat.text
    server.stop()

    warmup = subprocess.run([sys.executable, "-m", "xinserve.server.cli", "warmup", "--model", str(model), *FLAGS],
                            check=False, cwd=REPO_ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
                            capture_output=True, text=True, timeout=600)
    assert warmup.returncode == 0, warmup.stderr[-3000:]
    assert "bucket 1 compiled, bucket 2 compiled" in warmup.stdout
    assert "compiling decode buckets" not in warmup.stderr  # all on disk: no compile child

    warm = start_server(["--model", str(model), *FLAGS], env)  # ready first, by default
    graphs = decode_graphs(warm.wait_ready())
    assert graphs["settled"] and {b["state"] for b in graphs["buckets"].values()} == {"compiled"}, graphs

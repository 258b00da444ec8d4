"""``xinserve bench`` end to end against a live server: two concurrencies in one run over a dataset
with categories, an open-loop run, the JSON document, and PNG plots of one and of two servers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from tests.server.conftest import KEY_A

REPO = Path(__file__).resolve().parents[2]
PNG_SIZE = (1100, 750)  # figsize 11 x 7.5 inches at 100 dpi


@pytest.fixture(scope="module")
def server(keyed_server):
    """The session's keyed two-model server; the bench runs as team-a, whose key sees only "tiny"."""
    return keyed_server


def xinserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False, env={**os.environ, "XINSERVE_API_KEY": KEY_A})


def test_levels_categories_json_and_plot(server, tmp_path):
    data = tmp_path / "mixed.jsonl"
    made = subprocess.run([sys.executable, str(REPO / "benchmarks" / "make_dataset.py"), "--out", str(data),
                           "--per-category", "2", "--long-tokens", "1500"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert made.returncode == 0, made.stderr
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    proc = xinserve("bench", "--base-url", f"{server.url}/v1", "--dataset", str(data), "--concurrency", "1,4",
                    "--output-tokens", "6", "--label", "xinserve", "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| category | requests | success |" in proc.stdout and "| long | 2 | 100.0% |" in proc.stdout
    assert "TTFT mean / p50 / p90 / p95 / p99 (ms)" in proc.stdout
    assert "| xinserve | c=4 | 100.0% |" in proc.stdout  # the table of both levels

    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and "api_key" not in result["config"]
    assert [(r["concurrency"], r["request_rate"]) for r in result["runs"]] == [(1, None), (4, None)]
    for run in result["runs"]:
        assert (run["requests"], run["successful"], run["success_rate"]) == (6, 6, 1.0)
        assert run["output_tokens"] == 6 * 6  # ignore_eos: exactly what was asked, counted from usage
        assert set(run["categories"]) == {"short", "long", "multi-turn"}
        long_prompts = run["categories"]["long"]["prompt_tokens"] / 2
        assert 1400 < long_prompts < 1600 and run["categories"]["short"]["prompt_tokens"] / 2 < 100
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            d = run[key]
            assert 0 < d["p50"] <= d["p90"] <= d["p95"] <= d["p99"], key
        assert run["ttft_ms"]["p50"] < run["e2e_ms"]["p50"]
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == PNG_SIZE


@pytest.mark.slow
def test_open_loop_and_a_plot_of_two_servers(server, tmp_path):
    a = tmp_path / "rate.json"
    proc = xinserve("bench", "--base-url", f"{server.url}/v1", "--request-rate", "20,40", "--num-prompts", "6",
                    "--output-tokens", "4", "--json", str(a))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(a.read_text())
    assert [(r["concurrency"], r["request_rate"], r["successful"]) for r in result["runs"]] == [
        (None, 20.0, 6), (None, 40.0, 6)]
    b = tmp_path / "other.json"
    b.write_text(json.dumps({**result, "label": "another server"}))
    png = tmp_path / "two.png"
    proc = xinserve("bench", "plot", str(a), str(b), "--out", str(png))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with Image.open(png) as image:
        assert image.size == PNG_SIZE


def test_failed_requests_make_the_exit_status_1(server, tmp_path):
    # A model the server does not have: every request is a 404, counted, none crash the bench.
    out = tmp_path / "fail.json"
    proc = xinserve("bench", "--base-url", f"{server.url}/v1", "--model", "nope", "--num-prompts", "3",
                    "--concurrency", "2", "--json", str(out))
    assert proc.returncode == 1
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["successful"], run["failed"], run["success_rate"]) == (0, 3, 0.0)
    assert run["errors"][0]["count"] == 3 and run["errors"][0]["error"].startswith("HTTP 404")

"""``xinserve bench`` end to end against a live server: two concurrencies in one run over a dataset
with categories, an open-loop run, the JSON document, and PNG plots of one and of two servers.

The command runs in this process (``xinserve.server.cli.main.main``, what ``python -m xinserve.server.cli`` calls before it
exits): a subprocess would import torch again for each run, ~7 CPU s quiet and ~14 under load, for a
load generator that never uses it. ``tests/engines/worker/test_process_exit.py`` runs the real command."""

import json

import pytest
from PIL import Image

from benchmarks import make_dataset
from tests.server.conftest import KEY_A
from xinserve.server.cli.main import main

PNG_SIZE = (1100, 750)  # figsize 11 x 7.5 inches at 100 dpi


@pytest.fixture(scope="module")
def server(keyed_server):
    """The session's keyed two-model server; the bench runs as team-a, whose key sees only "tiny"."""
    return keyed_server


@pytest.fixture
def xinserve(monkeypatch, capsys):
    """``xinserve(*args) -> (exit status, stdout, stderr)`` of ``xinserve ARGS``, with team-a's key in
    ``XINSERVE_API_KEY``."""
    monkeypatch.setenv("XINSERVE_API_KEY", KEY_A)

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()  # what came before is not this run's
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_levels_categories_json_and_plot(server, xinserve, tmp_path):
    data = tmp_path / "mixed.jsonl"
    make_dataset.main(["--out", str(data), "--per-category", "2", "--long-tokens", "1500"])
    assert data.stat().st_size > 0
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    code, stdout, stderr = xinserve("bench", "--base-url", f"{server.url}/v1", "--dataset", str(data), "--concurrency", "1,4",
                    "--output-tokens", "6", "--label", "xinserve", "--json", str(out), "--plot", str(png))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "| category | requests | success |" in stdout and "| long | 2 | 100.0% |" in stdout
    assert "TTFT mean / p50 / p90 / p95 / p99 (ms)" in stdout
    assert "| xinserve | c=4 | 100.0% |" in stdout  # the table of both levels

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
        # the load generator's own CPU over the level: some, and no more than its two cores' worth
        assert 0 < run["client_cpu_s"] <= 2 * run["duration_s"] + 0.1
    assert "Load generator CPU (s)" in stdout
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == PNG_SIZE


@pytest.mark.slow
def test_open_loop_and_a_plot_of_two_servers(server, xinserve, tmp_path):
    a = tmp_path / "rate.json"
    code, stdout, stderr = xinserve("bench", "--base-url", f"{server.url}/v1", "--request-rate", "20,40", "--num-prompts", "6",
                    "--output-tokens", "4", "--json", str(a))
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    result = json.loads(a.read_text())
    assert [(r["concurrency"], r["request_rate"], r["successful"]) for r in result["runs"]] == [
        (None, 20.0, 6), (None, 40.0, 6)]
    b = tmp_path / "other.json"
    b.write_text(json.dumps({**result, "label": "another server"}))
    png = tmp_path / "two.png"
    code, _, stderr = xinserve("bench", "plot", str(a), str(b), "--out", str(png))
    assert code == 0, stderr[-3000:]
    with Image.open(png) as image:
        assert image.size == PNG_SIZE


def test_failed_requests_make_the_exit_status_1(server, xinserve, tmp_path):
    # A model the server does not have: every request is a 404, counted, none crash the bench.
    out = tmp_path / "fail.json"
    code, _, _ = xinserve("bench", "--base-url", f"{server.url}/v1", "--model", "nope", "--num-prompts", "3",
                          "--concurrency", "2", "--json", str(out))
    assert code == 1
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["successful"], run["failed"], run["success_rate"]) == (0, 3, 0.0)
    assert run["errors"][0]["count"] == 3 and run["errors"][0]["error"].startswith("HTTP 404")

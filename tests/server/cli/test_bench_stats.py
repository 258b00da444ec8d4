"""The bench's numbers without a server: percentiles of known samples, token accounting from the
stream's ``usage``, failures counted and kept out of the latencies, per-category tables, and how
load levels send (concurrency cap, Poisson arrivals)."""

import asyncio
import json
import math
import random
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from xinserve.server.cli.bench import dataset, report
from xinserve.server.cli.bench.client import RequestResult, one_request
from xinserve.server.cli.bench.load import Level, levels, run_level
from xinserve.server.cli.bench.stats import by_category, distribution, summarize


def test_percentiles_of_known_samples():
    d = distribution([float(v) for v in range(1, 101)])  # 1..100, linear interpolation between ranks
    assert d == pytest.approx({"mean": 50.5, "p50": 50.5, "p90": 90.1, "p95": 95.05, "p99": 99.01})
    assert distribution([7.0]) == {"mean": 7.0, "p50": 7.0, "p90": 7.0, "p95": 7.0, "p99": 7.0}
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}


def test_summary_counts_failures_and_keeps_them_out_of_latencies_and_tokens():
    results = [
        RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, latency=0.5, itls=[0.1] * 4),
        RequestResult(ok=True, prompt_tokens=20, output_tokens=3, ttft=0.3, latency=0.7, itls=[0.2, 0.2]),
        RequestResult(ok=False, prompt_tokens=99, output_tokens=99, ttft=9, latency=9, error="HTTP 503: busy"),
        RequestResult(ok=False, error="HTTP 503: busy"),
        RequestResult(ok=False, error="ReadTimeout: "),
    ]
    s = summarize(results, duration=2.0)
    assert (s["requests"], s["successful"], s["failed"], s["success_rate"]) == (5, 2, 3, 0.4)
    assert (s["prompt_tokens"], s["output_tokens"]) == (30, 8)
    assert s["output_throughput_tok_s"] == 4.0 and s["total_throughput_tok_s"] == 19.0
    assert s["request_throughput_per_s"] == 1.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["e2e_ms"]["p50"] == pytest.approx(600.0)
    # TPOT: (0.5 - 0.1) / 4 and (0.7 - 0.3) / 2 seconds per token after the first.
    assert s["tpot_ms"]["p50"] == pytest.approx(150.0) and s["tpot_ms"]["p99"] == pytest.approx(199.0)
    assert s["itl_ms"]["mean"] == pytest.approx(1000 * 0.8 / 6)
    assert s["errors"] == [{"error": "HTTP 503: busy", "count": 2}, {"error": "ReadTimeout: ", "count": 1}]


def test_a_run_where_everything_failed_has_no_latencies():
    s = summarize([RequestResult(ok=False, error="x")], duration=0.0)
    assert s["success_rate"] == 0.0 and s["ttft_ms"]["p99"] is None and s["output_throughput_tok_s"] == 0.0
    assert "| - |" in report.category_table(by_category([RequestResult(ok=False, category="c")]))


def test_per_category_table():
    results = [
        RequestResult(ok=True, category="short", prompt_tokens=5, output_tokens=4, ttft=0.01, latency=0.05),
        RequestResult(ok=True, category="short", prompt_tokens=6, output_tokens=4, ttft=0.03, latency=0.07),
        RequestResult(ok=True, category="long", prompt_tokens=1800, output_tokens=4, ttft=0.5, latency=0.6),
        RequestResult(ok=False, category="long", error="HTTP 400: context"),
    ]
    table = by_category(results)
    assert list(table) == ["long", "short"]
    assert (table["long"]["requests"], table["long"]["successful"], table["long"]["success_rate"]) == (2, 1, 0.5)
    assert table["short"]["prompt_tokens"] == 11 and table["short"]["output_tokens"] == 8
    assert table["short"]["ttft_ms"]["p50"] == pytest.approx(20.0)
    assert table["long"]["e2e_ms"]["p99"] == pytest.approx(600.0)
    text = report.category_table(table)
    assert "| long | 2 | 50.0% | 1800 | 4 | 500.00 |" in text
    assert "| short | 2 | 100.0% | 11 | 8 | 20.00 |" in text


def sse(*frames) -> bytes:
    return b"".join(b"data: " + (f if isinstance(f, bytes) else json.dumps(f).encode()) + b"\n\n" for f in frames)


def chunk(text: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if text is None else [{"index": 0, "delta": {"content": text}}]
    return {"choices": choices, **({"usage": usage} if usage else {})}


def send(status: int, body: bytes, chunk_size: int = 7) -> RequestResult:
    """``one_request`` against a real local HTTP server that answers ``status`` and streams ``body`` in
    pieces of ``chunk_size`` bytes (lines split across reads, as a network splits them)."""
    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=status)
        await response.prepare(request)
        for i in range(0, len(body), chunk_size):
            await response.write(body[i:i + chunk_size])
        await response.write_eof()
        return response

    async def go() -> RequestResult:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            return await one_request(session, str(server.make_url("/v1/chat/completions")), {}, "cat")

    return asyncio.run(go())


def test_tokens_come_from_usage_not_from_chunks():
    # Two chunks of text carried seven tokens: the usage chunk is what counts.
    body = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, chunk("ab"), chunk("cd"),
               chunk(usage={"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}), b"[DONE]")
    r = send(200, body)
    assert r.ok and (r.prompt_tokens, r.output_tokens, r.category) == (11, 7, "cat")
    assert len(r.itls) == 1 and 0 < r.ttft <= r.latency
    # Without usage, one token per chunk with text (the role-only first chunk is not text).
    r = send(200, sse(chunk(""), chunk("a"), chunk("b"), chunk("c"), b"[DONE]"))
    assert r.ok and (r.prompt_tokens, r.output_tokens) == (0, 3)


def test_failures_are_results_not_exceptions():
    r = send(429, json.dumps({"error": {"message": "queue full"}}).encode())
    assert not r.ok and r.error.startswith("HTTP 429") and "queue full" in r.error
    r = send(200, sse(chunk("a"), {"error": {"message": "worker died"}}, b"[DONE]"))
    assert not r.ok and r.error == "stream error: worker died"
    r = send(200, b"data: {not json\n\n")
    assert not r.ok and r.error.startswith("JSONDecodeError")

    async def refused() -> RequestResult:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        async with aiohttp.ClientSession() as session:
            return await one_request(session, f"http://127.0.0.1:{port}/v1/chat/completions", {})

    r = asyncio.run(refused())
    assert not r.ok and r.error.startswith("ClientConnectorError")


def test_levels():
    assert levels(None, None) == [Level(8, math.inf)]
    assert [lv.label for lv in levels([1, 8], None)] == ["c=1", "c=8"]
    assert [lv.label for lv in levels(None, [2.0, 4.5])] == ["2 req/s", "4.5 req/s"]
    assert [lv.label for lv in levels([4], [2.0])] == ["c=4 2 req/s"]


def test_closed_loop_keeps_at_most_concurrency_in_flight():
    in_flight, peak = 0, 0

    async def fake(i: int) -> RequestResult:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return RequestResult(ok=True, output_tokens=i)

    results, _ = asyncio.run(run_level(fake, list(range(20)), Level(3, math.inf), seed=0))
    assert peak == 3 and [r.output_tokens for r in results] == list(range(20))


def test_open_loop_sends_at_poisson_arrival_times():
    sent = []

    async def fake(i: int) -> RequestResult:
        sent.append(time.perf_counter())
        return RequestResult(ok=True)

    rate, n = 100.0, 20
    asyncio.run(run_level(fake, list(range(n)), Level(None, rate), seed=3))
    rng = random.Random(3)
    gaps = [rng.expovariate(rate) for _ in range(n - 1)]
    # Each request goes out no earlier than the seeded arrival process says (sleeps only overshoot).
    assert sent[-1] - sent[0] >= 0.95 * sum(gaps)


def test_dataset_lines_and_payloads(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hi", "category": "short", "max_tokens": 3}\n\n'
                    '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},'
                    ' {"role": "user", "content": "c"}], "category": "multi-turn"}\n')
    short, multi = dataset.load_jsonl(path)
    assert dataset.take([short, multi], 5) == [short, multi, short, multi, short]
    body = dataset.payload(short, "m", "completions", 64, ignore_eos=True)
    assert (body["prompt"], body["max_tokens"], body["ignore_eos"], body["stream"]) == ("hi", 3, True, True)
    body = dataset.payload(multi, "m", "chat", 64, ignore_eos=False)
    assert len(body["messages"]) == 3 and body["max_tokens"] == 64 and "ignore_eos" not in body
    with pytest.raises(ValueError, match="chat endpoint"):
        dataset.payload(multi, "m", "completions", 64, ignore_eos=True)
    for bad, message in (('{"prompt": "a", "messages": []}', "exactly one"), ("{", "not JSON"),
                         ('{"prompt": "a", "max_tokens": 0}', "positive integer")):
        path.write_text('{"prompt": "ok"}\n' + bad + "\n")
        with pytest.raises(ValueError, match=f"d.jsonl:2: .*{message}"):
            dataset.load_jsonl(path)

"""``xinserve bench --endpoint embeddings``: embeddings per second against the batch size (inputs per
``/v1/embeddings`` request). One level per ``--batch-size`` (1,8,32,128 by default): ``--num-prompts``
requests (default 16) of that many random-word inputs, ``--concurrency`` in flight (its first value,
default 1); per level the requests, failures, embeddings/s, prompt tokens/s and the latency
percentiles of a request."""

import argparse
import asyncio
import random
import time
from typing import Any

import aiohttp

from xinserve.server.cli.bench.dataset import random_words
from xinserve.server.cli.bench.stats import distribution

DEFAULT_BATCH_SIZES = [1, 8, 32, 128]


async def _one(client: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> tuple[bool, float, int]:
    """(ok, seconds, prompt tokens) of one request; an error status or a broken body is a failure."""
    start = time.perf_counter()
    try:
        async with client.post(url, json=payload) as response:
            body = await response.json(content_type=None)
            ok = response.status == 200 and len(body.get("data", [])) == len(payload["input"])
            tokens = body.get("usage", {}).get("prompt_tokens", 0) if ok else 0
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        ok, tokens = False, 0
    return ok, time.perf_counter() - start, tokens


async def _level(client: aiohttp.ClientSession, url: str, model: str, batch: int, args: argparse.Namespace,
                 rng: random.Random) -> dict[str, Any]:
    requests = args.num_prompts or 16
    concurrency = args.concurrency[0] if args.concurrency else 1
    payloads = [{"model": model, "input": [random_words(rng, args.input_words) for _ in range(batch)]}
                for _ in range(requests)]
    gate = asyncio.Semaphore(concurrency)

    async def send(payload: dict[str, Any]) -> tuple[bool, float, int]:
        async with gate:
            return await _one(client, url, payload)

    start = time.perf_counter()
    results = await asyncio.gather(*(send(p) for p in payloads))
    duration = time.perf_counter() - start
    ok = [r for r in results if r[0]]
    return {
        "batch_size": batch, "concurrency": concurrency, "requests": requests, "failed": requests - len(ok),
        "duration_s": duration,
        "embeddings_per_s": len(ok) * batch / duration if duration > 0 else 0.0,
        "prompt_tokens_per_s": sum(r[2] for r in ok) / duration if duration > 0 else 0.0,
        "latency_ms": distribution([r[1] * 1000 for r in ok]),
    }


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| batch | requests | failed | embeddings/s | prompt tok/s | p50 ms | p99 ms |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lat = r["latency_ms"]
        cells = [r["batch_size"], r["requests"], r["failed"], f"{r['embeddings_per_s']:.1f}",
                 f"{r['prompt_tokens_per_s']:.0f}", *(f"{lat[k]:.1f}" if lat[k] is not None else "-" for k in ("p50", "p99"))]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


async def embeddings_benchmark(client: aiohttp.ClientSession, base: str, model: str,
                               args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every batch-size level against ``base``/embeddings, each printed as it ends."""
    rng = random.Random(args.seed)
    runs = []
    for batch in args.batch_size or DEFAULT_BATCH_SIZES:
        run = await _level(client, f"{base}/embeddings", model, batch, args, rng)
        print(table([run]).splitlines()[-1] if runs else table([run]))
        runs.append(run)
    return runs

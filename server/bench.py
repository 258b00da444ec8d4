"""``xinserve bench``: a streaming load generator against any OpenAI-compatible server.

It sends ``--num-prompts`` chat (or completion) requests, at most ``--concurrency`` at a time, each
asking for exactly ``--output-tokens`` tokens (``ignore_eos``, a vLLM extension, unless
``--no-ignore-eos``), and prints TTFT / TPOT / ITL / end-to-end latency and throughput.
"""

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

_WORDS = (
    "river", "harbour", "library", "morning", "bread", "market", "window", "garden", "silver", "letter",
    "mountain", "valley", "engine", "signal", "kitchen", "winter", "summer", "station", "ladder",
    "candle", "island", "forest", "bridge", "pocket", "shadow", "lantern", "thunder", "meadow",
    "compass", "anchor", "velvet", "marble", "saddle", "orchard", "whistle", "feather",
)


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="server URL including /v1")
    p.add_argument("--model", help="model name (default: the first of GET /models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-words", type=int, default=32, help="words per random prompt")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send vLLM's ignore_eos")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", dest="json_path", help="also write the results as JSON here")


def make_prompts(num: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(num)]


def _payload(args: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not args.no_ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _chunk_has_text(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            return True
    return False


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    text_chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "stream error")
                    return result
                now = time.perf_counter()
                if _chunk_has_text(chunk):
                    text_chunks += 1
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or text_chunks
    result.ok = True
    return result


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    ttfts = [r.ttft * 1000 for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1000 for r in ok if r.output_tokens > 1]
    itls = [x * 1000 for r in ok for x in r.itls]
    e2es = [r.latency * 1000 for r in ok]
    summary: dict[str, Any] = {
        "requests_ok": len(ok),
        "requests_failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput_per_s": len(ok) / duration if duration else 0.0,
        "output_tokens": out_tokens,
        "prompt_tokens": in_tokens,
        "output_throughput_tok_s": out_tokens / duration if duration else 0.0,
        "total_throughput_tok_s": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    for name, values in (("ttft_ms", ttfts), ("tpot_ms", tpots), ("itl_ms", itls), ("e2e_ms", e2es)):
        summary[name] = {
            "mean": statistics.fmean(values) if values else 0.0,
            "p50": _pct(values, 50),
            "p90": _pct(values, 90),
            "p99": _pct(values, 99),
        }
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def print_summary(summary: dict[str, Any], title: str) -> None:
    print(f"==== {title} ====")
    rows = [
        ("Successful requests", f"{summary['requests_ok']}"),
        ("Failed requests", f"{summary['requests_failed']}"),
        ("Duration (s)", f"{summary['duration_s']:.2f}"),
        ("Request throughput (req/s)", f"{summary['request_throughput_per_s']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput_tok_s']:.1f}"),
        ("Total token throughput (tok/s)", f"{summary['total_throughput_tok_s']:.1f}"),
    ]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        s = summary[key]
        rows.append((f"{label} mean / p50 / p99 (ms)", f"{s['mean']:.2f} / {s['p50']:.2f} / {s['p99']:.2f}"))
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    for err in summary.get("errors", []):
        print(f"error: {err}")


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=args.concurrency + 2, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model
        if model is None:
            response = await client.get(f"{base}/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        url = f"{base}/chat/completions" if args.endpoint == "chat" else f"{base}/completions"
        prompts = make_prompts(args.num_prompts, args.input_words, args.seed)
        semaphore = asyncio.Semaphore(args.concurrency)

        async def limited(prompt: str) -> RequestResult:
            async with semaphore:
                return await one_request(client, url, _payload(args, model, prompt))

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - start
    summary = summarize(list(results), duration)
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")} | {"model": model}
    return summary


def header(args: argparse.Namespace, model: str) -> str:
    """The table's title; the concurrency is what the run reached (never more than the prompts)."""
    concurrency = min(args.concurrency, args.num_prompts)
    return (f"{model} @ {args.base_url}: {args.num_prompts} prompts, concurrency {concurrency}, "
            f"{args.output_tokens} output tokens")


def run(args: argparse.Namespace) -> int:
    try:
        summary = asyncio.run(_bench(args))
    except httpx.HTTPError as exc:
        print(f"xinserve bench: cannot reach {args.base_url}: {exc}")
        return 1
    print_summary(summary, header(args, summary["config"]["model"]))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(summary, indent=2, default=str))
    return 0 if summary["requests_failed"] == 0 else 1

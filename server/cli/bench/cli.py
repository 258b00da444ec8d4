"""``xinserve bench`` options and the run: every load level in turn against one server, then the
tables, the JSON document and the plot. ``xinserve bench plot A.json B.json --out x.png`` draws
saved runs of several servers into one figure."""

import argparse
import asyncio
import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any

import aiohttp

from xinserve.server.cli.bad_input import BadInput, read_text
from xinserve.server.cli.bench import dataset, report
from xinserve.server.cli.bench.client import RequestResult, one_request
from xinserve.server.cli.bench.embeddings import embeddings_benchmark
from xinserve.server.cli.bench.load import Level, levels, run_level
from xinserve.server.cli.bench.plot import plot
from xinserve.server.cli.bench.stats import by_category, summarize


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,32, got {text!r}")
    return values


def _rates(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers like 2,4.5, got {text!r}")
    return values


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="server URL including /v1")
    p.add_argument("--model", help="model name (default: the first of GET /models)")
    p.add_argument("--api-key", default=os.environ.get("XINSERVE_API_KEY"),
                   help="sent as a bearer token (default: $XINSERVE_API_KEY)")
    p.add_argument("--endpoint", choices=["chat", "completions", "embeddings"], default="chat",
                   help="embeddings: /v1/embeddings at each --batch-size (server/cli/bench/embeddings.py)")
    p.add_argument("--batch-size", type=_ints, help="embeddings: inputs per request, one level each (default 1,8,32,128)")
    p.add_argument("--num-prompts", type=int, help="requests per load level (default: 64, or the dataset's size)")
    p.add_argument("--concurrency", type=_ints, help="requests in flight, one level each: 1,8,32 (default 8)")
    p.add_argument("--request-rate", type=_rates,
                   help="open loop: Poisson arrivals per second, one level each (capped by --concurrency if given)")
    p.add_argument("--dataset", help="JSONL of {prompt | messages, category?, max_tokens?} (default: random words)")
    p.add_argument("--input-words", type=int, default=32, help="words per random prompt")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--no-ignore-eos", action="store_true", help="do not send vLLM's ignore_eos")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--label", help="this server's name in tables and plots (default: the base URL)")
    p.add_argument("--json", dest="json_path", help="write the results here")
    p.add_argument("--plot", help="draw throughput and latency percentiles against load into this PNG")
    sub = p.add_subparsers(dest="bench_command")
    plot = sub.add_parser("plot", help="draw saved --json results of one or more servers into one PNG")
    plot.add_argument("results", nargs="+", help="xinserve bench --json files, one line per file")
    plot.add_argument("--out", required=True, help="the PNG to write")


def _prompts(args: argparse.Namespace) -> list[dataset.Prompt]:
    if args.dataset:
        rows = dataset.load_jsonl(args.dataset)
        return dataset.take(rows, args.num_prompts or len(rows))
    return dataset.random_prompts(args.num_prompts or 64, args.input_words, args.seed)


def _level_run(level: Level, results: list[RequestResult], duration: float, client_cpu_s: float) -> dict[str, Any]:
    run = {"label": level.label, "concurrency": level.concurrency,
           "request_rate": None if math.isinf(level.request_rate) else level.request_rate}
    run.update(summarize(results, duration))
    # The load generator's own CPU over the level: on a machine it shares with the server, every
    # second of it is taken from the server being measured.
    run["client_cpu_s"] = client_cpu_s
    if any(r.category for r in results):
        run["categories"] = by_category(results)
    return run


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Every load level against ``args.base_url``, printed as it ends; the JSON document."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    prompts = _prompts(args)
    plan = levels(args.concurrency, args.request_rate)
    caps = [lv.concurrency or len(prompts) for lv in plan]
    connector = aiohttp.TCPConnector(limit=max(caps) + 2)
    # --timeout bounds connecting and each wait for bytes (as httpx's did), not a whole stream
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=args.timeout, sock_read=args.timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as client:
        model = args.model
        if model is None:
            async with client.get(f"{base}/models", raise_for_status=True) as response:
                model = (await response.json())["data"][0]["id"]
        if args.endpoint == "embeddings":
            return {"label": args.label or args.base_url, "model": model, "machine": machine(), "mode": "embeddings",
                    "config": _config(args), "runs": await embeddings_benchmark(client, base, model, args)}
        url = f"{base}/chat/completions" if args.endpoint == "chat" else f"{base}/completions"
        # Built before any is sent, so a dataset that does not fit the endpoint fails at once.
        requests = [(dataset.payload(p, model, args.endpoint, args.output_tokens, not args.no_ignore_eos),
                     p.category) for p in prompts]

        async def send(request: tuple[dict[str, Any], str | None]) -> RequestResult:
            return await one_request(client, url, *request)

        runs = []
        for level in plan:
            cpu = time.process_time()
            results, duration = await run_level(send, requests, level, args.seed)
            run = _level_run(level, results, duration, time.process_time() - cpu)
            print(report.level_block(run))
            if "categories" in run:
                print(report.category_table(run["categories"]))
            runs.append(run)
    return {"label": args.label or args.base_url, "model": model, "machine": machine(),
            "config": _config(args), "runs": runs}


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k not in ("api_key", "bench_command")}


def machine() -> dict[str, Any]:
    """Where the load generator ran (with a local server: where the server ran too)."""
    return {"cpus": os.cpu_count(), "processor": _cpu_model() or platform.machine(),
            "platform": platform.platform(), "python": platform.python_version()}


def _cpu_model() -> str | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux
        return platform.processor() or None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)


def _results(path: str) -> dict[str, Any]:
    """A saved ``--json`` result; BadInput naming the file when it is not one."""
    try:
        result = json.loads(read_text(path, "results file"))
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(result, dict) or not isinstance(result.get("runs"), list):
        raise BadInput(f"{path}: not the JSON of xinserve bench --json (no 'runs')")
    return result


def run(args: argparse.Namespace) -> int:
    if args.bench_command == "plot":
        results = [_results(path) for path in args.results]
        print(f"wrote {plot(results, args.out)}")
        return 0
    try:
        result = asyncio.run(benchmark(args))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        print(f"xinserve bench: cannot reach {args.base_url}: {exc}")
        return 1
    if len(result["runs"]) > 1 and result.get("mode") != "embeddings":
        print(report.levels_table([result]))
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=2, default=str))
    if args.plot and result.get("mode") != "embeddings":
        print(f"wrote {plot([result], args.plot)}")
    return 0 if all(r["failed"] == 0 for r in result["runs"]) else 1

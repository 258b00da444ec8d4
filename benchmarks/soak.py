"""Soak test: many requests against a live server, some dropped mid-stream, some malformed.

Sends ``--requests`` requests (default 2,000), ``--concurrency`` at a time (default 64): chat and
completions, streamed or not, short outputs; ``--disconnect-frac`` of them (10%) are streams the
client drops after a few chunks, ``--malformed-frac`` (5%) are bodies the server must refuse with a
4xx (bad JSON, wrong types, out-of-range values, over-limit stop strings, unknown model).

Afterwards it waits for the server to go idle and prints the success rate, the 4xx and 5xx counts,
KV-cache usage and running/waiting requests (from /metrics), and the resident memory of the server
and of each worker (/proc/PID/status VmRSS) before and after. Writes benchmarks/results/soak.json.
Exits 1 when any request got a 5xx or the server did not go idle.

Run against a running server:  python benchmarks/soak.py --base-url http://127.0.0.1:8000 --server-pid PID
Or let it start one:           python benchmarks/soak.py --start [--model DIR]   (default: embedded tiny)

The committed result (the embedded tiny model): ``python benchmarks/soak.py --start --requests 300``.
Smoke run: ``python benchmarks/soak.py --start --requests 40 --concurrency 8 --max-tokens 8 --out /tmp/soak.json``.
"""

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from common import RESULTS, ROOT
from prometheus_client.parser import text_string_to_metric_families

from xinserve.server.cli.bench import launch

GAUGES = ("xinserve:kv_cache_usage_perc", "xinserve:num_requests_running", "xinserve:num_requests_waiting")
WORDS = ("river", "harbour", "library", "morning", "bread", "market", "window", "garden", "silver", "letter")

DISCONNECT_TOKENS = 256  # a dropped stream is aborted by the server, so this costs little


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--disconnect-frac", type=float, default=0.10, help="streams dropped mid-way")
    p.add_argument("--malformed-frac", type=float, default=0.05, help="requests that must get a 4xx")
    p.add_argument("--max-tokens", type=int, default=32, help="outputs are 1..this many tokens")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL, without /v1")
    p.add_argument("--api-key", default=os.environ.get("XINSERVE_API_KEY"))
    p.add_argument("--model-name", help="the model to ask for (default: the first in /v1/models)")
    p.add_argument("--server-pid", type=int, help="the HTTP process, for its memory (known with --start)")
    p.add_argument("--start", action="store_true", help="start `xinserve serve` on a free port first")
    p.add_argument("--model", help="with --start: a model directory (default: the embedded tiny model)")
    p.add_argument("--server-log", help="with --start: where the server logs (default: a temporary file)")
    p.add_argument("--settle-s", type=float, default=30.0, help="how long to wait for the server to go idle")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "soak.json"))
    return p.parse_args(argv)


# ---------------------------------------------------------------- the server

def start_server(model: str | None, log: Path) -> tuple[subprocess.Popen, str]:
    """``xinserve serve`` on a free port, logging to ``log``."""
    port = launch.free_port()
    cmd = [sys.executable, "-m", "xinserve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if model:
        cmd += ["--model", model]
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return launch.start(cmd, log, ROOT, env), f"http://127.0.0.1:{port}"


def rss_mib(pid: int) -> float | None:
    """Resident memory of a live process from /proc (Linux); None if it is gone or unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def memory(server_pid: int | None, health: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{process: {"pid", "rss_mib"}}`` for the HTTP process (when its pid is known) and each worker."""
    pids = {"server": server_pid} if server_pid else {}
    pids.update({f"worker {w['model']}/{w['worker']}": w["pid"] for w in health.get("workers", []) if w.get("pid")})
    return {name: {"pid": pid, "rss_mib": rss_mib(pid)} for name, pid in pids.items()}


def gauges(client: httpx.Client) -> dict[str, dict[str, float]]:
    """Each engine gauge by worker label (``model/worker``)."""
    out: dict[str, dict[str, float]] = {name: {} for name in GAUGES}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name in out:
                out[s.name][f"{s.labels['model_name']}/{s.labels['worker']}"] = s.value
    return out


def wait_idle(client: httpx.Client, settle_s: float) -> tuple[bool, float, dict[str, dict[str, float]]]:
    """Poll /metrics until nothing runs or waits; (idle, seconds it took, the gauges then)."""
    start = time.monotonic()
    while True:
        g = gauges(client)
        busy = sum(g["xinserve:num_requests_running"].values()) + sum(g["xinserve:num_requests_waiting"].values())
        elapsed = time.monotonic() - start
        if busy == 0 or elapsed > settle_s:
            return busy == 0, elapsed, g
        time.sleep(0.25)


# ---------------------------------------------------------------- the load

def malformed_requests(model: str) -> list[tuple[str, bytes]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bodies: list[tuple[str, Any]] = [
        ("/v1/chat/completions", {**chat, "temperature": "hot"}),
        ("/v1/chat/completions", {**chat, "temperature": 7}),
        ("/v1/chat/completions", {**chat, "messages": "hi"}),
        ("/v1/chat/completions", {**chat, "model": "no-such-model"}),
        ("/v1/chat/completions", {"model": model}),
        ("/v1/chat/completions", {**chat, "stop": "x" * 100_000}),
        ("/v1/chat/completions", {**chat, "top_logprobs": 21, "logprobs": True}),
        ("/v1/completions", {"model": model, "prompt": "hi", "logprobs": 9}),
        ("/v1/completions", {"model": model, "prompt": [-1, 5]}),
        ("/v1/completions", {"model": model, "prompt": "hi", "n": 0}),
    ]
    out = [(path, json.dumps(body).encode()) for path, body in bodies]
    out += [("/v1/chat/completions", b'{"model": "' + model.encode() + b'", "messages": ['),
            ("/v1/completions", b"\xff\xfe not json")]
    return out


def plan(args: argparse.Namespace) -> list[str]:
    """Each request's kind, in a shuffled but reproducible order, with the exact fractions asked."""
    n = args.requests
    malformed = round(n * args.malformed_frac)
    disconnect = round(n * args.disconnect_frac)
    kinds = ["malformed"] * malformed + ["disconnect"] * disconnect + ["normal"] * (n - malformed - disconnect)
    random.Random(args.seed).shuffle(kinds)
    return kinds


async def one_request(client: httpx.AsyncClient, kind: str, model: str, rng: random.Random,
                      args: argparse.Namespace, bad: list[tuple[str, bytes]]) -> str:
    """Send one request; its outcome: "ok", "dropped", "4xx", "5xx", "error_frame" or "transport_error"."""
    if kind == "malformed":
        path, content = rng.choice(bad)
        r = await client.post(path, content=content, headers={"content-type": "application/json"})
        return f"{r.status_code // 100}xx" if r.status_code >= 400 else "unexpected_2xx"
    chat = rng.random() < 0.5
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, args.max_tokens),
                            "stream": kind == "disconnect" or rng.random() < 0.5}
    if kind == "disconnect":
        # Long enough that the drop comes first: a stream that fell behind gets its tokens coalesced
        # into a few frames, so a short one could reach [DONE] within the 1-3 frames read here.
        body.update(max_tokens=max(args.max_tokens, DISCONNECT_TOKENS), ignore_eos=True)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body["stream"]:
        r = await client.post(path, json=body)
        if r.status_code >= 400:
            return f"{r.status_code // 100}xx"
        return "ok" if r.json().get("choices") else "error_frame"
    drop_after = rng.randint(1, 3) if kind == "disconnect" else None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code >= 400:
            await r.aread()
            return f"{r.status_code // 100}xx"
        frames = 0
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return "ok"
            if '"error"' in data and "error" in json.loads(data):
                return "error_frame"
            frames += 1
            if drop_after is not None and frames >= drop_after:
                return "dropped"  # leaving the block closes the connection mid-stream
    return "error_frame"  # the stream ended without [DONE]


async def run_load(args: argparse.Namespace, base_url: str, headers: dict[str, str], model: str) -> dict[str, Any]:
    kinds = plan(args)
    bad = malformed_requests(model)
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for item in enumerate(kinds):
        queue.put_nowait(item)
    outcomes: Counter[tuple[str, str]] = Counter()
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=args.timeout_s, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                i, kind = queue.get_nowait()
                rng = random.Random(args.seed * 1_000_003 + i)
                try:
                    outcome = await one_request(client, kind, model, rng, args, bad)
                except httpx.HTTPError as exc:
                    outcome = f"transport_error ({type(exc).__name__})"
                outcomes[(kind, outcome)] += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - start

    def count(kind: str | None = None, outcome: str | None = None) -> int:
        return sum(v for (k, o), v in outcomes.items() if kind in (None, k) and outcome in (None, o))

    normal = count("normal")
    return {
        "requests": len(kinds),
        "normal": normal,
        "ok": count("normal", "ok"),
        "success_rate": count("normal", "ok") / normal if normal else 1.0,
        "disconnects": count("disconnect", "dropped"),
        "malformed_refused_4xx": count("malformed", "4xx"),
        "status_4xx": count(outcome="4xx"),
        "status_5xx": count(outcome="5xx"),
        "error_frames": count(outcome="error_frame"),
        "transport_errors": sum(v for (_, o), v in outcomes.items() if o.startswith("transport_error")),
        "elapsed_s": elapsed,
        "requests_per_s": len(kinds) / elapsed,
        "outcomes": {f"{k}: {o}": v for (k, o), v in sorted(outcomes.items())},
    }


# ---------------------------------------------------------------- report

def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(result: dict[str, Any]) -> None:
    r, after = result["results"], result["after"]
    print("| requests | concurrency | success rate | ok | dropped | malformed 4xx | 4xx | 5xx | error frames "
          "| transport errors | req/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {r['requests']} | {result['config']['concurrency']} | {r['success_rate']:.2%} | {r['ok']} "
          f"| {r['disconnects']} | {r['malformed_refused_4xx']} | {r['status_4xx']} | {r['status_5xx']} "
          f"| {r['error_frames']} | {r['transport_errors']} | {r['requests_per_s']:.1f} |")
    print()
    print(f"after: idle={after['idle']} (in {after['settle_s']:.2f}s)")
    print("| worker | KV usage before | KV usage after | running after | waiting after |")
    print("|---|---:|---:|---:|---:|")
    before = result["before"]["gauges"]
    for label, usage in after["gauges"]["xinserve:kv_cache_usage_perc"].items():
        print(f"| {label} | {before['xinserve:kv_cache_usage_perc'].get(label, 0):.3f} | {usage:.3f} "
              f"| {after['gauges']['xinserve:num_requests_running'].get(label, 0):.0f} "
              f"| {after['gauges']['xinserve:num_requests_waiting'].get(label, 0):.0f} |")
    print()
    print("| process | pid | RSS before MiB | RSS after MiB | change MiB |")
    print("|---|---|---:|---:|---:|")
    mem_before, mem_after = result["before"]["memory"], after["memory"]
    for name in dict.fromkeys([*mem_before, *mem_after]):
        b, a = mem_before.get(name, {}), mem_after.get(name, {})
        pids = sorted({str(m["pid"]) for m in (b, a) if m})  # two when a worker was restarted
        rss_b, rss_a = b.get("rss_mib"), a.get("rss_mib")
        change = rss_a - rss_b if rss_a is not None and rss_b is not None else None
        print(f"| {name} | {' -> '.join(pids)} | {_fmt(rss_b)} | {_fmt(rss_a)} | {_fmt(change, '+.1f')} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    proc, log = None, None
    base_url, server_pid = args.base_url.rstrip("/").removesuffix("/v1"), args.server_pid
    if args.start:
        log = Path(args.server_log or Path(tempfile.gettempdir()) / f"soak-server-{os.getpid()}.log")
        print(f"starting the server (log: {log})")
        proc, base_url = start_server(args.model, log)
        server_pid = proc.pid
    try:
        launch.wait_ready(base_url, proc, log, headers)
        with httpx.Client(base_url=base_url, headers=headers, timeout=30) as client:
            model = args.model_name or client.get("/v1/models").json()["data"][0]["id"]
            before = {"gauges": gauges(client), "memory": memory(server_pid, client.get("/health").json())}
            results = asyncio.run(run_load(args, base_url, headers, model))
            idle, settle_s, after_gauges = wait_idle(client, args.settle_s)
            health = client.get("/health").json()
            after = {"idle": idle, "settle_s": settle_s, "gauges": after_gauges,
                     "memory": memory(server_pid, health), "health_status": health.get("status")}
    finally:
        if proc is not None:
            launch.stop(proc)
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "config": {k: getattr(args, k) for k in ("requests", "concurrency", "disconnect_frac", "malformed_frac",
                                                  "max_tokens", "seed")}
        | {"model": model, "started": args.start},
        "results": results,
        "before": before,
        "after": after,
    }
    print_report(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0 if results["status_5xx"] == 0 and idle else 1


if __name__ == "__main__":
    sys.exit(main())

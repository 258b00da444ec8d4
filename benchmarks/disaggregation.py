"""Prefill/decode disaggregation (1P1D) against one instance of the same total size, on a mixed workload of
long and short prompts with short outputs: TTFT and TPOT P50 / P99 of each arm, and the KV transfer's
throughput in GB/s.

Arms, all serving the 5M Llama from this checkout (PYTHONPATH set to it), each worker on ``--threads``
torch threads:
- ``single``: one server with two CPU workers (two replicas: the same two workers 1P1D uses), clients
  straight to it;
- ``1p1d``: a prefill server and a decode server (MooncakeConnector over loopback TCP) behind the
  vLLM-protocol proxy (``python -m xinserve.server.disagg.proxy``).
Every request streams a completion of token ids (each prompt distinct, so no prefix-cache hit), with
``ignore_eos``; odd requests have ``--prompt-tokens`` tokens, even ones an eighth of that. TTFT is the
client's time to the first streamed token (through the proxy: the prefill leg, the read and the decode
instance's first step), TPOT the mean gap between the following tokens.

Transfer: two engines in this process (producer and consumer, loopback TCP): the prompts are prefilled on
one and read by the other; the consumer connector's ``batch_transfer_sync_read`` is timed from outside (a
stopwatch on its transfer engine) and its byte counts summed: GB/s = bytes / seconds of those reads.

The committed result (``benchmarks/results/disaggregation.json``):

    python benchmarks/disaggregation.py

Smoke run: ``python benchmarks/disaggregation.py --quick --out /tmp/disaggregation.json``.
"""

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml
from common import ROOT, llama_5m, lscpu, markdown_table, script_args, write_result

from xinserve.server.cli.bench.launch import free_port, wait_ready

MODEL = "llama-5m"
BLOCK_SIZE = 16


def prompts(count: int, long_tokens: int) -> list[list[int]]:
    """Odd requests long, even ones an eighth as long; the first tokens differ, so nothing is shared."""
    out = []
    for i in range(count):
        length = long_tokens if i % 2 else max(8, long_tokens // 8)
        out.append([7 + (i * 131 + j * 7) % 900 for j in range(length)])
    return out


def model_entry(path: str, workers: list[str], threads: int, max_len: int, transfer: dict | None) -> dict:
    entry = {"name": MODEL, "path": path, "workers": workers, "cpu_threads": threads, "dtype": "float32",
             "max_model_len": max_len, "block_size": BLOCK_SIZE, "num_kv_blocks": 64 * -(-max_len // BLOCK_SIZE)}
    if transfer:
        entry["kv_transfer_config"] = {"kv_connector": "MooncakeConnector", "kv_port": free_port(), **transfer}
    return entry


@contextmanager
def process(argv: list[str], log: Path, env: dict[str, str]):
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def server(stack: ExitStack, work: Path, name: str, model: dict,
           env: dict[str, str]) -> tuple[str, subprocess.Popen, Path]:
    port = free_port()
    config = work / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": port}, "models": [model]}))
    log = work / f"{name}.log"
    proc = stack.enter_context(process([sys.executable, "-m", "xinserve.server.cli", "serve", "--config",
                                        str(config)], log, env))
    url = f"http://127.0.0.1:{port}"
    return url, proc, log


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], output_tokens: int) -> tuple[float, list[float]]:
    """(TTFT seconds, the arrival times of every token after the first, relative to the first)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    arrivals = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    if len(arrivals) < 1:
        raise RuntimeError(f"{url}: no token streamed")
    return arrivals[0] - start, [t - arrivals[0] for t in arrivals[1:]]


async def run_load(url: str, load: list[list[int]], output_tokens: int, concurrency: int) -> dict[str, Any]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        async def bounded(prompt: list[int]):
            async with gate:
                return await one_request(client, url, prompt, output_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in load))
        seconds = time.perf_counter() - start
    ttft = [r[0] * 1e3 for r in results]
    tpot = [r[1][-1] / len(r[1]) * 1e3 for r in results if r[1]]
    return {"requests": len(load), "seconds": round(seconds, 2), "ttft_ms": percentiles(ttft),
            "tpot_ms": percentiles(tpot)}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 2), "p99": round(p99, 2)}


def serving(path: str, args, load: list[list[int]], max_len: int) -> dict[str, dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.quick:
        env["XINSERVE_COMPILE"] = "off"
    results = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        work = Path(tmp)
        t = args.threads
        servers = {
            "single": server(stack, work, "single", model_entry(path, ["cpu", "cpu"], t, max_len, None), env),
            "prefill": server(stack, work, "prefill", model_entry(path, ["cpu"], t, max_len, {"kv_role": "kv_producer"}), env),
            "decode": server(stack, work, "decode", model_entry(path, ["cpu"], t, max_len, {"kv_role": "kv_consumer"}), env),
        }
        for url, proc, log in servers.values():
            wait_ready(url, proc, log, timeout=args.start_timeout)
        proxy_port = free_port()
        proxy_log = work / "proxy.log"
        proxy = stack.enter_context(process(
            [sys.executable, "-m", "xinserve.server.disagg.proxy", "--prefill", servers["prefill"][0], "--decode",
             servers["decode"][0], "--port", str(proxy_port)], proxy_log, env))
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        wait_ready(proxy_url, proxy, proxy_log, timeout=60)
        for arm, url in (("single", servers["single"][0]), ("1p1d", proxy_url)):
            asyncio.run(run_load(url, load[:2], 2, 1))  # warm-up: first-request costs out of the figures
            results[arm] = asyncio.run(run_load(url, load, args.output_tokens, args.concurrency))
    return results


class TimedTransferEngine:
    """Stands in for a connector's Mooncake engine: ``batch_transfer_sync_read`` is timed and its bytes
    counted (``seconds``, ``bytes``, ``reads``); the rest passes through."""

    def __init__(self, engine) -> None:
        self.engine, self.seconds, self.bytes, self.reads = engine, 0.0, 0, 0

    def batch_transfer_sync_read(self, session, local_ptrs, remote_ptrs, lengths):
        start = time.perf_counter()
        rc = self.engine.batch_transfer_sync_read(session, local_ptrs, remote_ptrs, lengths)
        self.seconds += time.perf_counter() - start
        self.bytes += sum(lengths)
        self.reads += 1
        return rc

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def transfer(path: str, load: list[list[int]], max_len: int) -> dict[str, Any]:
    """Prefill ``load`` on a producer engine, read every prompt's blocks into a consumer, both here."""
    from xinserve.engines import LLM, SamplingParams

    blocks = len(load) * -(-max_len // BLOCK_SIZE) + 16
    engine = {"dtype": "float32", "num_kv_blocks": blocks, "block_size": BLOCK_SIZE, "max_model_len": max_len}

    def config(role: str) -> dict:
        return {"kv_connector": "MooncakeConnector", "kv_role": role, "kv_port": free_port()}

    with LLM(path, **engine, kv_transfer_config=config("kv_producer")) as prefill, \
            LLM(path, **engine, kv_transfer_config=config("kv_consumer")) as decode:
        connector = decode.engine.kv_connector
        timed = connector.engine = TimedTransferEngine(connector.engine)
        try:
            outs = prefill.generate(load, SamplingParams(max_tokens=1, temperature=0,
                                                         kv_transfer_params={"do_remote_decode": True}))
            params = [SamplingParams(max_tokens=1, temperature=0, kv_transfer_params=o.kv_transfer_params) for o in outs]
            decode.generate(load, params)
        finally:
            connector.engine = timed.engine
        if connector.load_failures_total:
            raise RuntimeError(f"{connector.load_failures_total} reads failed")
    return {"reads": timed.reads, "bytes": timed.bytes, "seconds": round(timed.seconds, 4),
            "gb_per_s": round(timed.bytes / timed.seconds / 1e9, 3) if timed.seconds else 0.0}


def main() -> None:
    parser = script_args(__doc__, "disaggregation.json", "a few short requests (a smoke run, not a measurement)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="the long prompts' length")
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt_tokens, args.output_tokens, args.concurrency = 4, 128, 4, 2
    path = llama_5m(args.model_dir)
    max_len = args.prompt_tokens + args.output_tokens + BLOCK_SIZE
    load = prompts(args.requests, args.prompt_tokens)
    arms = serving(path, args, load, max_len)
    moved = transfer(path, [p for p in load if len(p) == args.prompt_tokens], max_len)
    rows = [(arm, r["requests"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["tpot_ms"]["p50"], r["tpot_ms"]["p99"],
             r["seconds"]) for arm, r in arms.items()]
    print(markdown_table(("arm", "requests", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "seconds"),
                         rows))
    print(f"\nKV transfer: {moved['bytes']:,} B in {moved['reads']} batched reads, {moved['seconds']} s: "
          f"{moved['gb_per_s']} GB/s (loopback TCP)")
    write_result(args.out, {
        "machine": lscpu(), "quick": args.quick, "model": MODEL, "transport": "MooncakeConnector, loopback TCP",
        "workload": {"requests": args.requests, "long_prompt_tokens": args.prompt_tokens,
                     "short_prompt_tokens": max(8, args.prompt_tokens // 8), "output_tokens": args.output_tokens,
                     "concurrency": args.concurrency, "threads_per_worker": args.threads},
        "arms": arms, "transfer": moved,
    })


if __name__ == "__main__":
    main()

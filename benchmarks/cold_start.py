"""Seconds from launching the default ``xinserve serve`` to /health 200, to the first completion and
to every decode bucket settled (compiled, failed, or kept eager), cold and then warm: the cold start is
to reach /health 200 within 40 s.

Cold: fresh empty cache directories ($XINSERVE_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR under one
temporary directory), so the embedded model is built and every bucket is compiled by inductor; the C++
kernels are the install's build for this CPU (make's install step), else they are built there too. Warm: a second start on
the same directories. Beside each milestone's seconds, the CPU seconds the server's processes had
used by then (the HTTP process, its workers and their reaped children, from /proc): the load on a
shared machine stretches the wall-clock figures, much less the CPU ones. ``--quick`` starts the servers
with ``XINSERVE_COMPILE=off``, as the test suite does (no bucket compile to wait for; its warm row is a
test server's start). Prints a table and writes ``benchmarks/results/cold_start.json`` with the
machine's ``lscpu`` model name and flags (the compile times depend on both), which ``perf_targets.py``
reads. The server is started from this checkout (PYTHONPATH set to it). The committed result:

    python benchmarks/cold_start.py

Smoke run: ``python benchmarks/cold_start.py --quick --out /tmp/cold_start.json``.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import (
    RESULTS,
    decode_graphs,
    default_server,
    lscpu,
    markdown_table,
    poll_health,
    tree_cpu_seconds,
    write_result,
)


def _buckets(health: dict) -> dict[str, str]:
    """bucket -> state."""
    return {b: s["state"] for b, s in decode_graphs(health).get("buckets", {}).items()}


def one_start(cache: Path, timeout: float, compile_off: bool) -> dict:
    """Start the server on ``cache``, time its milestones, stop it."""
    result: dict = {}
    with default_server(cache, compile_off) as (proc, base, start), httpx.Client(timeout=10) as client:
        health = poll_health(client, base, start, timeout, lambda code, _: code == 200)
        result["health_200_s"] = round(time.perf_counter() - start, 2)
        result["health_200_cpu_s"] = tree_cpu_seconds(proc.pid)
        result["buckets_at_ready"] = _buckets(health)
        body = {"model": "xinserve-tiny", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
        client.post(f"{base}/v1/completions", json=body, timeout=timeout).raise_for_status()
        result["first_completion_s"] = round(time.perf_counter() - start, 2)
        result["first_completion_cpu_s"] = tree_cpu_seconds(proc.pid)
        # settled: the warm-up is over (deferred C++ kernels built and swapped, every bucket tried)
        try:
            health = poll_health(client, base, start, timeout, lambda _, h: bool(decode_graphs(h).get("settled")))
            result["buckets_settled_s"] = round(time.perf_counter() - start, 2)
            result["buckets_settled_cpu_s"] = tree_cpu_seconds(proc.pid)
        except TimeoutError:  # recorded as such: the other milestones still count
            health = client.get(f"{base}/health").json()
            result["buckets_settled_s"] = result["buckets_settled_cpu_s"] = None
        result["buckets_final"] = _buckets(health)
        result["kernels"] = {op: k["chosen"] for op, k in (health["workers"][0].get("kernels") or {}).items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="compile off, as the test suite starts its servers")
    parser.add_argument("--runs", type=int, default=1, help="cold + warm pairs")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=RESULTS / "cold_start.json")
    args = parser.parse_args()
    rows = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="xinserve-cold-") as tmp:
            for kind in ("cold", "warm"):
                row = {"run": run, "start": kind, **one_start(Path(tmp), args.timeout, args.quick)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    milestones = ("health_200", "first_completion", "buckets_settled")
    print(markdown_table(("start", "/health 200 s (CPU s)", "first completion s (CPU s)", "buckets settled s (CPU s)"),
                         [(row["start"], *(f"{row[f'{m}_s']} ({row[f'{m}_cpu_s']})" for m in milestones))
                          for row in rows]))
    write_result(args.out, {"lscpu": lscpu(), "compile": "off" if args.quick else "default",
                            "load_average_1_5_15": load, "rows": rows})


if __name__ == "__main__":
    main()

"""Seconds from launching the default ``xinserve serve`` to /health 200, to the first completion and
to every decode bucket settled (compiled, failed, or kept eager), cold and then warm: the cold start is
to reach /health 200 within 40 s.

Cold: fresh empty cache directories ($XINSERVE_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR and
TORCH_EXTENSIONS_DIR, all under one temporary directory), so the embedded model is built, the C++
attention extension is compiled and every bucket is compiled by inductor. Warm: a second start on
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
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import RESULTS, ROOT, lscpu, markdown_table, write_result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``, its live descendants and their reaped children (utime + stime + cutime +
    cstime from /proc/PID/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        # after the command: state, ppid, ..., utime (14th field of the line), stime, cutime, cstime
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(value) for value in fields[11:15])
    tree, grew = {pid}, True
    while grew:
        children = {child for child, parent in parents.items() if parent in tree} - tree
        tree |= children
        grew = bool(children)
    return round(sum(times.get(p, 0) for p in tree) / tick, 2)


def _graphs(health: dict) -> dict:
    """The first worker's ``info.decode_graphs`` (the default config has one worker)."""
    workers = health.get("workers") or []
    return ((workers[0].get("info") or {}).get("decode_graphs") or {}) if workers else {}


def _buckets(health: dict) -> dict[str, str]:
    """bucket -> state."""
    return {b: s["state"] for b, s in _graphs(health).get("buckets", {}).items()}


def one_start(cache: Path, timeout: float, compile_off: bool) -> dict:
    """Start the server on ``cache``, time its milestones, stop it."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XINSERVE_CACHE_DIR": str(cache / "xinserve"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TORCH_EXTENSIONS_DIR": str(cache / "extensions")}
    env.pop("XINSERVE_COMPILE", None)  # the default mode, as a user gets it
    if compile_off:
        env["XINSERVE_COMPILE"] = "off"
    base = f"http://127.0.0.1:{port}"
    log = (cache / f"server-{port}.log").open("w")
    start = time.perf_counter()
    # A session of its own: what the server leaves running (a C++ build's compiler) is stopped with it.
    proc = subprocess.Popen([sys.executable, "-m", "xinserve.server.cli", "serve", "--port", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    result: dict = {}
    try:
        with httpx.Client(timeout=10) as client:
            health = _poll(client, base, start, timeout, lambda code, _: code == 200)
            result["health_200_s"] = round(time.perf_counter() - start, 2)
            result["health_200_cpu_s"] = _tree_cpu_seconds(proc.pid)
            result["buckets_at_ready"] = _buckets(health)
            body = {"model": "xinserve-tiny", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
            client.post(f"{base}/v1/completions", json=body, timeout=timeout).raise_for_status()
            result["first_completion_s"] = round(time.perf_counter() - start, 2)
            result["first_completion_cpu_s"] = _tree_cpu_seconds(proc.pid)
            # settled: the warm-up is over (deferred C++ kernels built and swapped, every bucket tried)
            try:
                health = _poll(client, base, start, timeout, lambda _, h: bool(_graphs(h).get("settled")))
                result["buckets_settled_s"] = round(time.perf_counter() - start, 2)
                result["buckets_settled_cpu_s"] = _tree_cpu_seconds(proc.pid)
            except TimeoutError:  # recorded as such: the other milestones still count
                health = client.get(f"{base}/health").json()
                result["buckets_settled_s"] = result["buckets_settled_cpu_s"] = None
            result["buckets_final"] = _buckets(health)
            result["kernels"] = {op: k["chosen"] for op, k in (health["workers"][0].get("kernels") or {}).items()}
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:  # a loaded machine: the figures taken still count
            proc.kill()
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # nothing left
            pass
        log.close()
    return result


def _poll(client: httpx.Client, base: str, start: float, timeout: float, done) -> dict:
    while time.perf_counter() - start < timeout:
        try:
            response = client.get(f"{base}/health")
            health = response.json()
            if done(response.status_code, health):
                return health
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no milestone within {timeout:.0f} s")


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

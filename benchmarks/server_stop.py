"""What stopping a server costs: ``xinserve serve --model TINY`` (the tiny Llama, one CPU worker,
compile off) started until /health 200, then SIGTERM; per process (HTTP, worker), the CPU seconds it
spent from SIGTERM to its exit, and the wall seconds to the server's exit.

CPU seconds do not depend on the machine's load; wall seconds do (the load average is stored). Run
from a checkout (``--root``: another one, e.g. the commit before a change) to compare trees.
Prints a table and merges into benchmarks/results/server_stop.json under ``--label``:
    python benchmarks/server_stop.py --label after --runs 2
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from xinserve.server.bench.launch import free_port
from xinserve.server.embedded_model.factory import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "server_stop.json"


def cpu(process: psutil.Process) -> float:
    t = process.cpu_times()
    return t.user + t.system


def one_stop(root: Path, model: Path, log: Path) -> dict:
    """Start, wait for ready, SIGTERM; the CPU each process spent stopping and the wall to exit."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(root), "XINSERVE_COMPILE": "off", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "xinserve.server.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port), "--model", str(model), "--cpu-threads", "1"],
                                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        proc.kill()
        raise TimeoutError(f"not ready within 600 s; log in {log}")
    http = psutil.Process(proc.pid)
    worker = next(c for c in http.children() if "spawn_main" in " ".join(c.cmdline()))
    processes = {"http": http, "worker": worker}
    start = {name: cpu(p) for name, p in processes.items()}
    last = dict(start)
    t0 = time.monotonic()
    proc.terminate()
    while proc.poll() is None or any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                     for p in processes.values()):
        for name, p in processes.items():
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    last[name] = cpu(p)
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.02)
    return {"wall_s": round(time.monotonic() - t0, 2),
            **{f"{name}_cpu_s": round(last[name] - start[name], 2) for name in processes}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose server runs")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", "llama")
        load_before = os.getloadavg()
        runs = [one_stop(args.root.resolve(), model, Path(tmp) / f"server{i}.log") for i in range(args.runs)]
    print(f"{'run':>4} {'HTTP CPU s':>11} {'worker CPU s':>13} {'wall s':>7}")
    for i, r in enumerate(runs):
        print(f"{i:4} {r['http_cpu_s']:11.2f} {r['worker_cpu_s']:13.2f} {r['wall_s']:7.2f}")
    stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    stored[args.label] = {"runs": runs, "root": str(args.root), "note": args.note,
                          "load_before": [round(x, 1) for x in load_before],
                          "load_after": [round(x, 1) for x in os.getloadavg()]}
    RESULTS.write_text(json.dumps(stored, indent=2) + "\n")


if __name__ == "__main__":
    main()

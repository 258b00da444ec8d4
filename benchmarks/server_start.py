"""Seconds and CPU seconds from launching ``xinserve serve`` to /health 200, warm (the embedded model
built, the C++ extension compiled), the way the test suite starts its servers (``XINSERVE_COMPILE=off``,
offline), for one or two source trees started alternately (A B A B ...) so a shared machine's load falls
on both alike. Beside them: when the HTTP process spawned its worker (the log's "spawned worker" line
appears), and the CPU seconds of the HTTP process alone and of the whole tree at ready (from /proc).

    python benchmarks/server_start.py [--before OLDER_CHECKOUT] [--runs N]

``--before``: another checkout (e.g. ``git archive`` of the commit before a change). ``--bytecode``: the
servers keep compiled bytecode (in a temporary PYTHONPYCACHEPREFIX, warmed by the untimed first start)
even where the environment sets PYTHONDONTWRITEBYTECODE, as a pip-installed package has it. Prints a
table of medians and writes ``benchmarks/results/server_start.json`` with every start and the load
average.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from cold_start import RESULTS, _free_port, _graphs, _tree_cpu_seconds

REPO = Path(__file__).resolve().parents[1]
OUTPUT = RESULTS.with_name("server_start.json")
METRICS = ("spawned_s", "health_200_s", "http_cpu_s", "tree_cpu_s")


def _process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def one_start(tree: Path, cache: Path, timeout: float, settle: bool = False, bytecode: bool = False) -> dict:
    """Start the server of ``tree`` on ``cache``; time its spawn and /health 200 (and, with ``settle``,
    wait for its warm-up to finish: the first start builds what the later ones find)."""
    port = _free_port()
    # The C++ extension's cache is the default one (keyed by its source): built once, not per run.
    env = {**os.environ, "PYTHONPATH": str(tree), "XINSERVE_CACHE_DIR": str(cache / "xinserve"), "XINSERVE_COMPILE": "off",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(cache / "pycache")
    log_path = cache / f"server-{port}.log"
    base = f"http://127.0.0.1:{port}"
    row: dict = {}
    with log_path.open("w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "xinserve.server.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tree,
                                start_new_session=True)
        try:
            with httpx.Client(timeout=5) as client:
                while time.perf_counter() - start < timeout and "health_200_s" not in row:
                    if "spawned_s" not in row and "spawned worker" in log_path.read_text():
                        row["spawned_s"] = round(time.perf_counter() - start, 2)
                    try:
                        health = client.get(f"{base}/health")
                        if health.status_code == 200:
                            row["health_200_s"] = round(time.perf_counter() - start, 2)
                            row["http_cpu_s"] = _process_cpu_seconds(proc.pid)
                            row["tree_cpu_s"] = _tree_cpu_seconds(proc.pid)
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.05)
                while settle and time.perf_counter() - start < timeout:
                    if _graphs(client.get(f"{base}/health").json()).get("settled"):
                        break
                    time.sleep(0.5)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if "health_200_s" not in row:
        raise TimeoutError(f"{tree}: no /health 200 within {timeout:.0f} s; log {log_path}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout, started alternately with this one")
    parser.add_argument("--runs", type=int, default=3, help="starts per tree")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--bytecode", action="store_true", help="keep compiled bytecode (see above)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    trees = {"after": REPO} if args.before is None else {"before": args.before.resolve(), "after": REPO}
    rows = []
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    with tempfile.TemporaryDirectory(prefix="xinserve-start-") as tmp:
        for label, tree in trees.items():  # untimed: builds the model and each tree's C++ extension
            one_start(tree, Path(tmp), args.timeout, settle=True, bytecode=args.bytecode)
        for run in range(args.runs):
            for label, tree in trees.items():
                row = {"tree": label, "run": run, **one_start(tree, Path(tmp), args.timeout, bytecode=args.bytecode)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    medians = {label: {m: statistics.median(r[m] for r in rows if r["tree"] == label and m in r) for m in METRICS}
               for label in trees}
    print(f"load average before {' '.join(load_before)}, after {' '.join(load_after)}; medians of {args.runs}; "
          f"bytecode {'kept' if args.bytecode else 'as the environment says'}")
    print("| tree | worker spawned s | /health 200 s | HTTP process CPU s | all processes CPU s |")
    print("|---|---|---|---|---|")
    for label, values in medians.items():
        print(f"| {label} | " + " | ".join(str(values[m]) for m in METRICS) + " |")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "medians": medians,
                                       "bytecode_kept": args.bytecode,
                                       "python_dont_write_bytecode": os.environ.get("PYTHONDONTWRITEBYTECODE"),
                                       "load_average_before": load_before, "load_average_after": load_after,
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

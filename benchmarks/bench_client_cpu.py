"""What the load generator itself costs: CPU per streamed token of ``xinserve bench``, of the HTTP
process and of the worker, at one closed-loop level (default c=32, 32-word prompts, 128 tokens).

On a 2-core machine the client shares the cores with the server it measures, so every CPU second it
spends is taken from the server: its cost shows up in the server's TPOT and throughput. One xinserve
server (this checkout, the 5M Llama of ../shared/PEERS.md, float32) is started and kept up; each arm is
a checkout whose ``python -m xinserve.server.cli bench`` is the client (``--before CHECKOUT`` adds an older
client as the second arm, e.g. the httpx one before session 12). Per repeat and arm, in alternating
order, the client runs one level; its CPU over the level is the ``client_cpu_s`` it records in its
JSON, or, for a client older than that field, the difference of its CPU time (``RUSAGE_CHILDREN``)
between a run of one level and a run of four, divided by three (the interpreter's start and imports
cancel out; they vary by a second on a loaded machine, hence the four).
The HTTP process's and the workers' CPU (``psutil``) over the one-level run are divided by its tokens.
Prints a table and writes ``benchmarks/results/bench_client_cpu.json``.

    python benchmarks/bench_client_cpu.py [--before CHECKOUT] [--repeats 3] [--concurrency 32]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from compare import DEFAULT_MODEL, wait_warmed_up

from xinserve.server.bench import launch
from xinserve.server.bench.cli import machine
from xinserve.server.embedded_model.factory import ensure_tiny_model

RESULTS = ROOT / "benchmarks" / "results" / "bench_client_cpu.json"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def process_cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def run_client(root: Path, url: str, levels: str, args: argparse.Namespace, out: Path) -> tuple[float, dict]:
    """(the client's CPU seconds, its JSON document) for one ``xinserve bench`` of ``root``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = [sys.executable, "-m", "xinserve.server.cli", "bench", "--base-url", f"{url}/v1", "--concurrency", levels,
           "--num-prompts", str(args.num_prompts), "--output-tokens", str(args.output_tokens),
           "--input-words", str(args.input_words), "--json", str(out)]
    before = children_cpu()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    cpu = children_cpu() - before
    if proc.returncode != 0:
        raise RuntimeError(f"bench of {root} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return cpu, json.loads(out.read_text())


def measure(root: Path, url: str, server: psutil.Process, args: argparse.Namespace, scratch: Path) -> dict:
    workers = server.children(recursive=True)
    tokens = args.num_prompts * args.output_tokens
    http0, work0 = process_cpu(server), sum(process_cpu(w) for w in workers)
    one, doc = run_client(root, url, str(args.concurrency), args, scratch / "one.json")
    http1, work1 = process_cpu(server), sum(process_cpu(w) for w in workers)
    level = doc["runs"][0]
    client = level.get("client_cpu_s")
    if client is None:
        four, _ = run_client(root, url, ",".join([str(args.concurrency)] * 4), args, scratch / "four.json")
        client = (four - one) / 3
    return {"client_us_per_token": 1e6 * client / tokens, "http_us_per_token": 1e6 * (http1 - http0) / tokens,
            "worker_us_per_token": 1e6 * (work1 - work0) / tokens, "output_tok_s": level["output_throughput_tok_s"],
            "tpot_ms": level["tpot_ms"]["mean"], "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, metavar="CHECKOUT", help="an older checkout's client as a second arm")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--input-words", type=int, default=32)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    arms = [("this", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    scratch = Path(tempfile.mkdtemp(prefix="bench-client-cpu-"))
    model = ensure_tiny_model(scratch, "llama-h256-l4", **DEFAULT_MODEL)
    port = launch.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "xinserve.server.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32"]
    log = scratch / "server.log"
    proc = launch.start(cmd, log, ROOT)
    rows: dict[str, list[dict]] = {label: [] for label, _ in arms}
    try:
        launch.wait_ready(url, proc, log, timeout=600)
        wait_warmed_up(url, 1800)
        run_client(ROOT, url, "4", argparse.Namespace(**{**vars(args), "num_prompts": 8}), scratch / "warm.json")
        server = psutil.Process(proc.pid)
        for repeat in range(args.repeats):
            for label, root in arms if repeat % 2 == 0 else arms[::-1]:
                row = measure(root, url, server, args, scratch)
                rows[label].append(row)
                print(f"{label} #{repeat}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), file=sys.stderr)
    finally:
        launch.stop(proc)
    keys = ("client_us_per_token", "http_us_per_token", "worker_us_per_token", "output_tok_s", "tpot_ms")
    medians = {label: {k: statistics.median(r[k] for r in runs) for k in keys} for label, runs in rows.items()}
    print(f"| client | {' | '.join(keys)} |\n|---|{'---:|' * len(keys)}")
    for label, m in medians.items():
        print(f"| {label} | " + " | ".join(f"{m[k]:.1f}" for k in keys) + " |")
    result = {"machine": machine(), "concurrency": args.concurrency, "input_words": args.input_words,
              "output_tokens": args.output_tokens, "arms": {label: str(root) for label, root in arms},
              "medians": medians, "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

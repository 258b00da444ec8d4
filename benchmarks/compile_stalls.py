"""The stalled decode steps while the buckets compile in the background, per GIL switch interval.

benchmarks/background_compile.py gives the median and worst step beside the compile; this counts the stalls
(steps over 50 ms) and their total, with ``sys.setswitchinterval`` at each ``--intervals`` value (ms), each
in a fresh process with an empty inductor cache (the 5M Llama of ../shared/PEERS.md, float32, one thread,
buckets 1-8, batch 8, steps timed from ready until every bucket is compiled). Prints a table and writes
``benchmarks/results/compile_stalls.json``.

    python benchmarks/compile_stalls.py [--intervals 5,0.5,0.1] [--batch 8]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine_timing import decode_engine, decoding, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "compile_stalls.json"
STALL_S = 0.05
CHILD = "XINSERVE_COMPILE_STALLS_CHILD"  # "<batch>,<interval s>" in the child that measures one arm


def measure(path: str, batch: int, interval_s: float) -> dict:
    import torch

    sys.setswitchinterval(interval_s)
    start = time.perf_counter()
    llm = decode_engine(path, 8, 128, 1000, compile="on")
    done = llm.engine.warmup.done
    times: list[float] = []
    with torch.inference_mode():
        while not done.is_set():
            with decoding(llm.engine, batch, 128, 1000):
                for _ in range(1000):
                    if done.is_set():
                        break
                    t = time.perf_counter()
                    llm.engine.step()
                    times.append(time.perf_counter() - t)
    q = statistics.quantiles(times, n=100)
    return {"batch": batch, "interval_ms": interval_s * 1e3, "all_compiled_s": round(time.perf_counter() - start, 1),
            "steps": len(times), "median_ms": round(statistics.median(times) * 1e3, 2),
            "p99_ms": round(q[98] * 1e3, 2), "max_ms": round(max(times) * 1e3, 1),
            "stalls_over_50ms": sum(t > STALL_S for t in times),
            "stalled_s": round(sum(t for t in times if t > STALL_S), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--intervals", default="5,0.5,0.1", help="GIL switch intervals, ms")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    path = llama_5m(args.model_dir)
    if os.environ.get(CHILD):
        batch, interval = os.environ[CHILD].split(",")
        print(json.dumps(measure(path, int(batch), float(interval))))
        os._exit(0)  # the warm-up thread has finished; skip interpreter teardown beside inductor's pools
    rows = []
    for interval_ms in (float(v) for v in args.intervals.split(",")):
        env = {**os.environ, CHILD: f"{args.batch},{interval_ms / 1e3}",
               "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="xinserve-inductor-")}
        done = subprocess.run([sys.executable, __file__, "--model-dir", args.model_dir], env=env, check=True,
                              stdout=subprocess.PIPE, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}\n")
    print("| switch interval ms | all compiled s | steps | median ms | p99 ms | max ms | steps > 50 ms | stalled s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['interval_ms']:g} | {r['all_compiled_s']} | {r['steps']} | {r['median_ms']} | {r['p99_ms']} | "
              f"{r['max_ms']} | {r['stalls_over_50ms']} | {r['stalled_s']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load_average": load, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The async worker loop at batch 32 with the GIL switch interval at Python's default (5 ms) and at the
worker's (server/worker.py's ASYNC_GIL_SWITCH_INTERVAL_S), arms alternating over repeats.

The 5M Llama in float32 on one torch thread, its decode buckets compiled, driven by a real
``WorkerLoop`` over ZeroMQ with a consumer process (benchmarks/worker_gap.py's ``run_arm``, which
sets no interval of its own, so the one set here holds: ``WorkerLoop.run`` only lowers it). Per arm:
the median gap between forwards, the forward's wall and CPU, the host CPU per step. Writes
benchmarks/results/gil_switch_interval.json.

Run: python benchmarks/gil_switch_interval.py [--repeats 4] [--steps 100]
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import worker_gap
from engine_timing import decode_engine, llama_5m

KEYS = ("idle_wall_ms_median", "forward_wall_ms_median", "forward_cpu_ms_median", "host_cpu_ms_per_step")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gil_switch_interval.json")
    args = p.parse_args(argv)
    import torch

    from xinserve.server import worker

    path = llama_5m(os.path.join("/tmp", "xinserve-bench"))
    torch.set_num_threads(1)
    llm = decode_engine(path, 32, 40, 4 * args.steps, compile="on")
    llm.engine.warmup.done.wait()  # every bucket compiled (or kept eager) before the first arm
    arms = {"5 ms": 0.005, f"{worker.ASYNC_GIL_SWITCH_INTERVAL_S * 1e3:g} ms": worker.ASYNC_GIL_SWITCH_INTERVAL_S}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for rep in range(args.repeats):
        for arm in arms if rep % 2 == 0 else reversed(arms):
            worker.ASYNC_GIL_SWITCH_INTERVAL_S = arms[arm]  # what WorkerLoop.run lowers the interval to
            sys.setswitchinterval(arms[arm])
            r = worker_gap.run_arm(llm, 32, 40, args.steps, "async", f"{rep}-{arm}")
            r["load"] = os.getloadavg()[0]
            runs[arm].append(r)
            print(f"rep {rep} {arm:<7} load {r['load']:5.1f}  " + "  ".join(f"{k} {r[k]:.2f}" for k in KEYS), flush=True)
    summary = {arm: {k: statistics.median(r[k] for r in rs) for k in KEYS} for arm, rs in runs.items()}
    for arm, s in summary.items():
        print(f"{arm:<7} " + "  ".join(f"{k} {v:.2f}" for k, v in s.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The model's weights on transparent huge pages (kernels/huge_pages.py ``weights_on_huge_pages``) against
the same weights on 4 KiB pages, in the decode step.

One eager engine of the 5M Llama (float32, C++ decode attention and linear), at batch x context points;
between windows of ``engine.step()`` its parameters are moved from one placement to the other (same
values), alternating A B A B so that the machine's load falls on both arms alike. Per arm and point: the
median over windows of the process CPU time per step (``time.process_time``; a loaded machine makes wall
time mostly waiting for a core) and of the wall time, on 1 and 2 torch threads. Prints a markdown table
and writes ``benchmarks/results/weights_huge_pages.json``.

    python benchmarks/weights_huge_pages.py [--points 32x512,8x160,1x64] [--rounds 8] [--window 10]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the server's CPU workers run (server/pool.py)

from engine_timing import LLAMA_5M, decode_engine, decoding, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "weights_huge_pages.json"


def place(model, huge: bool) -> None:
    """Move the parameters (values kept) onto one huge-page arena, or each onto its own plain allocation."""
    from xinserve.kernels.huge_pages import weights_on_huge_pages

    params = list(model.parameters())
    values = [p.data.clone() for p in params]
    if huge:
        weights_on_huge_pages(model)
        for p, v in zip(params, values):
            p.data.copy_(v)
    else:
        for p, v in zip(params, values):
            p.data = v


def window_times(engine, steps: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="32x512,8x160,1x64")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=8, help="A B pairs per point and thread count")
    parser.add_argument("--window", type=int, default=10, help="steps per window")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    threads = [int(n) for n in args.threads.split(",")]
    path = llama_5m(args.model_dir)
    import torch

    steps = 2 * args.rounds * args.window * len(threads) + 16
    llm = decode_engine(path, max(b for b, _ in points), max(c for _, c in points), steps, compile="off",
                        kernels={"decode_attention": "cpp", "linear": "cpp"})
    engine, model = llm.engine, llm.engine.runner.model
    rows = []
    with torch.inference_mode():
        for batch, context in points:
            with decoding(engine, batch, context, steps):
                for n in threads:
                    torch.set_num_threads(n)
                    samples = {"4k": [], "huge": []}
                    for _ in range(args.rounds):
                        for arm, values in samples.items():
                            place(model, arm == "huge")
                            engine.step()
                            values.append(window_times(engine, args.window))
                    row = {"batch": batch, "context": context, "threads": n}
                    for arm, values in samples.items():
                        row[f"{arm}_cpu_ms"] = 1e3 * statistics.median(v[0] for v in values)
                        row[f"{arm}_wall_ms"] = 1e3 * statistics.median(v[1] for v in values)
                    row["cpu_ratio"] = row["4k_cpu_ms"] / row["huge_cpu_ms"]
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    llm.close()
    result = {"model": LLAMA_5M, "dtype": "float32", "mode": "eager", "load_average": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average {os.getloadavg()}")
    print("| batch x context | threads | 4 KiB CPU ms/step | huge CPU ms/step | 4 KiB wall ms | huge wall ms | CPU 4k / huge |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} x {r['context']} | {r['threads']} | {r['4k_cpu_ms']:.2f} | {r['huge_cpu_ms']:.2f} | "
              f"{r['4k_wall_ms']:.2f} | {r['huge_wall_ms']:.2f} | {r['cpu_ratio']:.3f} |")


if __name__ == "__main__":
    main()

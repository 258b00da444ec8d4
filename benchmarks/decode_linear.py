"""The C++ decode linear (kernels/csrc/decode_linear.cpp) against torch's ``F.linear`` (MKL's sgemm)
with the weight COLD, as in a decode step: each measurement cycles x @ W^T over enough copies of W to
overflow the last-level cache (96 MB), so every call reads its weight from DRAM.

Per weight shape (the 5M Llama's fused q/k/v, o_proj, fused gate/up, down_proj, lm_head, and a
hidden-2048 model's), per row count M (1 ... 64), per thread count (1, 2): the time per call, the
weight's read rate (GB/s) and the arithmetic rate (GF/s). The time is CPU time of the process
(``time.process_time``: on a loaded machine wall time is mostly waiting for a core; on 2 threads it
sums both; OpenMP waits passively, as in the server's workers), and wall time beside it; the best of ``--repeats`` passes. Prints a markdown table and
writes ``benchmarks/results/decode_linear.json``.

    PYTHONPATH=. python benchmarks/decode_linear.py [--quick] [--out PATH]
"""

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the server's CPU workers run (server/pool.py)

import torch
import torch.nn.functional as F

from xinserve.kernels import cpp

RESULTS = Path(__file__).resolve().parent / "results" / "decode_linear.json"
SHAPES = {  # name -> (N, K): y[M, N] = x[M, K] @ W[N, K]^T
    "5M qkv": (512, 256), "5M o_proj": (256, 256), "5M gate_up": (1536, 256), "5M down": (256, 768),
    "5M lm_head": (1000, 256), "2048 qkv": (3072, 2048), "2048 gate_up": (11264, 2048), "2048 down": (2048, 5632),
}
ROWS = (1, 4, 8, 16, 32, 64)
COLD_BYTES = 96 << 20


def per_call(function, weights: list[torch.Tensor], x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per call: the best pass over every copy."""
    function(x, weights[0])
    best_cpu = best_wall = float("inf")
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        for w in weights:
            function(x, w)
        best_cpu = min(best_cpu, (time.process_time() - cpu) / len(weights))
        best_wall = min(best_wall, (time.perf_counter() - wall) / len(weights))
    return best_cpu, best_wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 5M shapes only, M 1/8/32, 1 thread")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    shapes = {k: v for k, v in SHAPES.items() if k.startswith("5M")} if args.quick else SHAPES
    rows, threads = ((1, 8, 32), (1,)) if args.quick else (ROWS, (1, 2))
    impls = {"mkl": lambda x, w: F.linear(x, w), "ours": lambda x, w: cpp._extension.decode_linear(x, w)}
    results = []
    print("| shape (N x K) | M | threads | mkl us (cpu / wall) | ours us (cpu / wall) | mkl GB/s | ours GB/s "
          "| ours GF/s | mkl / ours (cpu) |")
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for name, (n_out, k) in shapes.items():
            nbytes = n_out * k * 4
            copies = max(2, -(-COLD_BYTES // nbytes))
            weights = [torch.randn(n_out, k) for _ in range(copies)]
            for m in rows:
                x = torch.randn(m, k)
                for t in threads:
                    torch.set_num_threads(t)
                    times = {impl: per_call(f, weights, x, args.repeats) for impl, f in impls.items()}
                    mkl, ours = times["mkl"][0], times["ours"][0]
                    row = {"shape": name, "n": n_out, "k": k, "m": m, "threads": t, "weight_bytes": nbytes,
                           **{f"{impl}_{kind}_us": round(v[i] * 1e6, 1) for impl, v in times.items()
                              for i, kind in enumerate(("cpu", "wall"))}}
                    results.append(row)
                    print(f"| {name} ({n_out} x {k}) | {m} | {t} | {mkl * 1e6:.0f} / {times['mkl'][1] * 1e6:.0f} "
                          f"| {ours * 1e6:.0f} / {times['ours'][1] * 1e6:.0f} | {nbytes / mkl / 1e9:.1f} "
                          f"| {nbytes / ours / 1e9:.1f} | {2 * m * n_out * k / ours / 1e9:.1f} | {mkl / ours:.2f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"time": "process CPU seconds per call, best of repeats; wall beside",
                                    "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

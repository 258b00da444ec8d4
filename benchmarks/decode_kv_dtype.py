"""Decode step time per KV cache dtype (``--kv-cache-dtype``), against the step's memory floor.

``benchmarks/decode_context.py``'s setup at its heaviest point: the 5M Llama of ../shared/PEERS.md in
float32, one thread, batch 32 x 512-token contexts, ``decode_attention`` forced to the C++ kernel, which
reads the cache in place in every dtype. Per dtype: the best mean ``engine.step()`` time, the bytes one
step reads (weights + the batch's K/V in that dtype, scales included) and the floor those bytes set at
the machine's single-thread read bandwidth, measured here as in PEERS.md (the best of several
``torch.sum`` over 256 MB). Engines alternate within one process and each keeps its fastest window.
Prints a markdown table and writes ``benchmarks/results/decode_kv_dtype.json``; ``lscpu``'s model name
and whether the CPU has AVX-512 are recorded (these machines vary).

    python benchmarks/decode_kv_dtype.py [--quick]
"""

import json
import subprocess
import sys
import time
from pathlib import Path

from engine_timing import LLAMA_5M, best_window, decode_args, decode_engine, decoding, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "decode_kv_dtype.json"
KINDS = ("auto", "bfloat16", "float16", "int8", "fp8_e4m3")


def read_bandwidth(torch, repeats: int = 7) -> float:
    """Bytes per second one thread reads: the best of ``repeats`` sums over a 256 MB float32 tensor."""
    data = torch.ones(64 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def cpu_kind() -> dict[str, object]:
    text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name")), "")
    return {"cpu": model, "avx512": "avx512f" in text, "avx2": "avx2" in text}


def main() -> None:
    args = decode_args(__doc__, RESULTS, "fewer windows and a shorter context (a smoke run)")
    path = llama_5m(args.model_dir)
    import torch

    batch, context = (8, 128) if args.quick else (32, 512)
    windows, window = (2, 4) if args.quick else (5, 8)
    engines = {kind: decode_engine(path, batch, context, windows * window, kernels={"decode_attention": "cpp"},
                                   kv_cache_dtype=kind) for kind in KINDS}
    bandwidth = read_bandwidth(torch)
    rows = []
    with torch.inference_mode():
        for kind, llm in engines.items():
            runner = llm.engine.runner
            weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
            per_token = runner.bytes_per_block() // llm.engine.block_manager.block_size
            with decoding(llm.engine, batch, context, windows * window):
                seconds = best_window(llm.engine, windows, window)
            kv = batch * (context + 8) * per_token  # the contexts read in a step, about 8 tokens in
            floor = (weights + kv) / bandwidth
            rows.append({"kv_cache_dtype": kind, "stored": str(runner.kv_dtype).removeprefix("torch."),
                         "bytes_per_token": per_token, "step_ms": 1e3 * seconds, "weight_bytes": weights,
                         "kv_bytes": kv, "floor_ms": 1e3 * floor, "step_over_floor": seconds / floor})
            print(f"{kind}: {1e3 * seconds:.2f} ms per step, floor {1e3 * floor:.2f} ms", file=sys.stderr)
    result = {"model": LLAMA_5M, "dtype": "float32", "threads": 1, "batch": batch, "context": context,
              "decode_attention": "cpp", "read_bandwidth_gb_s": bandwidth / 1e9, **cpu_kind(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['cpu']} (AVX-512: {result['avx512']}), one thread reads {bandwidth / 1e9:.1f} GB/s; "
          f"batch {batch} x {context} context\n")
    print("| KV cache dtype | bytes/token | step ms | MB read per step | floor ms | step / floor |\n"
          "|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['kv_cache_dtype']} | {row['bytes_per_token']} | {row['step_ms']:.2f} | "
              f"{(row['weight_bytes'] + row['kv_bytes']) / 1e6:.1f} | {row['floor_ms']:.2f} | "
              f"{row['step_over_floor']:.1f}x |")


if __name__ == "__main__":
    main()

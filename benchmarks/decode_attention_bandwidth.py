"""How near the C++ decode attention reads K/V to the machine's read bandwidth, per KV dtype and thread count.

The kernel alone (``kernels/cpp.py``) at one layer of ``benchmarks/decode_context.py``'s heaviest point:
the 5M Llama of ../shared/PEERS.md (4 heads / 2 KV heads of 64), batch 32 x 512-token contexts over a
pool whose blocks are scattered (a random permutation, as a long-running server's are), block size 16.
Per KV dtype (``--kv-cache-dtype``) and thread count: the fastest call of ``--repeats`` (one thread: its
CPU time, ``time.thread_time``, which a loaded machine inflates least; two threads: wall time), the
K/V bytes one call reads (scales included) and the GB/s that makes, against the read bandwidth of one
thread summing a 256 MB tensor (PEERS.md's yardstick). Prints a markdown table and writes
``benchmarks/results/decode_attention_bandwidth.json``.

    python benchmarks/decode_attention_bandwidth.py [--repeats N] [--out PATH]
"""

import argparse
import json
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results" / "decode_attention_bandwidth.json"
KINDS = ("auto", "bfloat16", "float16", "int8", "fp8_e4m3")
BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 512, 4, 2, 64, 16


def fastest(call: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        call()
        best = min(best, clock() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from xinserve.kernels import cpp, kv_quant

    per_seq = CONTEXT // BLOCK
    num_blocks = BATCH * per_seq + 8
    tables = torch.from_numpy(np.random.default_rng(0).permutation(num_blocks)[: BATCH * per_seq]
                              .reshape(BATCH, per_seq).astype(np.int32))
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
    query = torch.randn(BATCH, HEADS, HEAD_DIM)
    torch.set_num_threads(1)
    data = torch.ones(64 << 20)
    bandwidth = data.nbytes / fastest(data.sum, 7, time.thread_time)
    del data
    rows = []
    with torch.inference_mode():
        for kind in KINDS:
            dtype = kv_quant.storage_dtype(kind, torch.float32)
            caches = [kv_quant.quantize(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype) for _ in range(2)]
            nbytes = 2 * BATCH * CONTEXT * KV_HEADS * caches[0].shape[-1] * caches[0].element_size()
            for threads, clock in ((1, time.thread_time), (2, time.perf_counter)):
                torch.set_num_threads(threads)
                seconds = fastest(partial(cpp.paged_decode_attention, query, *caches, tables, lens, 0.125),
                                  args.repeats, clock)
                rows.append({"kv_cache_dtype": kind, "threads": threads, "ms": seconds * 1e3, "kv_mb": nbytes / 1e6,
                             "gb_s": nbytes / seconds / 1e9, "floor_ms": nbytes / bandwidth * 1e3})
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    result = {"batch": BATCH, "context": CONTEXT, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "block_size": BLOCK, "cpu": model, "avx512": "avx512f" in lscpu,
              "read_bandwidth_gb_s": bandwidth / 1e9, "rows": rows}
    lines = [f"one thread summing 256 MB: {bandwidth / 1e9:.1f} GB/s ({model}, AVX-512: {result['avx512']})", "",
             "| KV dtype | threads | ms per layer | K/V MB | GB/s | floor ms | over floor |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kv_cache_dtype']} | {r['threads']} | {r['ms']:.3f} | {r['kv_mb']:.2f} | {r['gb_s']:.1f} | "
              f"{r['floor_ms']:.3f} | {r['ms'] / r['floor_ms']:.2f}x |" for r in rows]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

if __name__ == "__main__":
    main()

"""The C++ decode attention as a server step runs it: 4 layers in a row over a large pool, cold caches.

``decode_attention_bandwidth.py`` times one layer over a pool the size of its context, so part of what
it reads is still in the last-level cache from the previous call. Here the pool is what a server
allocates (``--pool-gib``, default 1 GiB: [2, 4 layers, N blocks, 16, 2 KV heads, 64] for the 5M Llama
of ../shared/PEERS.md, filled with random values so every page is real), each layer has its own
scattered block table (a random permutation, as a long-running server's are), batch 32 x 512-token
contexts, and ``--sets`` different sets of 4 tables are cycled so that no call finds its blocks in the
32 MiB L3 left by the call before. One "step" is the 4 layers' calls.

For each KV dtype, thread count and pool (``plain``: ``torch.zeros``; ``thp``: the pool on transparent
huge pages, ``kernels/huge_pages.py``, when this tree has it): the fastest step of ``--repeats`` by wall
time, its CPU time (``time.process_time``, all threads), the K/V bytes the step reads (scales included)
and the GB/s that makes, against the floor: a 256 MB ``torch.sum`` with as many threads. Prints a
markdown table and writes ``benchmarks/results/decode_attention_realistic.json``.

    python benchmarks/decode_attention_realistic.py [--kinds auto,bfloat16,...] [--threads 1,2]
        [--pools plain,thp] [--repeats N] [--out PATH]

Run it with ``PYTHONPATH=<tree>`` to time that tree's kernel (its extension is built on first use).
"""

import argparse
import importlib.util
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results" / "decode_attention_realistic.json"
BATCH, CONTEXT, LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 512, 4, 4, 2, 64, 16


def best_of(call: Callable[[int], object], repeats: int) -> tuple[float, float]:
    """(fastest wall seconds, least CPU seconds) of ``call(i)`` over ``repeats`` runs after one warm-up. On a
    loaded machine the CPU time is the steadier of the two (a preempted run's wall time counts the wait)."""
    call(repeats)
    wall_best, cpu_best = float("inf"), float("inf")
    for i in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        call(i)
        wall_best = min(wall_best, time.perf_counter() - wall)
        cpu_best = min(cpu_best, time.process_time() - cpu)
    return wall_best, cpu_best


def sum_bandwidth(threads: int) -> tuple[float, float]:
    """Bytes per second of a 256 MB sum with ``threads`` threads: by wall time, and by CPU time per thread."""
    torch.set_num_threads(threads)
    data = torch.ones(64 << 20)
    wall, cpu = best_of(lambda _: data.sum(), 7)
    return data.nbytes / wall, data.nbytes / (cpu / threads)


def make_pool(kind: str, pool: str, pool_bytes: int) -> torch.Tensor:
    """[2, LAYERS, N, BLOCK, KV_HEADS, W] in the KV dtype, N blocks filling ``pool_bytes``, random."""
    from xinserve.kernels import kv_quant

    dtype = kv_quant.storage_dtype(kind, torch.float32)
    width = kv_quant.head_width(HEAD_DIM, dtype)
    num_blocks = pool_bytes // (2 * LAYERS * BLOCK * KV_HEADS * width * dtype.itemsize)
    shape = (2, LAYERS, num_blocks, BLOCK, KV_HEADS, width)
    if pool == "thp":
        from xinserve.kernels.huge_pages import zeros_on_huge_pages

        cache = zeros_on_huge_pages(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype)
    for kv in range(2):
        for layer in range(LAYERS):
            for start in range(0, num_blocks, 4096):
                end = min(num_blocks, start + 4096)
                rows = torch.randn(end - start, BLOCK, KV_HEADS, HEAD_DIM)
                cache[kv, layer, start:end] = kv_quant.quantize(rows, dtype)
    return cache


def time_pool(cache: torch.Tensor, kind: str, pool: str, threads_list: list[int],
              floors: dict[int, tuple[float, float]], rng: np.random.Generator, args: argparse.Namespace) -> list[dict]:
    """One row per thread count: 4-layer steps over ``cache``, each layer with its own scattered tables."""
    from xinserve.kernels import cpp

    num_blocks, per_seq = cache.shape[2], CONTEXT // BLOCK
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
    # sets x layers block tables [BATCH, per_seq], each a fresh permutation of the pool
    tables = [[torch.from_numpy(rng.permutation(num_blocks)[: BATCH * per_seq].reshape(BATCH, per_seq)
                                .astype(np.int32)) for _ in range(LAYERS)] for _ in range(args.sets)]
    queries = [torch.randn(BATCH, HEADS, HEAD_DIM) for _ in range(LAYERS)]
    nbytes = LAYERS * 2 * BATCH * CONTEXT * KV_HEADS * cache.shape[-1] * cache.element_size()

    def step(i: int) -> None:
        for layer in range(LAYERS):
            cpp.paged_decode_attention(queries[layer], cache[0, layer], cache[1, layer], tables[i % args.sets][layer],
                                       lens, 0.125)

    rows = []
    for threads in threads_list:
        torch.set_num_threads(threads)
        wall, cpu = best_of(step, args.repeats)
        per_thread = cpu / threads  # the step's time if its threads ran side by side, unpreempted
        floor_wall, floor_cpu = floors[threads]
        rows.append({"kv_cache_dtype": kind, "pool": pool, "threads": threads, "wall_ms": wall * 1e3,
                     "cpu_ms": cpu * 1e3, "kv_mb": nbytes / 1e6, "gb_s_wall": nbytes / wall / 1e9,
                     "gb_s_cpu": nbytes / per_thread / 1e9, "floor_ms": nbytes / floor_cpu * 1e3,
                     "over_floor_cpu": per_thread * floor_cpu / nbytes, "over_floor_wall": wall * floor_wall / nbytes})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="auto,bfloat16,float16,int8,fp8_e4m3")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--pools", default="plain,thp")
    parser.add_argument("--pool-gib", type=float, default=1.0)
    parser.add_argument("--sets", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    threads_list = [int(t) for t in args.threads.split(",")]
    pools = [p for p in args.pools.split(",") if p != "thp" or importlib.util.find_spec("xinserve.kernels.huge_pages")]
    floors = {t: sum_bandwidth(t) for t in threads_list}
    rng = np.random.default_rng(0)
    rows = []
    with torch.inference_mode():
        for kind in args.kinds.split(","):
            for pool in pools:
                rows += time_pool(make_pool(kind, pool, int(args.pool_gib * (1 << 30))), kind, pool, threads_list,
                                  floors, rng, args)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    result = {"batch": BATCH, "context": CONTEXT, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
              "head_dim": HEAD_DIM, "block_size": BLOCK, "pool_gib": args.pool_gib, "cpu": model,
              "avx512": "avx512f" in lscpu, "load_average": Path("/proc/loadavg").read_text().split()[:3],
              "sum_gb_s": {t: {"wall": w / 1e9, "cpu": c / 1e9} for t, (w, c) in floors.items()}, "rows": rows}
    lines = ["256 MB sum, GB/s by wall / by CPU time per thread: "
             + ", ".join(f"{t} thread(s) {w / 1e9:.1f} / {c / 1e9:.1f}" for t, (w, c) in floors.items())
             + f" ({model}, AVX-512: {result['avx512']}, load {' '.join(result['load_average'])})", "",
             ("| KV dtype | pool | threads | wall ms (4 layers) | CPU ms | K/V MB | GB/s wall | GB/s CPU | "
              "floor ms | over floor (CPU) | over floor (wall) |"),
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['kv_cache_dtype']} | {r['pool']} | {r['threads']} | {r['wall_ms']:.2f} | {r['cpu_ms']:.2f} | "
              f"{r['kv_mb']:.1f} | {r['gb_s_wall']:.1f} | {r['gb_s_cpu']:.1f} | {r['floor_ms']:.2f} | "
              f"{r['over_floor_cpu']:.2f}x | {r['over_floor_wall']:.2f}x |" for r in rows]
    print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

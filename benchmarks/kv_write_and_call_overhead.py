"""What a decode step pays around the C++ kernels: the KV cache write, and the cost of one call.

1. ``write_kv`` per layer, reference (kernels/reference.py: quantize + index_copy_ per K and V) against
   the C++ candidate (kernels/cpp.py), for a decode step of batch 8 and 32 (one new token per sequence)
   into a pool of 4096 blocks of the 5M Llama of ../shared/PEERS.md (2 KV heads of 64, block 16), per
   KV cache dtype, float32 model.
2. The cost of calling the C++ decode attention on a trivial input (1 sequence, 1 token): straight to
   the Python module (what eager calls do), through the operator registered in C++
   (``torch.ops.xinserve_<key>``, what a compiled step calls now) and through a Python
   ``torch.library.custom_op`` wrapping the module (what a compiled step called before).

Timings are CPU time (``time.thread_time``, one torch thread), the least of ``--repeats`` rounds of
``--calls`` calls, per call. Prints markdown tables and writes
``benchmarks/results/kv_write_and_call_overhead.json``.

    python benchmarks/kv_write_and_call_overhead.py [--repeats N] [--calls N] [--out PATH]
"""

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "kv_write_and_call_overhead.json"
KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 2, 64, 16, 4096


def per_call(call: Callable[[], object], repeats: int, calls: int) -> float:
    """Least CPU seconds per call over ``repeats`` rounds of ``calls`` calls, after one warm-up call."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, (time.thread_time() - start) / calls)
    return best


def write_rows(repeats: int, calls: int) -> list[dict]:
    from xinserve.kernels import cpp, kv_quant, reference

    rows = []
    for kind in ("auto", "bfloat16", "int8"):
        dtype = kv_quant.storage_dtype(kind, torch.float32)
        width = kv_quant.head_width(HEAD_DIM, dtype)
        caches = [torch.zeros(BLOCKS, BLOCK, KV_HEADS, width, dtype=dtype) for _ in range(2)]
        for batch in (8, 32):
            # key and value as the attention layer passes them: views of the fused qkv projection
            qkv = torch.randn(batch, 4 * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM)
            _, key, value = qkv.split([4 * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            key, value = key.view(batch, KV_HEADS, HEAD_DIM), value.view(batch, KV_HEADS, HEAD_DIM)
            slots = torch.randperm(BLOCKS * BLOCK)[:batch]
            step = (key, value, *caches, slots)
            timed = {name: per_call(partial(f, *step), repeats, calls) * 1e6
                     for name, f in (("reference", reference.write_kv), ("cpp", cpp.write_kv))}
            rows.append({"kv_cache_dtype": kind, "batch": batch, "reference_us": timed["reference"],
                         "cpp_us": timed["cpp"], "speedup": timed["reference"] / timed["cpp"]})
    return rows


def call_rows(repeats: int, calls: int) -> list[dict]:
    from xinserve.kernels import cpp

    @torch.library.custom_op("xinserve_bench::paged_decode_attention", mutates_args=())
    def python_op(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return cpp._extension.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)

    args = (torch.randn(1, 4, HEAD_DIM), *(torch.randn(1, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(2)),
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.125)
    paths = {"python module (eager)": cpp._extension.paged_decode_attention,
             "operator registered in C++ (compiled, now)": cpp._ops.paged_decode_attention,
             "Python custom_op (compiled, before)": python_op}
    return [{"path": name, "us": per_call(partial(f, *args), repeats, calls) * 1e6} for name, f in paths.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with torch.inference_mode():
        writes, calls = write_rows(args.repeats, args.calls), call_rows(args.repeats, args.calls)
    lines = ["| KV dtype | batch | reference us | cpp us | speedup |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['kv_cache_dtype']} | {r['batch']} | {r['reference_us']:.1f} | {r['cpp_us']:.1f} | "
              f"{r['speedup']:.1f}x |" for r in writes]
    lines += ["", "| call path (1 x 1-token decode attention) | us per call |", "|---|---:|"]
    lines += [f"| {r['path']} | {r['us']:.1f} |" for r in calls]
    print("\n".join(lines))
    result = {"load_average": Path("/proc/loadavg").read_text().split()[:3], "write_kv": writes, "calls": calls}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

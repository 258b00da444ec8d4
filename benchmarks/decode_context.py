"""Decode step time against context length, for each CPU decode-attention kernel.

The 5M-parameter Llama of ../shared/PEERS.md (hidden 256, 4 layers, 4 heads / 2 KV heads), float32,
one thread: for contexts of 128, 512 and 1536 tokens (its context is 2048) and batch 1, 8 and 32, the engine prefills,
decodes a few steps, then times windows of ``engine.step()`` with ``decode_attention`` forced to
each implementation in turn (the reference gathers every context out of the paged cache and runs
SDPA with a mask; ``cpp`` reads the blocks in place). Engines alternate within one process and each
keeps its fastest window (on a shared machine the minimum is the least disturbed estimate). Prints a
markdown table and writes ``benchmarks/results/decode_context.json``.

    python benchmarks/decode_context.py [--quick]
"""

import json
import sys
from pathlib import Path

from engine_timing import LLAMA_5M, best_window, decode_args, decode_engine, decoding, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "decode_context.json"
IMPLEMENTATIONS = ("reference", "cpp")


def step_time(llm, batch: int, context: int, windows: int, window: int) -> float:
    """Best mean seconds per decode step of ``batch`` sequences at about ``context`` tokens."""
    with decoding(llm.engine, batch, context, windows * window):
        return best_window(llm.engine, windows, window)


def main() -> None:
    args = decode_args(__doc__, RESULTS, "fewer windows and contexts (a smoke run)")
    path = llama_5m(args.model_dir)
    import torch

    contexts, batches = ((128, 512), (1, 8)) if args.quick else ((128, 512, 1536), (1, 8, 32))
    windows, window = (2, 4) if args.quick else (5, 8)
    engines = {
        impl: decode_engine(path, max(batches), max(contexts), windows * window, kernels={"decode_attention": impl})
        for impl in IMPLEMENTATIONS
    }
    rows = []
    with torch.inference_mode():
        for context in contexts:
            for batch in batches:
                row = {"context": context, "batch": batch}
                for impl, llm in engines.items():
                    row[f"{impl}_ms"] = 1e3 * step_time(llm, batch, context, windows, window)
                row["speedup"] = row["reference_ms"] / row["cpp_ms"]
                rows.append(row)
                print(f"context {context:>5} batch {batch:>3}: reference {row['reference_ms']:.2f} ms, "
                      f"cpp {row['cpp_ms']:.2f} ms", file=sys.stderr)
    result = {"model": LLAMA_5M, "dtype": "float32", "threads": 1, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| context | batch | reference step ms | cpp step ms | speedup |\n|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['context']} | {row['batch']} | {row['reference_ms']:.2f} | {row['cpp_ms']:.2f} | "
              f"{row['speedup']:.2f}x |")


if __name__ == "__main__":
    main()

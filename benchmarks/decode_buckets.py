"""Decode step time per padded bucket and context length, eager vs torch.compile'd (CPU).

The 5M-parameter Llama of ../shared/PEERS.md (hidden 256, 4 layers, 4 heads / 2 KV heads), float32,
one thread. Two engines in one process: ``compile: off`` (eager, unpadded) and ``compile: on``
(every bucket 1, 2, 4, ..., 32 compiled with inductor, whatever it measures, so both columns
exist everywhere; ``auto`` would keep the compiled one only where it is faster). For each context
(128, 512, 1900: the model's context is 2048) and batch (1, 3 — padded to bucket 4 —, 8, 32) each
engine prefills, decodes a few steps, then times windows of ``engine.step()``; engines alternate and
each keeps its fastest window (on a shared machine the least disturbed estimate). Also reports the
start-up compile time (cold, or warm from the inductor cache). Prints a markdown table and writes
``benchmarks/results/decode_buckets.json``.

    python benchmarks/decode_buckets.py [--quick]
"""

import json
import os
import sys
import time
from pathlib import Path

from engine_timing import LLAMA_5M, best_window, decode_args, decode_engine, decoding, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "decode_buckets.json"
MODES = ("off", "on")


def step_time(llm, batch: int, context: int, windows: int, window: int) -> tuple[float, int]:
    """(best mean seconds per decode step of ``batch`` sequences at about ``context`` tokens, how
    many timed steps ran compiled)."""
    engine = llm.engine
    graphs = engine.runner.decode_graphs
    with decoding(engine, batch, context, windows * window):
        before = graphs.steps_run if graphs else 0
        best = best_window(engine, windows, window)
        return best, (graphs.steps_run if graphs else 0) - before


def main() -> None:
    args = decode_args(__doc__, RESULTS, "fewer windows, contexts and batches (a smoke run)")
    path = llama_5m(args.model_dir)
    import torch

    contexts, batches = ((128, 512), (1, 3, 8)) if args.quick else ((128, 512, 1900), (1, 3, 8, 32))
    windows, window = (2, 4) if args.quick else (5, 8)
    max_num_seqs = max(batches)
    engines, startup = {}, {}
    for mode in MODES:
        start = time.perf_counter()
        engines[mode] = decode_engine(path, max_num_seqs, max(contexts), windows * window, compile=mode,
                                      warm_up_in_background=False)  # every bucket before timing
        startup[mode] = time.perf_counter() - start
        print(f"compile {mode}: engine ready in {startup[mode]:.1f} s", file=sys.stderr)
    rows = []
    with torch.inference_mode():
        for context in contexts:
            for batch in batches:
                row = {"context": context, "batch": batch}
                for mode, llm in engines.items():
                    seconds, compiled_steps = step_time(llm, batch, context, windows, window)
                    row["eager_ms" if mode == "off" else "compiled_ms"] = 1e3 * seconds
                    if mode == "on":
                        row["compiled_steps"] = compiled_steps
                row["speedup"] = row["eager_ms"] / row["compiled_ms"]
                rows.append(row)
                print(f"context {context:>5} batch {batch:>3}: eager {row['eager_ms']:.2f} ms, "
                      f"compiled {row['compiled_ms']:.2f} ms", file=sys.stderr)
    load = os.getloadavg()[0]
    result = {"model": LLAMA_5M, "dtype": "float32", "threads": 1, "startup_s": startup, "load_avg_1m_after": load,
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"start-up: eager {startup['off']:.1f} s, compiled {startup['on']:.1f} s; load average {load:.2f}")
    print("| context | batch | bucket | eager step ms | compiled step ms | speedup |\n|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        bucket = 1 << (row["batch"] - 1).bit_length()
        print(f"| {row['context']} | {row['batch']} | {min(bucket, max_num_seqs)} | {row['eager_ms']:.2f} | "
              f"{row['compiled_ms']:.2f} | {row['speedup']:.2f}x |")


if __name__ == "__main__":
    main()

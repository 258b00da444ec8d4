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

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "decode_context.json"
MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
IMPLEMENTATIONS = ("reference", "cpp")


@contextmanager
def decoding(engine, batch: int, context: int, steps: int) -> Iterator[None]:
    """``batch`` sequences of ``context`` prompt tokens, prefilled and 4 decode steps in, with
    ``steps`` more tokens to go; aborted on exit."""
    from engines import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8 + steps, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{batch}-{context}-{i}", [7 + (i * 31 + j * 7) % 900 for j in range(context)], params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    try:
        yield
    finally:
        for request_id in list(engine.requests):
            engine.abort_request(request_id)


def best_window(engine, windows: int, window: int) -> float:
    """The fastest mean seconds per ``engine.step()`` over ``windows`` windows of ``window`` steps."""
    best = float("inf")
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(window):
            engine.step()
        best = min(best, (time.perf_counter() - start) / window)
    return best


def step_time(llm, batch: int, context: int, windows: int, window: int) -> float:
    """Best mean seconds per decode step of ``batch`` sequences at about ``context`` tokens."""
    with decoding(llm.engine, batch, context, windows * window):
        return best_window(llm.engine, windows, window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer windows and contexts (a smoke run)")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from engines import LLM
    from server.embedded_model.factory import ensure_tiny_model

    torch.set_num_threads(1)
    contexts, batches = ((128, 512), (1, 8)) if args.quick else ((128, 512, 1536), (1, 8, 32))
    windows, window = (2, 4) if args.quick else (5, 8)
    path = str(ensure_tiny_model(args.model_dir, name="llama-5m", **MODEL))
    num_blocks = max(batches) * (-(-(max(contexts) + 8 + windows * window) // 16)) + 16
    engines = {
        impl: LLM(path, dtype="float32", num_kv_blocks=num_blocks, max_num_seqs=max(batches), block_size=16,
                  max_num_batched_tokens=4096, kernels={"decode_attention": impl})
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
    result = {"model": MODEL, "dtype": "float32", "threads": 1, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| context | batch | reference step ms | cpp step ms | speedup |\n|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['context']} | {row['batch']} | {row['reference_ms']:.2f} | {row['cpp_ms']:.2f} | "
              f"{row['speedup']:.2f}x |")


if __name__ == "__main__":
    main()

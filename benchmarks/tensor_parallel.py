"""Decode step time at tensor-parallel size 1 and 2 on the CPU, and the collectives per step.

The 33M-parameter Llama of decode_step.py (random weights, built locally), batch 1 and 8 with
128-token prompts, greedy, ignore_eos. TP=1 runs with ``--threads`` torch threads, TP=2 with
``--threads`` / 2 per rank, so both use the same cores (on a 2-core machine no gain is expected:
the point is the communication cost). The collectives are counted by rank 0's
``xinserve.engines.distributed.ParallelGroup.counts`` over the timed steps. Prints a markdown table and
writes ``benchmarks/results/tensor_parallel.json``.

    python benchmarks/tensor_parallel.py [--threads 2]
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from engine_timing import collectives_per_step

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "tensor_parallel.json"
SHAPE = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536,
         "vocab_size": 8000}
BATCHES = (1, 8)
PROMPT_LEN, WARM_STEPS, WINDOW = 128, 4, 10


def measure(model_path: str, tp: int, threads: int, windows: int) -> list[dict]:
    import torch

    from xinserve.engines import LLM
    from xinserve.engines.parallel_config import ParallelConfig

    torch.set_num_threads(threads)
    options = {"num_kv_blocks": max(BATCHES) * 24 + 8, "max_num_seqs": max(BATCHES), "block_size": 16}
    if tp > 1:
        options |= {"tensor_parallel_size": tp,
                    "parallel": ParallelConfig(devices=["cpu"] * tp, cpu_threads=max(1, threads // tp))}
    with LLM(model_path, **options) as llm:
        return [{"tp": tp, "batch": batch, "step_ms": step_ms, "collectives_per_step": counts}
                for batch, step_ms, counts in collectives_per_step(llm.engine, BATCHES, PROMPT_LEN, WARM_STEPS,
                                                                    WINDOW, windows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (split between ranks)")
    parser.add_argument("--windows", type=int, default=5, help=f"timed windows of {WINDOW} steps per batch")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from xinserve.server.embedded_model.factory import ensure_tiny_model

    path = str(ensure_tiny_model(args.model_dir, name="llama-30m", **SHAPE))
    rows = measure(path, 1, args.threads, args.windows) + measure(path, 2, args.threads, args.windows)
    result = {"model": "llama-30m", "threads": args.threads, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))


def render(result: dict) -> str:
    lines = ["| model | TP | batch | decode step ms | collectives per step |", "|---|---:|---:|---:|---|"]
    for row in result["rows"]:
        counts = ", ".join(f"{v:g} {k}" for k, v in sorted(row["collectives_per_step"].items())) or "none"
        lines.append(f"| {result['model']} | {row['tp']} | {row['batch']} | {row['step_ms']:.2f} | {counts} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

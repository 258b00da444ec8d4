"""Decode step time on CPU ranks at TP 1, TP 2, PP 2 and EP 2, with the collectives counted per step.

A small Qwen3-MoE (random weights, built locally: hidden 256, 4 layers, the first dense, 8 experts
top-2), batch 1 and 8 with 64-token prompts, greedy, ignore_eos. Every layout uses ``--threads``
torch threads in all (split between its ranks), so on a 2-core machine no speed gain is expected:
the point is the communication each layout costs per step, counted by rank 0's
``xinserve.engines.distributed.ParallelGroup.counts`` (rank 0's view: under PP the other stage's sends are
not in it). Prints a markdown table and writes ``benchmarks/results/parallel_collectives.json``.

    python benchmarks/parallel_collectives.py [--threads 2]
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from engine_timing import collectives_per_step

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "parallel_collectives.json"
SHAPE = {"arch": "qwen3_moe", "hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
         "intermediate_size": 768, "vocab_size": 4000, "moe_intermediate_size": 128}
LAYOUTS = {  # name -> (tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel)
    "TP 1": (1, 1, False), "TP 2": (2, 1, False), "PP 2": (1, 2, False), "EP 2": (2, 1, True),
}
BATCHES = (1, 8)
PROMPT_LEN, WARM_STEPS, WINDOW = 64, 4, 10


def measure(model_path: str, layout: str, threads: int, windows: int) -> list[dict]:
    import torch

    from xinserve.engines import LLM
    from xinserve.engines.parallel_config import ParallelConfig

    tp, pp, ep = LAYOUTS[layout]
    torch.set_num_threads(threads)
    options = {"num_kv_blocks": max(BATCHES) * 16 + 8, "max_num_seqs": max(BATCHES), "block_size": 16}
    if tp * pp > 1:
        options |= {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "enable_expert_parallel": ep,
                    "parallel": ParallelConfig(devices=["cpu"] * tp * pp, cpu_threads=max(1, threads // (tp * pp)))}
    with LLM(model_path, **options) as llm:
        return [{"layout": layout, "batch": batch, "step_ms": step_ms, "collectives_per_step": counts}
                for batch, step_ms, counts in collectives_per_step(llm.engine, BATCHES, PROMPT_LEN, WARM_STEPS,
                                                                    WINDOW, windows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (split between ranks)")
    parser.add_argument("--windows", type=int, default=3, help=f"timed windows of {WINDOW} steps per batch")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from xinserve.server.embedded_model.factory import ensure_tiny_model

    path = str(ensure_tiny_model(args.model_dir, name="qwen3-moe-bench", **SHAPE))
    rows = [row for layout in LAYOUTS for row in measure(path, layout, args.threads, args.windows)]
    result = {"model": "qwen3-moe-bench", "threads": args.threads, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(render(result))


def render(result: dict) -> str:
    lines = ["| layout | batch | decode step ms | collectives per step (rank 0) |", "|---|---:|---:|---|"]
    for row in result["rows"]:
        counts = ", ".join(f"{v:g} {k}" for k, v in sorted(row["collectives_per_step"].items())) or "none"
        lines.append(f"| {row['layout']} | {row['batch']} | {row['step_ms']:.2f} | {counts} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

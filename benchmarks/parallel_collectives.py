"""Decode step time on CPU ranks per parallel layout (TP 1, TP 2, PP 2, EP 2), with the collectives per step.

A small model with random weights, built locally: by default a Qwen3-MoE (hidden 256, 4 layers, the first
dense, 8 experts top-2, 64-token prompts); ``--model llama-30m`` a dense 33M-parameter Llama (hidden 512,
8 layers, 128-token prompts; expert parallelism does not apply, so its layouts are TP 1 and TP 2). Batch
1 and 8, greedy, ignore_eos. Every layout uses ``--threads`` torch threads in all (split between its
ranks), so on a 2-core machine no speed gain is expected: the point is the communication each layout
costs per step, counted by rank 0's ``xinserve.engines.parallel.distributed.ParallelGroup.counts`` (rank 0's view:
under PP the other stage's sends are not in it). Prints a markdown table and writes
``benchmarks/results/parallel_collectives.json``. The committed result:

    python benchmarks/parallel_collectives.py

Smoke run: ``python benchmarks/parallel_collectives.py --layouts "TP 1" --windows 1 --out /tmp/par.json``.
"""

import sys

from common import ROOT, collectives_per_step, markdown_table, script_args, write_result

MODELS = {  # name -> (make_tiny_model's shape, prompt tokens, KV blocks per sequence, layouts)
    "qwen3-moe-bench": ({"arch": "qwen3_moe", "hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
                         "intermediate_size": 768, "vocab_size": 4000, "moe_intermediate_size": 128},
                        64, 16, ("TP 1", "TP 2", "PP 2", "EP 2")),
    "llama-30m": ({"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1536,
                   "vocab_size": 8000}, 128, 24, ("TP 1", "TP 2")),
}
LAYOUTS = {  # name -> (tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel)
    "TP 1": (1, 1, False), "TP 2": (2, 1, False), "PP 2": (1, 2, False), "EP 2": (2, 1, True),
}
BATCHES = (1, 8)
WARM_STEPS, WINDOW = 4, 10


def measure(model_path: str, prompt_len: int, blocks_per_seq: int, layout: str, threads: int,
            windows: int) -> list[dict]:
    import torch

    from xinserve.engines import LLM
    from xinserve.engines.parallel.parallel_config import ParallelConfig

    tp, pp, ep = LAYOUTS[layout]
    torch.set_num_threads(threads)
    options = {"num_kv_blocks": max(BATCHES) * blocks_per_seq + 8, "max_num_seqs": max(BATCHES), "block_size": 16}
    if tp * pp > 1:
        options |= {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "enable_expert_parallel": ep,
                    "parallel": ParallelConfig(devices=["cpu"] * tp * pp, cpu_threads=max(1, threads // (tp * pp)))}
    with LLM(model_path, **options) as llm:
        return [{"layout": layout, "batch": batch, "step_ms": step_ms, "collectives_per_step": counts}
                for batch, step_ms, counts in collectives_per_step(llm.engine, BATCHES, prompt_len, WARM_STEPS,
                                                                    WINDOW, windows)]


def main() -> None:
    parser = script_args(__doc__, "parallel_collectives.json")
    parser.add_argument("--model", choices=list(MODELS), default="qwen3-moe-bench")
    parser.add_argument("--layouts", help="comma separated, e.g. 'TP 1,TP 2' (default: every layout of the model)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (split between ranks)")
    parser.add_argument("--windows", type=int, default=3, help=f"timed windows of {WINDOW} steps per batch")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from xinserve.server.embedded_model.factory import ensure_tiny_model

    shape, prompt_len, blocks_per_seq, layouts = MODELS[args.model]
    layouts = args.layouts.split(",") if args.layouts else layouts
    path = str(ensure_tiny_model(args.model_dir, name=args.model, **shape))
    rows = [row for layout in layouts for row in measure(path, prompt_len, blocks_per_seq, layout, args.threads,
                                                                 args.windows)]
    result = {"model": args.model, "threads": args.threads, "rows": rows}
    write_result(args.out, result)
    print(render(result))


def render(result: dict) -> str:
    return markdown_table(
        ("layout", "batch", "decode step ms", "collectives per step (rank 0)"),
        [(row["layout"], row["batch"], f"{row['step_ms']:.2f}",
          ", ".join(f"{v:g} {k}" for k, v in sorted(row["collectives_per_step"].items())) or "none")
         for row in result["rows"]])


if __name__ == "__main__":
    main()

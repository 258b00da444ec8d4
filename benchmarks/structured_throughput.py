"""Decode throughput at batch 32 with and without a JSON schema on every sequence (offline engine).

32 requests decode 128 tokens each, greedy and sampled (temperature 1.0, seeded). Unconstrained
requests use ``ignore_eos``; constrained ones a schema whose shortest valid output is longer than
128 tokens (an array of at least 40 bounded strings), so both runs generate the same number of
tokens. The constrained run pays for filling 32 token bitmasks per step, applying them, and
advancing each matcher; greedy also loses the argmax fast path. The target: within 15%.

Prints a markdown table and writes ``benchmarks/results/structured_throughput.json``.

    python benchmarks/structured_throughput.py            # the committed result: a random 3.6M-parameter Llama
    python benchmarks/structured_throughput.py --quick    # smoke run: the embedded tiny model, 1 repeat
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import torch
from common import script_args, write_result

from xinserve.engines import LLM, SamplingParams
from xinserve.server.embedded_model.factory import ensure_tiny_model

BATCH, PROMPT_LEN, MAX_TOKENS = 32, 16, 128
MODELS = {
    "llama-3.6m": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2},
    "llama-tiny": {},
}
SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 40}},
    "required": ["notes"],
}


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    """Output tokens per second of one ``generate`` of every prompt."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [len(o.token_ids) for o in outputs]
    if tokens != [MAX_TOKENS] * len(prompts):
        raise RuntimeError(f"expected {MAX_TOKENS} tokens per request, got {sorted(set(tokens))}")
    return sum(tokens) / seconds


def main() -> None:
    parser = script_args(__doc__, "structured_throughput.json", "the embedded tiny model, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="runs per point, best kept (3; quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a worker's share of 2 cores)")
    args = parser.parse_args()
    name = "llama-tiny" if args.quick else "llama-3.6m"
    repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    path = ensure_tiny_model(args.model_dir, f"structured-{name}", **MODELS[name])
    llm = LLM(str(path), max_num_seqs=BATCH, block_size=16, num_kv_blocks=BATCH * 10 + 8)
    prompts = [[7 + (i * 31 + j * 7) % 900 for j in range(PROMPT_LEN)] for i in range(BATCH)]
    rows = []
    for mode, base in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 1.0, "seed": 1})):
        free = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **base)
        constrained = SamplingParams(max_tokens=MAX_TOKENS, json_schema=SCHEMA, **base)
        run(llm, prompts, constrained)  # warm-up, and the grammar is compiled and cached
        best = {"unconstrained": 0.0, "json_schema": 0.0}
        for _ in range(repeats):  # alternating, so that both see the same machine load
            best["unconstrained"] = max(best["unconstrained"], run(llm, prompts, free))
            best["json_schema"] = max(best["json_schema"], run(llm, prompts, constrained))
        rows.append({"mode": mode, "unconstrained_tok_s": best["unconstrained"],
                     "json_schema_tok_s": best["json_schema"],
                     "ratio": best["json_schema"] / best["unconstrained"]})
    print("| mode | unconstrained tok/s | json_schema tok/s | ratio |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['unconstrained_tok_s']:.0f} | {r['json_schema_tok_s']:.0f} | {r['ratio']:.3f} |")
    result = {"model": name, "batch": BATCH, "prompt_len": PROMPT_LEN, "max_tokens": MAX_TOKENS,
              "threads": args.threads, "repeats": repeats, "schema": SCHEMA, "torch": torch.__version__,
              "rows": rows}
    write_result(args.out, result)


if __name__ == "__main__":
    main()

"""Long-prompt prefill: one c=32 round of ~512-token prompts through the in-process engine, in CPU time.

The 5M-parameter Llama (``common.LLAMA_5M``: hidden 256, 4 layers, 4 heads / 2 KV heads), float32, one
thread, the engine's default token budget. Two rounds are timed for each prefill-attention
implementation the registry can choose on this machine (forced in turn): ``fresh`` (32 distinct
prompts of ``--prompt-tokens`` tokens, as in ``benchmarks/compare.py``'s long workload) and
``cached prefix`` (the same 32 prompts after a shared prefix of ``--prefix-tokens`` tokens that one
earlier request put in the prefix cache). Each request asks for one token, so a round is the prefill
and nothing else. Per round: the process CPU seconds, prefill tokens per CPU second (the tokens the
round computed) and each request's TTFT in CPU seconds from the round's start (the median and the
last); the best of ``--repeats`` rounds is kept (CPU time is not free of a loaded machine's noise:
caches and frequency still move it).

``--profile`` also runs one fresh round per implementation under ``torch.profiler`` and adds the
breakdown of its CPU time by operator family to the result (``profile``; the profiler's own overhead
inflates the milliseconds, the shares are what it is for). Prints a markdown table and writes
``benchmarks/results/prefill.json``. The committed result:

    python benchmarks/prefill.py --profile

Smoke run: ``python benchmarks/prefill.py --quick --out /tmp/prefill.json``.
"""

import json
import statistics
import sys
import time

from common import LLAMA_5M, llama_5m, markdown_table, script_args, write_result

CONCURRENCY = 32
# operator families of the profile: an aten op's name -> its family (the first substring that matches)
FAMILIES = (
    ("linear", ("addmm", "aten::mm", "aten::linear", "aten::matmul")),
    ("prefill attention (SDPA)", ("scaled_dot_product", "_flash_attention", "_efficient_attention", "bmm",
                                  "baddbmm", "softmax")),
    ("KV gather / repeat", ("index_select", "repeat_interleave", "aten::expand", "aten::clone")),
    ("KV write", ("index_copy",)),
    ("norms, rotary, activations", ("rsqrt", "aten::pow", "aten::mean", "aten::mul", "aten::add", "aten::cat",
                                    "aten::silu", "aten::neg", "aten::flip", "aten::stack")),
    ("copies and layout", ("aten::copy_", "aten::contiguous", "aten::to", "aten::empty", "aten::slice",
                           "aten::view", "aten::transpose", "aten::reshape", "aten::select", "aten::split")),
)


def prompts(count: int, length: int, salt: int) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` token ids (none shares a first block with another)."""
    return [[7 + (salt * 131 + i * 31 + j * 7 + (j * j) % 13) % 900 for j in range(length)] for i in range(count)]


def run_round(llm, token_lists: list[list[int]]) -> dict:
    """Add every prompt at once, step until each has its first token; CPU seconds and TTFTs."""
    from xinserve.engines import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.process_time()
    for i, ids in enumerate(token_lists):
        engine.add_request(f"r{i}-{start}", ids, params)
    ttfts, steps = [], 0
    while engine.has_unfinished_requests():
        result = engine.step()
        steps += 1
        now = time.process_time() - start
        ttfts += [now] * sum(1 for o in result.outputs if o.new_token_ids)
    seconds = time.process_time() - start
    return {"cpu_s": seconds, "steps": steps, "ttft_median_s": statistics.median(ttfts), "ttft_last_s": max(ttfts)}


def best_round(llm, make_prompts, computed_tokens: int, repeats: int) -> dict:
    best = None
    for r in range(repeats):
        row = run_round(llm, make_prompts(r))
        if best is None or row["cpu_s"] < best["cpu_s"]:
            best = row
    best["prefill_tokens_per_cpu_s"] = computed_tokens / best["cpu_s"]
    return best


def profile_round(llm, token_lists: list[list[int]]) -> dict:
    """One round under torch.profiler: CPU milliseconds per operator family and the top operators."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_round(llm, token_lists)
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    families: dict[str, float] = {}
    for e in events:
        family = next((f for f, keys in FAMILIES if any(k in e.key for k in keys)), "other")
        families[family] = families.get(family, 0.0) + e.self_cpu_time_total
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    return {
        "profiled_cpu_ms": round(total_us / 1e3, 1),
        "families_percent": {f: round(100 * us / total_us, 1) for f, us in sorted(families.items(),
                                                                                   key=lambda kv: -kv[1])},
        "top_ops": [{"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2), "calls": e.count}
                    for e in top],
    }


def main() -> None:
    p = script_args(__doc__, "prefill.json", "one repeat, 8 requests (a smoke run)")
    p.add_argument("--profile", action="store_true", help="also profile a round per implementation")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--prefix-tokens", type=int, default=384)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--label", default="current")
    args = p.parse_args()
    path = llama_5m(args.model_dir)
    import torch

    from xinserve.engines import LLM
    from xinserve.kernels import registry

    count = 8 if args.quick else CONCURRENCY
    repeats = 1 if args.quick else args.repeats
    length = args.prompt_tokens
    prefix = prompts(1, args.prefix_tokens, salt=10_000)[0]
    probe = LLM(path, dtype="float32", max_num_seqs=CONCURRENCY)
    impls = [probe.engine.runner.kernels.chosen["prefill_attention"]]
    impls += [name for name, _ in probe.engine.runner.kernels.rejected.get("prefill_attention", [])]
    probe.close()
    impls = list(dict.fromkeys(impls + ["reference"]))
    rows, profiles = [], {}
    with torch.inference_mode():
        for impl in impls:
            try:
                llm = LLM(path, dtype="float32", max_num_seqs=CONCURRENCY, kernels={"prefill_attention": impl})
            except registry.KernelSelectionError as exc:
                print(f"{impl}: not usable here ({exc})", file=sys.stderr)
                continue
            budget = llm.engine.scheduler.max_num_batched_tokens
            run_round(llm, prompts(count, length, salt=99))  # warm-up: first-call allocations
            fresh = best_round(llm, lambda r: prompts(count, length, salt=r), count * length, repeats)
            run_round(llm, [prefix + [5]])  # puts the prefix's full blocks in the cache
            block_size = llm.engine.scheduler.block_manager.block_size
            hit = len(prefix) // block_size * block_size  # the prefix's full blocks are what the cache holds
            cached = best_round(llm, lambda r: [prefix + t for t in prompts(count, length - len(prefix), 100 + r)],
                                count * (length - hit), repeats)
            for workload, row in (("fresh", fresh), ("cached prefix", cached)):
                rows.append({"impl": impl, "workload": workload, **{k: round(v, 4) for k, v in row.items()}})
            if args.profile:
                profiles[impl] = profile_round(llm, prompts(count, length, salt=7))
                print(impl, json.dumps(profiles[impl]["families_percent"], indent=1), file=sys.stderr)
            llm.close()
    result = {"model": LLAMA_5M, "dtype": "float32", "threads": 1, "requests": count, "prompt_tokens": length,
              "prefix_tokens": args.prefix_tokens, "label": args.label, "rows": rows}
    if profiles:
        result["profile"] = {"model": LLAMA_5M, "dtype": "float32", "threads": 1, "requests": count,
                             "prompt_tokens": length, "token_budget": budget, "by_prefill_attention": profiles}
    write_result(args.out, result)
    print(markdown_table([c[0] for c in COLUMNS], [[fmt.format(row[key]) for _, key, fmt in COLUMNS] for row in rows]))


# the table's columns: (heading, row key, format)
COLUMNS = (("impl", "impl", "{}"), ("workload", "workload", "{}"), ("CPU s", "cpu_s", "{:.3f}"),
           ("prefill tok / CPU s", "prefill_tokens_per_cpu_s", "{:.0f}"), ("TTFT median CPU s", "ttft_median_s",
           "{:.3f}"), ("TTFT last CPU s", "ttft_last_s", "{:.3f}"), ("steps", "steps", "{}"))


if __name__ == "__main__":
    main()

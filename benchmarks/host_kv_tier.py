"""TTFT of a 2k-token prompt revisited after the device pool evicted it, with and without the host KV tier.

The offline engine on the 5M Llama (float32, blocks of 16, a pool just big enough for one such prompt):
each round runs the prompt cold, then a different prompt of the same length that evicts it, then the
prompt again, one output token each; the revisit is recomputed without the tier and reloaded from host
memory with it (``kv_offloading_size``). Also shown for scale: a revisit still in the pool. The median of
the rounds is reported. Prints a table and writes benchmarks/results/host_kv_tier.json.

    PYTHONPATH=. python benchmarks/host_kv_tier.py [--quick]
"""

import json
import random
import statistics
import time
from pathlib import Path

from engine_timing import decode_args, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "host_kv_tier.json"
PROMPT_TOKENS = 2000  # the 5M Llama's context is 2048


def ttft(llm, prompt: list[int]) -> float:
    """Seconds to the first token of ``prompt`` alone (its one output token)."""
    from xinserve.engines import SamplingParams

    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - start


def measure(path: str, tier_gib: float | None, rounds: int) -> dict:
    from xinserve.engines import LLM

    rng = random.Random(0)
    num_blocks = -(-(PROMPT_TOKENS + 1) // 16) + 2  # one prompt fits; the next one evicts it
    with LLM(path, dtype="float32", num_kv_blocks=num_blocks, block_size=16, max_num_batched_tokens=2048,
             kv_offloading_size=tier_gib) as llm:
        vocab = llm.engine.vocab_size
        samples: dict[str, list[float]] = {"cold": [], "in_pool": [], "after_eviction": []}
        for _ in range(rounds):
            prompt, other = ([rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(2))
            samples["cold"].append(ttft(llm, prompt))
            samples["in_pool"].append(ttft(llm, prompt))
            ttft(llm, other)  # evicts ``prompt`` from the pool
            samples["after_eviction"].append(ttft(llm, prompt))
        stats = llm.engine.stats()
    return {
        "kv_offloading_size_gib": tier_gib,
        **{f"ttft_{name}_s": round(statistics.median(values), 4) for name, values in samples.items()},
        "external_prefix_cache_hits_tokens": stats.external_prefix_cache_hits_total,
        "rounds": rounds,
    }


def main() -> None:
    args = decode_args(__doc__, RESULTS, "one round instead of five")
    path = llama_5m(args.model_dir)
    rounds = 1 if args.quick else 5
    rows = [measure(path, None, rounds), measure(path, 0.05, rounds)]
    print(f"{'host tier':>10} {'cold':>9} {'in pool':>9} {'after eviction':>15} {'tier hits (tokens)':>19}")
    for row in rows:
        tier = "off" if row["kv_offloading_size_gib"] is None else f"{row['kv_offloading_size_gib']} GiB"
        print(f"{tier:>10} {row['ttft_cold_s'] * 1000:>7.1f}ms {row['ttft_in_pool_s'] * 1000:>7.1f}ms "
              f"{row['ttft_after_eviction_s'] * 1000:>13.1f}ms {row['external_prefix_cache_hits_tokens']:>19}")
    speedup = rows[0]["ttft_after_eviction_s"] / rows[1]["ttft_after_eviction_s"]
    print(f"revisit after eviction: {speedup:.1f}x faster with the host tier")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "llama-5m float32, 1 thread", "prompt_tokens": PROMPT_TOKENS,
                                    "rows": rows, "after_eviction_speedup": round(speedup, 2)}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

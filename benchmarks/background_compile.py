"""How much the background bucket compile (engines/warmup.py) slows the steps that run beside it.

The 5M Llama of ../shared/PEERS.md, float32, one thread, ``max_num_seqs`` 8 (buckets 1, 2, 4, 8),
an empty inductor cache (a temporary TORCHINDUCTOR_CACHE_DIR) and a fresh process per batch size (inductor
also caches compiled code in memory: a second engine in one process found every bucket done), so every
bucket really compiles. The
engine decodes ``batch`` sequences without pause from the moment it is ready; each ``engine.step()``
is timed and filed under "while compiling" (the warm-up thread still running) or "after". A
``compile: off`` engine gives the eager step time with nothing beside it. Prints a table and writes
``benchmarks/results/background_compile.json``.

    python benchmarks/background_compile.py [--batch N]
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engine_timing import decode_args, decode_engine, decoding, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "background_compile.json"
CHILD_BATCH = "XINSERVE_BACKGROUND_COMPILE_BATCH"  # set for the child process that measures one batch size
CONTEXT = 128
AFTER_STEPS = 200
ROUND = 1000  # decode steps per round of sequences (the model's context is 2048)


def timed_steps(engine, batch: int, stop) -> list[float]:
    """Seconds of each decode step of ``batch`` sequences until ``stop(steps so far)``; new sequences
    (prefilled untimed) every ``ROUND`` steps."""
    times: list[float] = []
    while not stop(len(times)):
        with decoding(engine, batch, CONTEXT, ROUND):
            for _ in range(ROUND):
                if stop(len(times)):
                    break
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
    return times


def measure(batch: int, path: str) -> dict:
    """One batch size's row, in this process (a child of ``main``, with its own empty inductor cache)."""
    import torch

    eager = decode_engine(path, 8, CONTEXT, ROUND, compile="off")
    with torch.inference_mode():
        alone = timed_steps(eager.engine, batch, lambda n: n >= AFTER_STEPS)
    start = time.perf_counter()
    llm = decode_engine(path, 8, CONTEXT, ROUND, compile="on")
    ready_s = time.perf_counter() - start
    warmup = llm.engine.warmup
    with torch.inference_mode():
        during = timed_steps(llm.engine, batch, lambda n, done=warmup.done: done.is_set())
        compiled_s = time.perf_counter() - start
        after = timed_steps(llm.engine, batch, lambda n: n >= AFTER_STEPS)
    row = {"batch": batch, "ready_s": round(ready_s, 2), "all_compiled_s": round(compiled_s, 2),
           "steps_while_compiling": len(during),
           "eager_alone_ms": round(1e3 * statistics.median(alone), 3),
           "while_compiling_ms": round(1e3 * statistics.median(during), 3) if during else None,
           "while_compiling_p90_ms": round(1e3 * statistics.quantiles(during, n=10)[-1], 3)
           if len(during) > 10 else None,
           "while_compiling_max_ms": round(1e3 * max(during), 3) if during else None,
           "after_ms": round(1e3 * statistics.median(after), 3),
           "buckets": {b: s["state"] for b, s in warmup.report()["buckets"].items()}}
    return row


def main() -> None:
    args = decode_args(__doc__, RESULTS, "batch 1 only")
    path = llama_5m(args.model_dir)
    child = os.environ.get(CHILD_BATCH)
    if child is not None:
        print(json.dumps(measure(int(child), path)))
        return
    rows = []
    for batch in (1,) if args.quick else (1, 8):
        env = {**os.environ, CHILD_BATCH: str(batch),
               "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="xinserve-inductor-")}
        done = subprocess.run([sys.executable, __file__, "--model-dir", args.model_dir], env=env, check=True,
                              stdout=subprocess.PIPE, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    load = os.getloadavg()[0]
    print(f"load average {load:.2f}")
    print("| batch | ready s | all compiled s | steps meanwhile | eager alone ms | while compiling ms (p90, max) "
          "| after ms |\n|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['ready_s']} | {r['all_compiled_s']} | {r['steps_while_compiling']} | "
              f"{r['eager_alone_ms']} | {r['while_compiling_ms']} ({r['while_compiling_p90_ms']}, "
              f"{r['while_compiling_max_ms']}) | {r['after_ms']} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load_average": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

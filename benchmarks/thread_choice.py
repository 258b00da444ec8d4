"""How the thread split's start-time timing decides (engines/thread_split.py), repeated, against the order it
replaced.

The 5M Llama of ../shared/PEERS.md, float32, C++ decode attention, eager, one decode forward at batch
32 x 512 over the engine's own KV pool (``decode_step_timer``). Per repetition, in one process:
``in one go`` times each thread count's forwards together and keeps the fastest of 5 (the order before
session 8), ``in turns`` is ``thread_split.choose`` (one forward per count per round, a warm-up round and
``ROUNDS`` more, the median kept). Prints each repetition's milliseconds and choice, and writes
``benchmarks/results/thread_choice.json``. ``--omp-wait-policy`` is set before torch loads (the server's
CPU workers run PASSIVE: server/pool.py).

    python benchmarks/thread_choice.py [--repeats 4] [--omp-wait-policy PASSIVE|default]
"""

import argparse
import json
import os
import tempfile
from pathlib import Path

from engine_timing import LLAMA_5M, decode_engine, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "thread_choice.json"
BATCH, CONTEXT, COUNTS = 32, 512, (1, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--omp-wait-policy", default="PASSIVE")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.omp_wait_policy != "default":  # before torch loads: libgomp reads it then
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    path = llama_5m(args.model_dir)
    import torch

    from xinserve.engines.thread_split import choose, decode_step_timer
    from xinserve.kernels.timing import TimingCache

    llm = decode_engine(path, BATCH, CONTEXT, 8, compile="off", kernels={"decode_attention": "cpp"})
    measure = decode_step_timer(llm.engine.runner, BATCH, CONTEXT)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.repeats):
            in_one_go = {}
            for n in COUNTS:
                torch.set_num_threads(n)
                measure()
                in_one_go[n] = min(measure() for _ in range(5))
            in_turns = choose(list(COUNTS), measure, f"repeat-{i}", TimingCache(Path(scratch) / "t.json")).seconds
            row = {"in_one_go_ms": {n: 1e3 * s for n, s in in_one_go.items()},
                   "in_turns_ms": {n: 1e3 * s for n, s in in_turns.items()},
                   "in_one_go_choice": min(COUNTS, key=lambda n: (in_one_go[n], n)),
                   "in_turns_choice": min(COUNTS, key=lambda n: (in_turns[n], n))}
            rows.append(row)
            print(" | ".join(f"{k} " + (", ".join(f"{n}t {v:.1f}" for n, v in row[k].items())
                                         if isinstance(row[k], dict) else str(row[k])) for k in row))
    llm.close()
    result = {"model": LLAMA_5M, "dtype": "float32", "batch": BATCH, "context": CONTEXT,
              "omp_wait_policy": args.omp_wait_policy, "load_average": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

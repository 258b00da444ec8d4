"""The fixed per-step cost of ``engine.step()`` at small batches (issue 25: at c=1 the batch-1 step is
~85% of TPOT), outside the GEMMs and attention.

The step is ``engine.step()`` in a loop, in process, on one thread, on the 5M Llama of
../shared/PEERS.md in float32 with the C++ decode attention, at batch 1, 8 and 32 with a short
context, with the decode bucket compiled (``compile="on"``, timed once the warm-up has settled) and
eager (``compile="off"``); a compiled bucket both as the engine calls it (without dynamo:
engines/direct_call.py) and through dynamo ("compiled via dynamo"), their windows taking turns. Per point: process CPU milliseconds per step (``time.process_time``: the
machine is shared, so wall time is noise) in the cheapest of several windows, then one cProfile run
of the same steps broken down by phase (cumulative CPU ms per step of the functions below; the
profiler's own cost inflates every phase alike, so compare phases, not totals), and ``_prepare`` alone timed without the profiler. Prints a markdown
table and writes ``benchmarks/results/step_overhead.json`` (``--out``).

    python benchmarks/step_overhead.py [--quick] [--batches 1,8,32] [--context 64] [--modes compiled,eager]
"""

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

from decode_floor import wait_settled
from engine_timing import LLAMA_5M, decode_engine, decoding, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "step_overhead.json"
# phase -> (file suffix, function name) whose cumulative time is the phase's
PHASES = {
    "schedule": ("engines/scheduler.py", "schedule"),
    "prepare": ("engines/runner.py", "_prepare"),
    "decode_rows": ("engines/decode_rows.py", "decode_rows"),
    "forward": ("engines/runner.py", "forward"),
    "bucket_fill": ("engines/decode_buckets.py", "fill"),
    "sample": ("engines/runner.py", "_sample"),
    "update": ("engines/scheduler.py", "update"),
    "step": ("engines/engine.py", "step"),
}


def cpu_ms_per_step(engine, windows: int, window: int, variants: dict) -> dict[str, float]:
    """Process CPU milliseconds per ``engine.step()`` in the cheapest of ``windows`` windows, per variant
    (name -> a function setting it up), the variants' windows taking turns so that load hits them alike."""
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(windows):
        for name, setup in variants.items():
            setup()
            start = time.process_time()
            for _ in range(window):
                engine.step()
            best[name] = min(best[name], (time.process_time() - start) / window)
    return {name: 1e3 * seconds for name, seconds in best.items()}


def direct_variants(engine) -> dict:
    """Compiled buckets called directly (engines/direct_call.py) and, for comparison, through dynamo."""
    graphs = engine.runner.decode_graphs
    if graphs is None or not graphs.direct:
        return {"": lambda: None}
    direct = dict(graphs.direct)
    return {"": lambda: setattr(graphs, "direct", dict(direct)),
            " via dynamo": lambda: setattr(graphs, "direct", {})}


def prepare_us(engine, rounds: int = 7, calls: int = 500) -> float:
    """Thread CPU microseconds of one ``runner._prepare`` of the current decode step, without the
    profiler (which inflates a function of many small calls several times over)."""
    scheduled = engine.scheduler.schedule()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            engine.runner._prepare(scheduled)
        best = min(best, (time.thread_time() - start) / calls)
    engine.scheduler.update(scheduled, engine.runner.execute(scheduled))
    return 1e6 * best


def phases_ms(engine, steps: int) -> dict[str, float]:
    """Cumulative CPU ms per step of each phase in ``PHASES``, under cProfile."""
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    out = {}
    for phase, (suffix, name) in PHASES.items():
        cum = sum(v[3] for (file, _, func), v in stats.items() if func == name and file.endswith(suffix))
        out[phase] = 1e3 * cum / steps
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter windows (a smoke run)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--modes", default="compiled,eager")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    windows, window, profiled = (3, 20, 50) if args.quick else (7, 40, 200)
    path = llama_5m(args.model_dir)
    import torch

    steps = 2 * (windows * window + profiled) + 16
    rows = []
    for mode in args.modes.split(","):
        torch.set_num_threads(1)
        llm = decode_engine(path, max(batches), args.context, steps, compile="on" if mode == "compiled" else "off",
                            kernels={"decode_attention": "cpp"})
        engine = llm.engine
        report = wait_settled(engine)
        print(f"{mode}: warm-up settled: {json.dumps(report['buckets'])}", file=sys.stderr)
        variants = direct_variants(engine)
        with torch.inference_mode():
            for batch in batches:
                with decoding(engine, batch, args.context, steps):
                    for _ in range(8):
                        engine.step()
                    cpu = cpu_ms_per_step(engine, windows, window, variants)
                    prepare = prepare_us(engine)
                    for name, setup in variants.items():
                        setup()
                        phases = phases_ms(engine, profiled)
                        row = {"mode": mode + name, "batch": batch, "context": args.context,
                               "cpu_ms_per_step": cpu[name], "prepare_cpu_us": prepare,
                               "profiled_ms_per_step": phases}
                        rows.append(row)
                        print(f"{mode + name} {batch}x{args.context}: {cpu[name]:.3f} CPU ms/step; profiled "
                              + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()), file=sys.stderr)
        llm.close()
    result = {"model": LLAMA_5M, "dtype": "float32", "decode_attention": "cpp", "threads": 1,
              "load_average": os.getloadavg(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    names = list(PHASES)
    print("| mode | batch x context | CPU ms/step | _prepare CPU us | " + " | ".join(f"{n} (prof.)" for n in names) + " |")
    print("|---|---|---:|---:|" + "---:|" * len(names))
    for r in rows:
        print(f"| {r['mode']} | {r['batch']} x {r['context']} | {r['cpu_ms_per_step']:.3f} | "
              f"{r['prepare_cpu_us']:.0f} | "
              + " | ".join(f"{r['profiled_ms_per_step'][n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()

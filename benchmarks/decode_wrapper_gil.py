"""Inductor's Python wrapper against its C++ wrapper for the compiled decode buckets, under async scheduling.

With async scheduling (engines/async_scheduling.py) the step thread runs step N's forward while the
loop's thread schedules and prepares N+1 in Python. The two overlap only while the forward does not
hold the GIL. Inductor's default Python wrapper runs each fused C++ kernel with the GIL held and drops
and retakes it around every extern op (the decode linears, the attention, the K/V write: ~30 per step
on the 5M Llama), so the loop's Python and the forward take turns; its C++ wrapper releases the GIL
once and runs the whole graph in C++. This benchmark builds the 5M Llama of ../shared/PEERS.md twice
in one process (float32, compiled decode buckets, one torch thread), one engine per wrapper, and
drives each with ``LLMEngine.async_steps`` over 32 requests of 32-token prompts, alternating arms.
Per arm: wall ms per steady full-batch step, the step thread's forward wall and CPU (wall minus CPU is
time without a core, mostly waiting for the GIL), the loop thread's CPU per step, and the compile time
of the buckets (the C++ wrapper compiles a C++ file more per bucket).

    python benchmarks/decode_wrapper_gil.py [--quick] [--batch 32] [--steps 96] [--repeats 3]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from engine_timing import LLAMA_5M, decode_engine, llama_5m
from step_timeline_hook import compile_with_cpp_wrapper

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "decode_wrapper_gil.json"


def build(path: str, cpp_wrapper: bool, batch: int, context: int, steps: int):
    """An engine whose buckets all compiled with the given wrapper; (engine, compile seconds)."""
    compile_with_cpp_wrapper(cpp_wrapper)
    start = time.perf_counter()
    llm = decode_engine(path, batch, context, steps, compile="on")
    engine = llm.engine
    while not engine.warmup.report()["settled"]:
        time.sleep(0.2)
    states = {size: b["state"] for size, b in engine.warmup.report()["buckets"].items()}
    if set(states.values()) != {"compiled"}:
        raise RuntimeError(f"buckets did not all compile: {states}")
    return engine, time.perf_counter() - start


def run(engine, batch: int, prompt: int, steps: int) -> dict:
    """One async-scheduled run; per steady full-batch step: wall, forward wall/CPU, loop CPU."""
    from xinserve.engines import SamplingParams

    runner, forwards = engine.runner, []
    forward = runner.forward

    def timed(b):
        w, c = time.perf_counter(), time.thread_time()
        out = forward(b)
        if not b.metadata.num_prefill_seqs and b.input_ids.shape[0] == batch:
            forwards.append((time.perf_counter() - w, time.thread_time() - c))
        return out

    runner.forward = timed
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [7 + (i * 31 + j * 7) % 400 for j in range(prompt)], params)
    stepper = engine.async_steps()
    marks = []  # (wall, loop thread CPU) after each step that returned a full batch of tokens
    try:
        while stepper.has_unfinished():
            outputs = stepper.step().outputs
            if len(outputs) == batch:
                marks.append((time.perf_counter(), time.thread_time()))
    finally:
        stepper.close()
        del runner.forward
    # Drop the first and last few steps (prefill ramp, the finish), keep the plateau.
    marks, forwards = marks[4:-4], forwards[4:-4]
    n = len(marks) - 1
    return {"step_ms": 1e3 * (marks[-1][0] - marks[0][0]) / n,
            "loop_cpu_ms": 1e3 * (marks[-1][1] - marks[0][1]) / n,
            "forward_wall_ms": 1e3 * statistics.mean(w for w, _ in forwards),
            "forward_cpu_ms": 1e3 * statistics.mean(c for _, c in forwards),
            "steps": n}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 4, few steps, one repeat (a smoke run)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.steps, args.repeats = 4, 24, 1
    import torch

    path = llama_5m(args.model_dir)
    torch.set_num_threads(1)
    engines, compile_s = {}, {}
    for label, cpp in (("python", False), ("cpp", True)):
        engines[label], compile_s[label] = build(path, cpp, args.batch, args.prompt, args.steps)
        print(f"{label} wrapper: buckets compiled in {compile_s[label]:.1f} s", flush=True)
    runs = {label: [] for label in engines}
    for rep in range(args.repeats):
        for label in engines if rep % 2 == 0 else reversed(list(engines)):
            r = run(engines[label], args.batch, args.prompt, args.steps)
            r["load"] = os.getloadavg()[0]
            runs[label].append(r)
            print(f"rep {rep} {label:7s} step {r['step_ms']:6.2f} ms  forward {r['forward_wall_ms']:6.2f} "
                  f"(cpu {r['forward_cpu_ms']:6.2f})  loop cpu {r['loop_cpu_ms']:5.2f}  load {r['load']:.2f}", flush=True)
    keys = ("step_ms", "forward_wall_ms", "forward_cpu_ms", "loop_cpu_ms")
    summary = {label: {k: statistics.median(r[k] for r in rs) for k in keys} | {"compile_s": compile_s[label]}
               for label, rs in runs.items()}
    print("\n| wrapper | step ms | forward wall ms | forward CPU ms | loop CPU ms/step | buckets compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, s in summary.items():
        print(f"| {label} | {s['step_ms']:.2f} | {s['forward_wall_ms']:.2f} | {s['forward_cpu_ms']:.2f} | "
              f"{s['loop_cpu_ms']:.2f} | {s['compile_s']:.1f} |")
    print(f"step python / cpp: {summary['python']['step_ms'] / summary['cpp']['step_ms']:.2f}x")
    if not args.quick:
        args.out.write_text(json.dumps({"model": LLAMA_5M, "batch": args.batch, "prompt": args.prompt,
                                        "cpu": _cpu_flags(), "summary": summary, "runs": runs}, indent=1))
        print(f"wrote {args.out}")


def _cpu_flags() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0]
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    threading.current_thread().name = "loop"
    main()

"""Where the decode step's time goes at batch x context (issue 25: the 32 x 512 step within 2x of its memory floor).

The step is ``engine.step()`` in a loop, in process, on the 5M Llama of ../shared/PEERS.md in float32 with the
C++ decode attention, eager (``compile="off"``: each kernel is a Python call that can be timed from outside),
on ``--threads`` torch threads. Every kernel function a layer calls is wrapped, from outside, in a clock (the
layers' ``ops`` swapped for a table of wrapped functions, the norms' and the MLP's bound functions replaced),
as are the runner's ``forward`` (decoder plus logits), ``compute_logits``, ``_prepare`` and ``_sample``. Per part:
wall and thread-CPU milliseconds per step, the cheapest of ``--windows`` windows each; the decode attention's
K/V read rate inside the step, and the same calls alone (replayed on the step's last arguments, the cache
cold: the rest of a step's reads evict it) against the machine's read bandwidth (decode_floor.read_bandwidth).
"the rest" is the step minus the timed parts (Python of the scheduler, the runner, the layers; tensor views).
Prints a markdown table and writes ``benchmarks/results/decode_step_breakdown.json``.

    python benchmarks/decode_step_breakdown.py [--point 32x512] [--threads 1] [--windows 5] [--window 10]
"""

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from decode_floor import read_bandwidth, step_bytes, wait_settled
from engine_timing import LLAMA_5M, decode_engine, decoding, llama_5m

RESULTS = Path(__file__).resolve().parent / "results" / "decode_step_breakdown.json"


class Clocks:
    """Wall and thread-CPU seconds and calls per name, for the functions wrapped by ``wrap``."""

    def __init__(self) -> None:
        self.wall, self.cpu, self.calls = defaultdict(float), defaultdict(float), defaultdict(int)
        self.last_args: dict[str, tuple] = {}

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            out = function(*args, **kwargs)
            self.cpu[name] += time.thread_time() - cpu
            self.wall[name] += time.perf_counter() - wall
            self.calls[name] += 1
            self.last_args[name] = (args, kwargs)
            return out
        return timed

    def reset(self) -> None:
        self.wall.clear(), self.cpu.clear(), self.calls.clear()


def instrument(engine, clocks: Clocks) -> None:
    """Wrap the model's kernel calls and the runner's phases (instance attributes: the classes are untouched)."""
    runner, model = engine.runner, engine.runner.model
    ops = runner.kernels.ops
    fields = ("linear", "paged_decode_attention", "write_kv", "rotary_embedding", "rotary_cos_sin")
    timed_ops = dataclasses.replace(ops, **{f: clocks.wrap(f, getattr(ops, f)) for f in fields})
    for module in model.modules():
        if getattr(module, "ops", None) is ops:
            module.ops = timed_ops
        for attribute in ("rms_norm", "silu_and_mul", "rotary_cos_sin"):
            if callable(getattr(module, attribute, None)) and attribute in vars(module):
                setattr(module, attribute, clocks.wrap(attribute, getattr(module, attribute)))
    model.compute_logits = clocks.wrap("compute_logits (lm_head linear, float)", model.compute_logits)
    for phase in ("forward", "_prepare", "_sample"):
        setattr(runner, phase, clocks.wrap(f"runner.{phase}", getattr(runner, phase)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--point", default="32x512", help="batch x context")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the server's CPU workers run (server/pool.py)
    batch, context = (int(x) for x in args.point.split("x"))
    path = llama_5m(args.model_dir)
    import torch

    bandwidth = read_bandwidth(args.threads)
    steps = args.windows * args.window + 16
    llm = decode_engine(path, batch, context, steps, compile="off", kernels={"decode_attention": "cpp"})
    engine = llm.engine
    wait_settled(engine)
    clocks = Clocks()
    instrument(engine, clocks)
    best = None
    with torch.inference_mode(), decoding(engine, batch, context, steps):
        torch.set_num_threads(args.threads)
        for _ in range(3):
            engine.step()
        for _ in range(args.windows):
            clocks.reset()
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(args.window):
                engine.step()
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            if best is None or wall < best["step_wall"]:
                best = {"step_wall": wall, "step_cpu": cpu, "wall": dict(clocks.wall), "cpu": dict(clocks.cpu),
                        "calls": dict(clocks.calls)}
        # the attention alone: the step's last call replayed, each after a cold read of 64 MB
        attention = clocks.last_args["paged_decode_attention"]
        flush = torch.ones(16 << 20)
        alone = float("inf")
        for _ in range(args.windows * 4):
            flush.sum()
            start = time.perf_counter()
            engine.runner.kernels.ops.paged_decode_attention(*attention[0], **attention[1])
            alone = min(alone, time.perf_counter() - start)
        kv_bytes = step_bytes(engine.runner, batch, context)
    llm.close()
    n = args.window
    layers = LLAMA_5M["num_layers"]
    rows = [{"part": name, "calls_per_step": best["calls"][name] / n, "wall_ms": 1e3 * best["wall"][name] / n,
             "cpu_ms": 1e3 * best["cpu"][name] / n} for name in sorted(best["wall"], key=lambda k: -best["wall"][k])]
    leaf = [r for r in rows if not r["part"].startswith(("runner.", "compute_logits"))]
    step_ms, step_cpu_ms = 1e3 * best["step_wall"] / n, 1e3 * best["step_cpu"] / n
    prepare_sample = sum(r["wall_ms"] for r in rows if r["part"] in ("runner._prepare", "runner._sample"))
    rest = step_ms - sum(r["wall_ms"] for r in leaf) - prepare_sample
    attention_row = next(r for r in rows if r["part"] == "paged_decode_attention")
    kv = kv_bytes["kv"]
    result = {"model": LLAMA_5M, "dtype": "float32", "mode": "eager", "threads": args.threads, "batch": batch,
              "context": context, "load_average": os.getloadavg(), "read_bandwidth_gb_s": bandwidth / 1e9,
              "step_ms": step_ms, "step_cpu_ms": step_cpu_ms, "floor_ms": 1e3 * kv_bytes["total"] / bandwidth,
              "rest_ms": rest, "parts": rows,
              "attention_gb_s_in_step": kv / (attention_row["wall_ms"] * 1e-3) / 1e9,
              "attention_gb_s_alone": kv / layers / alone / 1e9}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{batch} x {context}, {args.threads} thread(s), eager, load {os.getloadavg()[0]:.1f}: step {step_ms:.2f} ms "
          f"(thread CPU {step_cpu_ms:.2f}), floor {result['floor_ms']:.2f} ms at {bandwidth / 1e9:.1f} GB/s; "
          f"attention reads K/V at {result['attention_gb_s_in_step']:.1f} GB/s in the step, "
          f"{result['attention_gb_s_alone']:.1f} GB/s alone")
    print("| part | calls / step | wall ms / step | thread CPU ms / step |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['part']} | {r['calls_per_step']:.0f} | {r['wall_ms']:.2f} | {r['cpu_ms']:.2f} |")
    print(f"| the rest (step minus the parts) | | {rest:.2f} | |")
    print(f"| **step** | | **{step_ms:.2f}** | **{step_cpu_ms:.2f}** |")


if __name__ == "__main__":
    sys.exit(main())

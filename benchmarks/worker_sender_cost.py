"""The worker's own CPU per step for sending its outputs: inline (``--no-async-scheduling``) against
the sender thread (server/output_sender.py), with an engine that does no forward at all.

``WorkerLoop._step`` runs ``--steps`` times around a null engine that sleeps ``--step-ms`` (a forward's
time, without its CPU) and returns ``--batch`` one-token outputs per step; a reader in another process takes every frame over ipc://, so the CPU measured
(``time.process_time``: this process, every thread) is the loop's and the sender's, not the reader's.
Also reported: the bytes of a step's frame. Writes benchmarks/results/worker_sender_cost.json.

Run: python benchmarks/worker_sender_cost.py [--batch 32] [--steps 4000]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xinserve.engines.outputs import EngineStats, StepOutput, StepResult
from xinserve.server import messages
from xinserve.server.bench.cli import machine
from xinserve.server.worker import WorkerLoop


class NullEngine:
    """Every step: one token for each of ``batch`` requests named by short handles, as the server's are."""

    def __init__(self, batch: int, step_s: float = 0.0) -> None:
        self.outputs = [StepOutput(format(i, "x"), 0, [1000 + i]) for i in range(batch)]
        self.step_s = step_s

    def step(self) -> StepResult:
        time.sleep(self.step_s)  # the forward's time, without its CPU (a forward releases the GIL too)
        return StepResult(list(self.outputs))

    def has_unfinished_requests(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return EngineStats(len(self.outputs), 0, 0.0, 0, 0, 0, 0, 0)


# The reader imports nothing but zmq: it is up in a moment, and none of its CPU lands on this process.
READER = """
import sys, zmq
pull = zmq.Context().socket(zmq.PULL)
pull.bind(sys.argv[1])
while pull.recv() != b"end":  # merged frames are fewer than the steps: the end is marked
    pass
"""


def run(batch: int, steps: int, async_scheduling: bool, addr: str, step_s: float) -> float:
    """CPU microseconds per step of the loop (and its sender thread)."""
    reader = subprocess.Popen([sys.executable, "-c", READER, addr])
    ctx = zmq.Context()
    push, idle = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.connect(addr)
    loop = WorkerLoop(NullEngine(batch, step_s), idle, push, "bench", async_scheduling=async_scheduling)
    loop._stats_if_due = lambda force=False: None  # stats are not what is measured
    push.send(messages.encode(messages.Outputs([])))  # the connection is up before the clock starts
    steps -= 1
    start = time.process_time()
    for _ in range(steps):
        loop._step()
    if loop.sender is not None:
        loop.sender.close(timeout_s=60)
    cpu = time.process_time() - start
    push.send(b"end")
    reader.wait(120)
    push.close(linger=0)
    idle.close(linger=0)
    ctx.term()
    return cpu / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--step-ms", type=float, default=1.0, help="each step sleeps this long (0: a flood)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "worker_sender_cost.json")
    args = p.parse_args(argv)
    runs: dict[str, list[float]] = {"inline": [], "sender thread": []}
    with tempfile.TemporaryDirectory(prefix="xinserve-sender-") as tmp:
        for rep in range(args.repeats):
            for label, flag in (("inline", False), ("sender thread", True)):
                runs[label].append(run(args.batch, args.steps, flag, f"ipc://{tmp}/out{rep}{int(flag)}",
                                       args.step_ms / 1000))
                print(f"rep {rep} {label:<14} {runs[label][-1]:7.1f} CPU us per step", flush=True)
    frame = len(messages.encode(messages.Outputs(NullEngine(args.batch).step().outputs)))
    summary = {label: statistics.median(values) for label, values in runs.items()}
    print(f"batch {args.batch}: inline {summary['inline']:.1f} us/step, sender thread "
          f"{summary['sender thread']:.1f} us/step; frame {frame} bytes ({frame / args.batch:.1f} per token)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "load_average": os.getloadavg(), "batch": args.batch,
                                    "steps": args.steps, "step_ms": args.step_ms, "cpu_us_per_step": runs, "median": summary,
                                    "frame_bytes": frame}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How long the model sits idle between decode steps in the worker loop, and the host CPU per step.

A real ``WorkerLoop`` drives the 5M Llama (float32, eager) over ZeroMQ ipc sockets; a consumer
process reads and decodes its messages (the HTTP process's side of a real socket). From outside the
product code the benchmark wraps the runner's ``forward`` (on whichever thread runs it) and the
loop's methods with stopwatches: per step, the idle wall time from one forward's end to the next
one's start (sampling, the scheduler's update, sending outputs, taking messages, scheduling and
preparing the next step: all that stands between two forwards), the forward's wall and CPU time, the
host CPU per step outside the forward (process CPU minus forward CPU) and the CPU of each loop method
(``time.thread_time``). Arms, alternating over repeats: ``async`` (async scheduling: step N+1
scheduled while N runs on the step thread), ``sender`` (the non-blocking sender only, steps one at a
time: the code before async scheduling) and ``sync`` (``async_scheduling`` off).
On a shared machine wall times are noise; compare the CPU columns, and the idle time between arms
of the same run.

Run: python benchmarks/worker_gap.py [--batches 8,32] [--steps 120] [--repeats 2]
"""

import argparse
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_timing import decode_engine, llama_5m

LOOP_METHODS = ("_emit", "_drain", "_report_warmup", "_stats_if_due", "_report_failed")


def _consume(addr: str, stop_addr: str) -> None:
    """The HTTP side: receive and decode every message until told to stop."""
    import zmq

    from xinserve.server import messages

    ctx = zmq.Context()
    pull, stop = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    pull.bind(addr)
    stop.bind(stop_addr)
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    poller.register(stop, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if pull in ready:
            messages.decode_from_worker(pull.recv())
        if stop in ready:
            break


class Timeline:
    """Stopwatches around the runner's forward (on whichever thread runs it) and the loop's methods."""

    def __init__(self, loop, steps: int) -> None:
        self.loop, self.steps = loop, steps
        self.marks: list[tuple[float, float, float, float]] = []  # forward: (wall start, cpu start, wall end, cpu end)
        self.method_cpu = dict.fromkeys(LOOP_METHODS, 0.0)
        runner = loop.engine.runner
        forward = runner.forward

        def timed_forward(batch):
            w, c = time.perf_counter(), time.thread_time()
            logits = forward(batch)
            self.marks.append((w, c, time.perf_counter(), time.thread_time()))
            if len(self.marks) >= self.steps:
                loop.running = False
            return logits

        runner.forward = timed_forward
        for name in LOOP_METHODS:
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        method = getattr(self.loop, name)

        def timed(*args, **kwargs):
            c = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.method_cpu[name] += time.thread_time() - c

        setattr(self.loop, name, timed)

    def close(self) -> None:
        del self.loop.engine.runner.forward  # back to the class's method

    def summary(self, skip: int, cpu_s: float) -> dict:
        """``cpu_s``: the process's CPU over the whole run."""
        marks = self.marks[skip:]
        idle = [b[0] - a[2] for a, b in itertools.pairwise(marks)]  # from one forward's end to the next's start
        forward_cpu = sum(m[3] - m[1] for m in self.marks)
        return {
            "steps": len(marks),
            "idle_wall_ms_median": 1e3 * statistics.median(idle),
            "idle_wall_ms_mean": 1e3 * sum(idle) / len(idle),
            "forward_wall_ms_median": 1e3 * statistics.median(m[2] - m[0] for m in marks),
            "forward_cpu_ms_median": 1e3 * statistics.median(m[3] - m[1] for m in marks),
            # everything but the forward: sampling, scheduling, inputs, update, messages, the loop
            "host_cpu_ms_per_step": 1e3 * (cpu_s - forward_cpu) / len(self.marks),
            "method_cpu_us_per_step": {k: 1e6 * v / len(self.marks) for k, v in self.method_cpu.items()},
        }


def run_arm(llm, batch: int, prompt_len: int, steps: int, arm: str, tag: str) -> dict:
    import zmq

    from xinserve.engines import SamplingParams
    from xinserve.server import messages
    from xinserve.server.worker import WorkerLoop

    tmp = tempfile.mkdtemp(prefix="xinserve-gap-")
    out_addr, stop_addr, in_addr = (f"ipc://{tmp}/{n}" for n in ("out", "stop", "in"))
    consumer = mp.get_context("spawn").Process(target=_consume, args=(out_addr, stop_addr), daemon=True)
    consumer.start()
    ctx = zmq.Context()
    to_worker, recv, send, stop = (ctx.socket(k) for k in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PUSH))
    to_worker.bind(in_addr)
    recv.connect(in_addr)
    send.connect(out_addr)
    stop.connect(stop_addr)
    loop = WorkerLoop(llm.engine, recv, send, "bench", heartbeat_s=60, async_scheduling=arm != "sync")
    if arm == "sender":
        loop.async_steps.close()
        loop.async_steps = None
    timeline = Timeline(loop, steps + batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 2 * batch + 8, ignore_eos=True)
    for i in range(batch):
        prompt = [7 + (i * 31 + j * 7) % 900 for j in range(prompt_len)]
        to_worker.send(messages.encode(messages.add_request(f"{tag}-{i}", prompt, params)))
    while recv.poll(0) == 0:
        time.sleep(0.001)
    time.sleep(0.05)  # every Add queued: the first drain admits them all
    cpu = time.process_time()
    thread = threading.Thread(target=loop.run)
    thread.start()
    thread.join()
    cpu = time.process_time() - cpu
    for request_id in list(llm.engine.requests):
        llm.engine.abort_request(request_id)
    stop.send(b"")
    consumer.join(30)
    for s in (to_worker, recv, send, stop):
        s.close(linger=0)
    ctx.term()
    timeline.close()
    # The first steps prefill; the idle time is measured over steady decode steps.
    summary = timeline.summary(batch, cpu)
    summary["process_cpu_us_per_token"] = 1e6 * cpu / (batch * len(timeline.marks))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="8,32")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--arms", default="async,sender,sync")
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "xinserve-bench"))
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "worker_gap.json")
    args = p.parse_args(argv)
    import torch

    path = llama_5m(args.model_dir)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    arms = args.arms.split(",")
    llm = decode_engine(path, max(batches), args.prompt_len, args.steps + 2 * max(batches) + 8, compile="off")
    runs: dict[str, dict[str, list[dict]]] = {arm: {} for arm in arms}
    for rep in range(args.repeats):
        for batch in batches:
            for arm in arms if rep % 2 == 0 else reversed(arms):
                r = run_arm(llm, batch, args.prompt_len, args.steps, arm, f"{rep}-{batch}-{arm}")
                runs[arm].setdefault(f"batch={batch}", []).append(r)
                print(f"rep {rep} batch {batch:<3} {arm:<6} idle {r['idle_wall_ms_median']:6.2f} ms  "
                      f"forward {r['forward_wall_ms_median']:6.2f} ms (cpu {r['forward_cpu_ms_median']:6.2f})  "
                      f"host cpu/step {r['host_cpu_ms_per_step']:6.2f} ms  cpu/token {r['process_cpu_us_per_token']:5.0f} us  "
                      f"{ {k: round(v) for k, v in r['method_cpu_us_per_step'].items()} }", flush=True)
    summary = {level: {arm: {k: statistics.median(r[k] for r in runs[arm][level])
                             for k in ("idle_wall_ms_median", "idle_wall_ms_mean", "forward_wall_ms_median",
                                       "forward_cpu_ms_median", "host_cpu_ms_per_step", "process_cpu_us_per_token")}
                       for arm in arms} for level in runs[arms[0]]}
    print(f"{'level':<10}{'arm':<8}{'idle ms':>9}{'forward ms':>12}{'fwd cpu ms':>12}{'host cpu ms':>13}"
          f"{'cpu us/token':>14}")
    for level, row in summary.items():
        for arm, v in row.items():
            print(f"{level:<10}{arm:<8}{v['idle_wall_ms_median']:>9.3f}{v['forward_wall_ms_median']:>12.2f}"
                  f"{v['forward_cpu_ms_median']:>12.2f}{v['host_cpu_ms_per_step']:>13.2f}{v['process_cpu_us_per_token']:>14.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"load_average": os.getloadavg(), "threads": args.threads,
                                    "prompt_len": args.prompt_len, "runs": runs, "summary": summary}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

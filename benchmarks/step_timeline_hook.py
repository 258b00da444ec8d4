"""Installed into a served worker from outside the product code (benchmarks/server_step_timeline.py):
stopwatches around the step loop, written to a JSON file on a signal.

The benchmark puts a ``sitecustomize.py`` that imports this module first on the server's PYTHONPATH,
so every process of the server imports it at start; only a process that builds a ``WorkerLoop`` (the
engine worker) records. Recording starts on SIGUSR1 (everything before is dropped) and the timeline
is written to ``$XINSERVE_STEP_TIMELINE/<pid>.json`` on SIGUSR2. Per event: the thread, the wall
interval (``perf_counter``) and that thread's CPU over it (``thread_time``):

- ``forward``: the runner's forward (on the step thread with async scheduling), with its rows
  (negative for a step with prefill);
- ``run``: the whole step on the step thread (pending inputs, forward, argmax, the copy to the host);
- ``launch``: scheduling and preparing the next step on the loop's thread;
- ``wait``: the loop's thread blocked on the running step's result;
- ``resolve``: the scheduler's update with the step's tokens;
- ``emit``, ``drain``: sending outputs, taking messages.

Each thread's CPU time and context switches (voluntary, involuntary) over the recording come from
/proc/self/task.
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

EVENTS: list[tuple] = []  # (name, thread id, wall start, wall end, cpu start, cpu end, rows)
STATE = {"recording": False, "tasks": {}, "started": 0.0}


def task_counters() -> dict[int, dict]:
    """Per thread of this process: name, CPU seconds, voluntary and involuntary context switches."""
    out = {}
    tick = 1 / os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
            out[int(task.name)] = {
                "name": (task / "comm").read_text().strip(),
                "cpu_s": (int(stat[11]) + int(stat[12])) * tick,
                "voluntary": int(status["voluntary_ctxt_switches"]),
                "involuntary": int(status["nonvoluntary_ctxt_switches"]),
                "last_cpu": int(stat[36]),
            }
        except (OSError, KeyError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return out


def _record(name: str, w0: float, c0: float, rows: int = 0) -> None:
    if STATE["recording"]:
        EVENTS.append((name, threading.get_native_id(), w0, time.perf_counter(), c0, time.thread_time(), rows))


def _timed(name: str, function, rows=None):
    def timed(*args, **kwargs):
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            _record(name, w0, c0, rows(*args) if rows is not None else 0)

    return timed


def _start(*_) -> None:
    EVENTS.clear()
    STATE["tasks"] = task_counters()
    STATE["started"] = time.perf_counter()
    STATE["recording"] = True


def _dump(*_) -> None:
    STATE["recording"] = False
    after = task_counters()
    tasks = {tid: {"name": a["name"], **{k: a[k] - STATE["tasks"].get(tid, dict.fromkeys(a, 0))[k]
                                            for k in ("cpu_s", "voluntary", "involuntary")}}
             for tid, a in after.items()}
    # Python's threads are all "python" to the OS: name them by the events they recorded.
    roles = {e[1]: ("step" if e[0] in ("run", "forward") else "loop") for e in EVENTS}
    for tid, task in tasks.items():
        task["name"] = roles.get(tid, task["name"])
    out = Path(os.environ["XINSERVE_STEP_TIMELINE"]) / f"{os.getpid()}.json"
    out.write_text(json.dumps({"wall_s": time.perf_counter() - STATE["started"], "tasks": tasks,
                               "events": EVENTS}))


def install(loop) -> None:
    """Wrap one ``WorkerLoop``'s engine and step methods (instance attributes; the classes stay as they are)."""
    runner = loop.engine.runner
    # rows: a pure-decode step's, negative for a step with prefill
    runner.forward = _timed("forward", runner.forward, lambda batch: int(batch.input_ids.shape[0]) * (
        -1 if batch.metadata.num_prefill_seqs else 1))
    for name in ("_emit", "_drain"):
        setattr(loop, name, _timed(name.strip("_"), getattr(loop, name)))
    steps = loop.async_steps
    if steps is not None:
        steps._run = _timed("run", steps._run)
        steps._launch = _timed("launch", steps._launch)
        resolve = steps._resolve

        def timed_resolve(launched):
            w0, c0 = time.perf_counter(), time.thread_time()
            launched.future.exception()  # the wait for the step, apart from the update after it
            _record("wait", w0, c0)
            return _timed("resolve", resolve)(launched)

        steps._resolve = timed_resolve
    switch = os.environ.get("XINSERVE_BENCH_SWITCH_INTERVAL_S")
    if switch:  # an experiment's arm: the GIL switch interval, over the one ``WorkerLoop.run`` sets
        run = loop._run

        def run_with_interval():
            sys.setswitchinterval(float(switch))
            return run()

        loop._run = run_with_interval
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _dump)


def compile_with_cpp_wrapper(on: bool) -> None:
    """An experiment's arm: inductor's C++ wrapper for the decode buckets on or off, whatever the
    product's default (the C++ wrapper runs a whole graph with the GIL released once)."""
    from xinserve.engines import direct_call

    def call(self, graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(graph, example_inputs, config_patches={"cpp_wrapper": on})
        if hasattr(self._local, "graphs"):
            self._local.graphs.append((compiled, list(example_inputs)))
        return compiled

    direct_call.GraphRecorder.__call__ = call


def patch_worker_loop() -> None:
    from xinserve.server import worker

    wrapper = os.environ.get("XINSERVE_BENCH_CPP_WRAPPER")
    if wrapper is not None:
        compile_with_cpp_wrapper(wrapper == "1")

    init = worker.WorkerLoop.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        install(self)

    worker.WorkerLoop.__init__ = recording_init
